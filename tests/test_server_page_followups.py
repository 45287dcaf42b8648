"""Follow-ups to issue 23 on the Server page and the lesson progress code.

1. The prefix tree names each block with ``cache_mirror.hash_labels``, as ``watch`` names roots: hashes 1 and 2
   (vLLM's default int hashes, 16 hex digits) read "000000000000" for both when cut to 12 digits, and two bytes
   hashes sharing 12 leading digits read the same.
2. The live caption names every count the subscriber keeps (``viz.server.stream_caption``), read from a
   ``KVEventSubscriber`` fed known batches: a late join, a duplicate, an impossible jump, a gap, a malformed one.
3. ``lessons.progress.decode`` refuses a number too long for ``int`` with the project's own message.

Every socket here is on 127.0.0.1 (a raw PUB in this process, as tests/test_watch_hostile.py does).
"""

from __future__ import annotations

import re
import time

import pytest
import zmq

from engine.watch.cache_mirror import PrefixCacheMirror
from engine.kv_events import decode_batch, encode_batch
from engine.scenarios.url_codec import pack
from lessons import progress


def stored(h: int | str, parent: int | str | None = None) -> dict:
    """A BlockStored of one 2-token block. An int hash goes over the wire as vLLM's 64-bit int (it reads back
    as 16 hex digits); a str is already the hex a bytes hash reads back as (64 digits)."""
    tokens = [len(str(h)) % 50, 7]
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 2, "lora_id": None, "medium": "GPU"}


def wire(event: dict) -> list[dict]:
    """The event as a subscriber decodes it (int hashes through vLLM's encoding)."""
    fix = lambda h: None if h is None else format(h, "064x")  # noqa: E731  (encode_batch takes the lab's hex)
    return decode_batch(encode_batch([{**event, "block_hashes": [fix(h) for h in event["block_hashes"]],
                                       "parent_block_hash": fix(event["parent_block_hash"])}])).events


def hover_labels(fig) -> dict[int, str]:
    """Each drawn block's label in the tree's hover, by its position in the trace."""
    nodes = fig.data[1]
    return {i: re.match(r"block (\S+): tokens", h).group(1) for i, h in enumerate(nodes.hovertext)}


# two bytes hashes (hex of a 32-byte digest) sharing their first 12 digits, and one that differs early
LONG_A = "ab" * 6 + "0" + "5" * 51
LONG_B = "ab" * 6 + "1" + "5" * 51
LONG_C = "cd" * 32


def mirror_with_colliding_prefixes() -> PrefixCacheMirror:
    """Roots 1, 2, 3 (int hashes), LONG_A and LONG_C (bytes hashes); LONG_B is LONG_A's child."""
    m = PrefixCacheMirror()
    seq = 0
    for h in (1, 2, 3):
        m.apply(seq, 1000.0 + seq, wire(stored(h)))
        seq += 1
    for event in (stored(LONG_A), stored(LONG_B, LONG_A), stored(LONG_C)):
        m.apply(seq, 1000.0 + seq, [event])
        seq += 1
    return m


# ------------------------------------------------------------------------------- 1. hash labels
def test_distinct_hashes_get_distinct_labels_in_the_tree():
    from viz.server import prefix_tree_figure

    m = mirror_with_colliding_prefixes()
    fig = prefix_tree_figure(m)
    labels = hover_labels(fig)
    assert len(labels) == len(m.blocks) == 6
    assert len(set(labels.values())) == 6, labels  # before: "000000000000" three times, "abababababab" twice
    # each label is its hash's own beginning: the int hashes in full, the bytes hashes as far as they differ
    for label in labels.values():
        assert sum(h.startswith(label) for h in m.blocks) == 1, label
    assert {"0000000000000001", "0000000000000002", "0000000000000003"} <= set(labels.values())
    assert {LONG_A[:13], LONG_B[:13], LONG_C[:12]} <= set(labels.values())
    # a hover names the parent by the same label as the parent's own hover
    child = next(h for h in fig.data[1].hovertext if h.startswith(f"block {LONG_B[:13]}:"))
    assert f"parent: {LONG_A[:13]}<br>" in child


def test_the_server_page_and_watch_print_the_same_label_for_the_same_root():
    from engine.watch.command import state_lines
    from viz.server import prefix_tree_figure

    m = mirror_with_colliding_prefixes()
    m.apply(6, 1006.0, [stored(LONG_B[:12] + "9" * 52)])  # a root that shares 12 digits with LONG_B too
    watch = [line.split()[1] for line in state_lines(m) if line.startswith("  root ")]
    roots = [h for h in m.blocks if m.blocks[h].parent is None]
    assert len(watch) == len(roots) == 6
    page = set(hover_labels(prefix_tree_figure(m)).values())
    for label in watch:  # every root watch prints is drawn with the very same label
        assert label in page, (label, sorted(page))
    assert "0000000000000002" in watch and LONG_A[:13] in watch


# ------------------------------------------------------------------------------- 2. the stream's counts
def frames(seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    return b"", seq.to_bytes(8, "big"), payload


@pytest.fixture
def fed_view():
    """A KVEventSubscriber (no replay endpoint) fed, by a raw PUB: batch 40 (a late join), 41, 41 again (a
    duplicate), 10**12 (an impossible jump: the next does not continue from it), 42, 45 (a gap: 43 and 44
    lost), 46 not msgpack (malformed), 47. Returns its view once batch 47 is applied."""
    from engine.watch.kv_subscriber import KVEventSubscriber

    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert sub.wait_for(lambda v: sub._conn == "connected", 5), sub.view().state
        time.sleep(0.2)  # the subscription travels to the publisher after the handshake
        batch = lambda seq, h: frames(seq, encode_batch([stored(format(h, "064x"))]))  # noqa: E731
        for m in (batch(40, 1), batch(41, 2), batch(41, 3), batch(10**12, 4), batch(42, 5), batch(45, 6),
                  frames(46, b"not msgpack\xc1"), batch(47, 7)):
            pub.send_multipart(m)
        assert sub.wait_for(lambda v: v.mirror.last_seq == 47, 5), sub.view().errors
        yield sub.view()
    finally:
        sub.stop()
        pub.close()


def test_the_caption_names_every_count_of_a_subscriber_fed_known_batches(fed_view):
    from viz.server import stream_caption

    v = fed_view
    applied = [40, 41, 42, 45, 47]
    assert v.mirror.num_batches == len(applied)
    assert stream_caption(v) == (
        f"batches {len(applied)} applied (0 from the replay socket) · malformed 1 · duplicate or out of order 1 · "
        f"impossible sequence jumps 1 · gaps 1 · lost {45 - 42 - 1} · before the watch began 40 (not lost)")
    # the same batches on the page itself: tests/test_ui_server.py::test_the_caption_names_every_count_on_the_page


# ------------------------------------------------------------------------------- 3. a huge number in a code
@pytest.mark.parametrize("raw", [
    b'{"v":1,"a":{"l1_paging:q1":[' + b"9" * 5000 + b',true]}}',
    b'{"v":' + b"9" * 4301 + b'}',
    b'{"v":1,"s":[-' + b"1" * 60000 + b']}',
])
def test_a_number_too_long_for_int_is_named_not_pythons_limit(raw):
    digits = max(len(run) for run in re.findall(rb"\d+", raw))
    with pytest.raises(ValueError) as info:
        progress.decode(pack(raw))
    said = str(info.value)
    assert said == (f"the progress code holds a number of {digits:,} digits: a code this app wrote has none "
                    f"longer than 15 (an answer)"), said
    assert "Exceeds the limit" not in said and "damaged" not in said


def test_numbers_the_parser_takes_are_still_judged_by_their_entry():
    assert progress.decode(pack(b'{"v":1,"a":{"l1_paging:q1":[27,true]}}')).answers == {
        "l1_paging:q1": {"raw": 27, "correct": True}}
    with pytest.raises(ValueError, match=r"answer to 'l1_paging:q1' is not a plain answer"):
        progress.decode(pack(b'{"v":1,"a":{"l1_paging:q1":[' + b"9" * 4300 + b',true]}}'))
    with pytest.raises(ValueError, match=r"not a version-1 code of this app \(its version is 9999999"):
        progress.decode(pack(b'{"v":' + b"9" * 4300 + b'}'))
