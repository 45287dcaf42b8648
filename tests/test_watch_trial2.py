"""The second operator trial of watching a server (a hostile sender, captures, replay): memory bounded by
size, a replay that counts what the live watch counted, an oversized message counted once, a gap before an
unreadable batch, impossible seq / rank values in a capture, the tree headline, wording, replay's waits.

Sockets are on 127.0.0.1 (the helpers of tests/test_watch_hostile.py); no test sends more than a few KB."""

from __future__ import annotations

import base64
import io
import json
import re
import time
from argparse import Namespace
from types import SimpleNamespace

import msgspec
import pytest

from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.capture import CaptureReplay, dumps_capture, new_header, read_capture
from engine.kv_events import MAX_BLOCK_SIZE, MalformedBatch, decode_batch, encode_batch
from engine.watch.kv_subscriber import KVEventSubscriber
from engine.watch.command import replay as replay_cli
from engine.watch.command import state_lines, summary_line
from engine.watch.command import watch as watch_cli
from test_watch_hostile import XPub, frames, send_until, stored, watch_args, watched  # noqa: F401 (fixture)

HEADER = json.dumps(new_header("test", ["tcp://127.0.0.1:1"])) + "\n"


def batch_json(seq: int, payload: bytes, rank: int = 0, ts: float | None = None) -> str:
    obj = {"kind": "batch", "rank": rank, "seq": seq, "t": 0.0, "payload": base64.b64encode(payload).decode()}
    if ts is not None:
        obj["ts"] = ts
    return json.dumps(obj) + "\n"


def stream_counts(text: str) -> str:
    """The counts of the final 'stream:' line (the live one ends '; last state ...')."""
    line = next(line for line in text.splitlines() if line.startswith("  stream:"))
    return line.split(";")[0]


# --- 1. memory bounded by size, not only by blocks --------------------------------------------------------


def fat_block(n: int) -> bytes:
    """The trial's BlockStored: one block of block_size ``n`` with ``n`` token ids (vLLM's wire form)."""
    enc = msgspec.msgpack.Encoder()
    return enc.encode([1.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                              "token_ids": [1] * n, "block_size": n, "lora_id": None, "medium": "GPU",
                              "lora_name": None}], 0])


def test_a_block_of_millions_of_tokens_is_malformed_naming_its_size():
    with pytest.raises(MalformedBatch, match=r"block_size 3,000,000, more than the 4,096 tokens per block"):
        decode_batch(fat_block(3_000_000))
    assert decode_batch(fat_block(MAX_BLOCK_SIZE)).events[0]["block_size"] == MAX_BLOCK_SIZE


def test_the_mirror_keeps_at_most_max_token_ids_and_says_so():
    m = PrefixCacheMirror(max_token_ids=1000)
    for s in range(30):
        m.apply(s, 1.0, [{"type": "BlockStored", "block_hashes": [f"{s:016x}"], "parent_block_hash": None,
                          "token_ids": [s] * 256, "block_size": 256, "medium": "GPU"}])
    assert sum(len(b.token_ids) for b in m.blocks.values()) <= 1000 and len(m.blocks) == 3
    assert m.capped_out == 27 and "1,000 token ids (its memory cap)" in " ".join(m.notes)
    m.apply(30, 1.0, [{"type": "BlockRemoved", "block_hashes": [f"{29:016x}"]}])
    assert m._kept_tokens == 512  # a removal gives its tokens back


def test_the_subscribers_capture_is_bounded_in_bytes(watched):
    pub, sub = watched(max_capture_bytes=5000)
    msgs = [frames(s, encode_batch([stored(s + 1, block_size=200)])) for s in range(20)]  # ~1.4 KB each
    assert send_until(pub, sub, msgs, lambda v: v.received == 20), sub.view()
    kept = sub.raw_batches()
    assert sum(len(r.payload) for r in kept) <= 5000 and sub.capture_bytes <= 5000
    assert sub.capture_dropped == 20 - len(kept) > 0 and kept[-1].seq == 19


def test_the_server_page_says_when_its_capture_was_cut():
    from ui.server import LiveSet

    live = LiveSet(endpoints=["tcp://127.0.0.1:1"], replays=[None], subs=[SimpleNamespace(capture_dropped=0)])
    assert live.capture_cut() is None
    live.subs[0].capture_dropped = 1234
    assert live.capture_cut().startswith("the capture was cut: the first 1,234 batches were dropped")
    assert "64 MiB of payloads" in live.capture_cut()


# --- 2. a replay counts what the watch counted -------------------------------------------------------------


def test_a_replay_of_a_watchs_capture_reports_the_same_counts(tmp_path):
    """A late join, a duplicate, an unreadable batch, an impossible jump, a 2-frame message and a gap: before,
    the capture held only the batches applied, so replay saw holes (more gaps and lost), and no join."""
    msgs = [frames(5, encode_batch([stored(1)])), frames(6, encode_batch([stored(2)])),
            frames(6, encode_batch([stored(2)])),           # duplicate
            frames(7, b"garbage\xc1"),                       # malformed, its number read
            frames(8, encode_batch([stored(3)])),
            frames(10**12, encode_batch([stored(4)])),      # impossible jump
            frames(9, encode_batch([stored(5)])),
            (b"", b"xx"),                                    # 2 frames: malformed, no number
            frames(11, encode_batch([stored(6)]))]          # a gap: 10 lost
    x = XPub(msgs)
    out, path = io.StringIO(), tmp_path / "c.jsonl"
    try:
        assert watch_cli(watch_args(x.endpoint, max_batches=5, duration=10.0, record=str(path)), out=out) == 0
    finally:
        x.close()
    live = stream_counts(out.getvalue())
    assert live == ("  stream: 5 batches applied (0 from the replay socket), 2 malformed, 1 duplicate or out of "
                    "order, 1 impossible sequence jump, 1 gap, 1 batch lost, 5 batches published before the "
                    "watch began (not counted as lost)"), out.getvalue()
    back = io.StringIO()
    assert replay_cli(Namespace(file=str(path), speed=0.0, tokenizer=None), out=back) == 0
    assert stream_counts(back.getvalue()) == live, back.getvalue()
    assert "joined at batch 5" in back.getvalue()


def test_a_refused_message_in_a_capture_is_counted_once_on_replay():
    text = (HEADER + batch_json(0, encode_batch([stored(1)])) +
            json.dumps({"kind": "marker", "rank": 0, "t": 0.1, "what": "malformed", "seq": None, "count": 1,
                        "text": "skipped a message ZMQ refused unread", "refused": True}) + "\n" +
            batch_json(2, encode_batch([stored(2)])))
    capture = read_capture(text.encode())
    m = CaptureReplay(capture).state(2).mirrors[0]
    assert (m.malformed, m.gaps, m.lost_batches, m.num_blocks) == (1, 0, 0, 2)
    assert read_capture(dumps_capture(capture).encode()).batches[1].markers == capture.batches[1].markers


# --- 4. a gap before an unreadable batch -------------------------------------------------------------------


def test_replay_sees_a_gap_before_an_unreadable_batch():
    text = HEADER + batch_json(0, encode_batch([stored(1)])) + batch_json(6, b"garbage\xc1") + \
        batch_json(7, encode_batch([stored(2)]))
    m = CaptureReplay(read_capture(text.encode())).state(3).mirrors[0]
    assert (m.gaps, m.lost_batches, m.malformed) == (1, 5, 1)


# --- 5. impossible numbers in a capture ---------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("seq", -5), ("seq", 10**30), ("rank", -3), ("rank", 10**12)])
def test_a_capture_line_with_an_impossible_seq_or_rank_is_refused_by_line(field, value):
    obj = json.loads(batch_json(0, encode_batch([stored(1)])))
    obj[field] = value
    with pytest.raises(ValueError, match=rf"line 3: batch field '{field}' is {value}, expected"):
        read_capture((HEADER + batch_json(0, encode_batch([stored(1)])) + json.dumps(obj) + "\n").encode())


# --- 6. the tree headline counts what watch counts ---------------------------------------------------------


def test_the_tree_headline_counts_the_views_trees_not_only_the_drawn_ones():
    from viz.server import prefix_tree_figure

    m = PrefixCacheMirror()
    for root in range(100):
        for k in range(30):  # chains of 30 blocks: the 1,500 most recent blocks are 50 trees
            h = root * 100 + k
            m.apply(h, 1.0, [{"type": "BlockStored", "block_hashes": [f"{h:016x}"],
                              "parent_block_hash": None if k == 0 else f"{h - 1:016x}",
                              "token_ids": [h, h], "block_size": 2, "medium": "GPU"}])
    title = prefix_tree_figure(m, max_blocks=1500).layout.title.text
    roots = re.search(r"(\d+) prefix roots", state_lines(m)[0]).group(1)
    assert roots == "100" and "3,000 prefixes in 100 trees" in title, title


# --- 7. wording --------------------------------------------------------------------------------------------


def test_gap_notes_use_thousands_separators_and_removals_are_singular():
    m = PrefixCacheMirror()
    m.apply(0, 1.0, [stored_hex(1)])
    m.note_gap(1, 50_001, 0)
    assert m.notes[-1] == "gap: batches 1-50000 missed live; 0 replayed, 50,000 lost (the view may lack their blocks)"
    m.apply(50_001, 1.0, [{"type": "BlockRemoved", "block_hashes": ["ff" * 8]}])
    assert any("note: 1 removal of blocks" in line for line in state_lines(m))
    m.mark_stale("stale")
    m.restart(0)
    assert "the 1 block shown from before the restart is dropped" in m.notes[-1]


def stored_hex(i: int) -> dict:
    return {"type": "BlockStored", "block_hashes": [f"{i:016x}"], "parent_block_hash": None,
            "token_ids": [i, i], "block_size": 2, "medium": "GPU"}


def test_the_first_batch_after_a_restart_says_the_view_was_reset_not_cleared():
    from viz.server import batch_line

    m = PrefixCacheMirror()
    m.apply(0, 1.0, [stored_hex(1)])
    m.restart(0)
    s = m.apply(0, 2.0, [stored_hex(2)])
    assert "view reset: the publisher restarted" in summary_line(0, s) and "cleared" not in summary_line(0, s)
    assert "AllBlocksCleared" not in batch_line(0, s) and "the publisher restarted" in batch_line(0, s)
    real = m.apply(1, 3.0, [{"type": "AllBlocksCleared"}])
    assert "all blocks cleared" in summary_line(0, real)


def test_a_restart_is_said_once(watched):
    pub, sub = watched()
    sub._peer_went_away = True
    sub._restarted()
    from engine.watch.kv_subscriber import RESTARTED

    said = [item for _, item in sub.log_since(0)[0]]
    assert sum(RESTARTED in str(item) for item in said) == 1, said


def test_the_final_state_keeps_the_join_note_after_many_notes():
    m = PrefixCacheMirror()
    m.join_note = "joined at batch 5: the view starts there"
    m.note(m.join_note)
    for k in range(8):
        m.note(f"note {k}")
    assert any("joined at batch 5" in line for line in state_lines(m))


# --- 8. replay --speed: clock jumps wait at most 60 s in all ----------------------------------------------------


def test_replay_clock_jumps_wait_at_most_60_s_in_all(tmp_path, monkeypatch):
    lines = HEADER + "".join(batch_json(s, encode_batch([stored(s + 1)], ts=1.0 + 1e9 * ((s + 1) // 2)), ts=None)
                             for s in range(6))
    path = tmp_path / "jumps.jsonl"
    path.write_text(lines)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    out = io.StringIO()
    assert replay_cli(Namespace(file=str(path), speed=10_000.0, tokenizer=None), out=out) == 0
    assert 60.0 <= sum(slept) <= 60.0 + 1e-6, slept
    assert out.getvalue().count("the server's clock jumps") == 3


def test_a_gap_the_replay_socket_filled_is_counted_on_replay_as_live():
    """A gap whose batches all came back from the replay socket leaves no hole in the capture; the watch
    counted it (1 gap, 0 lost), so the capture's gap marker makes the replay count it too (it saw 0 gaps)."""
    from engine.watch.capture import capture_from_raw
    from engine.kv_publisher import KVEventPublisher
    from test_watch_hostile import raw_pub, subscribed

    p = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")  # its PUB: nobody listens
    pub, port = raw_pub()  # the live stream the watch hears
    for i in range(10):
        p.publish([stored(i + 1)])
    p.flush()
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", p.replay_endpoint)
    try:
        subscribed(sub)
        assert sub.wait_for(lambda v: v.received == 10, 5), sub.view()  # the catch-up: 0-9 replayed
        for i in range(10, 20):
            p.publish([stored(i + 1)])
        p.flush()
        msgs = [frames(s, encode_batch([stored(s + 1)])) for s in (10, 15, 16)]  # 11-14 missed live
        assert send_until(pub, sub, msgs, lambda v: v.received == 17), sub.view()
        v = sub.view()
        assert (v.gaps, v.lost, v.replayed) == (1, 0, 14)
        header = {**new_header("test", [sub.endpoint]), "markers": True}
        capture = read_capture(dumps_capture(capture_from_raw(sub.capture_items(), header)).encode())
    finally:
        sub.stop()
        pub.close()
        p.close()
    m = CaptureReplay(capture).state(len(capture.batches)).mirrors[0]
    assert (m.num_batches, m.gaps, m.lost_batches, m.num_replayed) == (17, 1, 0, 14)
