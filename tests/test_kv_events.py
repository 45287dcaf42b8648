"""vLLM's KV event protocol in the lab: schema and decoding, the prefix-cache mirror, the publisher's
framing and replay socket, the subscriber's gap handling and bad input, captures, and the CLI."""

from __future__ import annotations

import io
import time
from argparse import Namespace

import msgspec
import pytest
import zmq

from engine import EngineConfig, SamplingParams
from engine.block_manager import NONE_HASH, block_hash
from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.capture import (Capture, CaptureBatch, CaptureReplay, CaptureWriter, dumps_capture, new_header,
                            read_capture)
from engine.kv_events import MalformedBatch, decode_batch, encode_batch, external_hash, hash_key
from engine.kv_publisher import KVEventPublisher
from engine.watch.kv_subscriber import KVEventSubscriber
from engine.watch.command import replay as replay_cli
from engine.watch.command import watch as watch_cli


def stored(tokens: list[int], block_size: int, parent: str = NONE_HASH) -> tuple[dict, list[str]]:
    """A BlockStored event in the lab's form for ``tokens`` (whole blocks) chained from ``parent``."""
    hashes, p = [], parent
    for i in range(0, len(tokens), block_size):
        p = block_hash(p, tokens[i:i + block_size])
        hashes.append(p)
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None if parent == NONE_HASH else parent,
             "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}
    return event, hashes


def key(lab_hash: str) -> str:
    return hash_key(external_hash(lab_hash))


# --- schema ------------------------------------------------------------------------------------------------


def test_encode_is_vllm_032_layout_and_decodes_back():
    ev, hashes = stored([1, 2, 3, 4], 2)
    payload = encode_batch([ev, {"type": "BlockRemoved", "block_hashes": [hashes[1]], "medium": "GPU"},
                            {"type": "AllBlocksCleared"}], ts=12.5, data_parallel_rank=3)
    raw = msgspec.msgpack.decode(payload)
    # vLLM 0.32: the batch an array [ts, events, rank]; each event a map tagged by "type"; hashes 64-bit ints
    assert raw[0] == 12.5 and raw[2] == 3
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_hashes"] == [external_hash(h) for h in hashes]
    assert list(raw[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys"]  # one None per hash, as vLLM sends
    assert raw[1][2] == {"type": "AllBlocksCleared"}
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 3
    assert batch.events[0]["block_hashes"] == [key(h) for h in hashes]
    assert batch.events[0]["parent_block_hash"] is None and batch.events[0]["token_ids"] == [1, 2, 3, 4]
    assert batch.events[1] == {"type": "BlockRemoved", "block_hashes": [key(hashes[1])], "medium": "GPU"}


def test_external_hash_is_vllms_low_64_bits():
    h = block_hash(NONE_HASH, [7, 8])
    assert external_hash(h) == int.from_bytes(bytes.fromhex(h), "big") & ((1 << 64) - 1)
    assert hash_key(b"\x01\x02") == "0102" and hash_key(255) == "00000000000000ff"


def test_decodes_the_array_tagged_events_of_sglang_and_earlier_vllm():
    # the structs of vLLM's example subscriber and SGLang's copy of the schema: events array_like, tag first
    class Ev(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
        pass

    class BlockStored(Ev):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(Ev):
        block_hashes: list[int]
        medium: str | None

    class Batch(msgspec.Struct, array_like=True):
        ts: float
        events: list[BlockStored | BlockRemoved]

    payload = msgspec.msgpack.encode(Batch(ts=1.0, events=[BlockStored([5, 6], 4, [1, 2, 3, 4], 2, None, "GPU"),
                                                           BlockRemoved([6], "GPU")]))
    assert isinstance(msgspec.msgpack.decode(payload)[1][0], list)  # really the array form
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events[0]["block_hashes"] == [hash_key(5), hash_key(6)]
    assert batch.events[0]["parent_block_hash"] == hash_key(4)
    assert batch.events[1] == {"type": "BlockRemoved", "block_hashes": [hash_key(6)], "medium": "GPU"}


@pytest.mark.parametrize("payload, words", [
    (b"\xc1garbage", "not msgpack"),
    (msgspec.msgpack.encode({"ts": 1}), "expected an array"),
    (msgspec.msgpack.encode([1.0, 5]), "events is"),
    (msgspec.msgpack.encode(["now", []]), "ts is"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]), "BlockMoved"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved"}]]), "no block_hashes"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]), "str"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                    "token_ids": [1, 2, 3], "block_size": 2}]]), "3 token ids for 2 blocks"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                    "token_ids": [1], "block_size": 0}]]), "block_size"),
])
def test_malformed_payloads_are_named(payload, words):
    with pytest.raises(MalformedBatch, match=words):
        decode_batch(payload)


def test_too_many_events_in_one_batch_are_refused():
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}] * 11])
    assert len(decode_batch(payload, max_events=11).events) == 11
    with pytest.raises(MalformedBatch, match="11 events in one batch, more than the limit of 10"):
        decode_batch(payload, max_events=10)


# --- the mirror --------------------------------------------------------------------------------------------


def test_mirror_chains_counts_copies_and_removes():
    m = PrefixCacheMirror()
    ev, hashes = stored([1, 2, 3, 4, 5, 6], 2)
    s = m.apply(0, 1.0, decode_batch(encode_batch([ev])).events)
    k = [key(h) for h in hashes]
    assert (s.stored, s.removed, s.num_blocks, s.num_tokens) == (3, 0, 3, 6)
    assert m.blocks[k[1]].parent == k[0] and m.blocks[k[2]].parent == k[1]
    assert m.prefix_tokens(k[2]) == [1, 2, 3, 4, 5, 6]
    assert m.children() == {None: [k[0]], k[0]: [k[1]], k[1]: [k[2]]}
    # a duplicate physical block of the same content: one hash, two copies
    m.apply(1, 2.0, decode_batch(encode_batch([stored([1, 2], 2)[0]])).events)
    assert m.blocks[k[0]].copies == 2 and m.num_blocks == 4 and len(m.blocks) == 3
    s = m.apply(2, 3.0, decode_batch(encode_batch([{"type": "BlockRemoved", "block_hashes": [hashes[0]]}])).events)
    assert s.removed == 1 and m.blocks[k[0]].copies == 1 and m.num_blocks == 3
    # a removal of a block never seen (stored before the watch began) is counted, not fatal
    m.apply(3, 4.0, [{"type": "BlockRemoved", "block_hashes": ["ffff"], "medium": None}])
    assert m.unknown_removals == 1 and m.num_blocks == 3
    s = m.apply(4, 5.0, [{"type": "AllBlocksCleared"}])
    assert s.cleared and s.removed == 3 and m.num_blocks == 0 and not m.blocks
    assert [h.seq for h in m.history] == [0, 1, 2, 3, 4]
    assert m.prefixes() == set()


def test_mirror_of_the_lab_engine_equals_its_block_manager(make_engine, text_ids):
    """Every KV event the V1 engine records, sent through vLLM's encoding and read back, rebuilds exactly
    the block manager's prefix cache: the same hashes, the same number of physical copies, step by step,
    also across evictions (a small pool) and a reset."""
    engine = make_engine(semantics="v1", block_size=8, num_blocks=24, max_model_len=96)
    system = text_ids[:40]
    m = PrefixCacheMirror()
    bm = engine.block_manager
    removed = 0
    seq = 0
    for wave in range(3):  # later waves need blocks the earlier ones left cached: evictions
        for i in range(6):
            start = 45 + 23 * wave + 3 * i
            engine.add_request((system if wave != 1 else []) + text_ids[start:start + 5 + i],
                               SamplingParams(max_tokens=12))
        while engine.has_unfinished():
            record = engine.step()
            if record.kv_events:
                s = m.apply(seq, 0.0, decode_batch(encode_batch(record.kv_events)).events)
                removed += s.removed
                seq += 1
            want = {key(h): len(blocks) for h, blocks in bm.cached_blocks.items() if blocks}
            assert {h: b.copies for h, b in m.blocks.items()} == want, f"wave {wave}, step {record.step}"
    assert removed > 0, "the pool was meant to be small enough to evict"
    assert m.unknown_removals == 0 and m.orphan_stores == 0
    assert engine.reset_prefix_cache()
    engine.add_request(system[:9], SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        record = engine.step()
        m.apply(seq, 0.0, decode_batch(encode_batch(record.kv_events)).events)
        seq += 1
    assert {h: b.copies for h, b in m.blocks.items()} == {key(h): len(b) for h, b in bm.cached_blocks.items() if b}


# --- publisher and subscriber ------------------------------------------------------------------------------


@pytest.fixture
def pub():
    p = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    yield p
    p.close()


def connect(publisher, replay: bool = True) -> KVEventSubscriber:
    sub = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint if replay else None)
    assert sub.wait_for(lambda v: v.state == "connected", 5), sub.view().state
    time.sleep(0.1)  # the subscription itself travels to the publisher after the connection
    return sub


def test_publisher_frames_are_vllms(pub):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(pub.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    ev, _ = stored([1, 2], 2)
    assert pub.publish([]) is None  # no events, no batch (vLLM's scheduler publishes only non-empty ones)
    assert [pub.publish([ev], ts=5.0) for _ in range(3)] == [0, 1, 2]
    frames = [sub.recv_multipart() for _ in range(3)]
    sub.close(linger=0)
    assert [f[0] for f in frames] == [b""] * 3  # the topic
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2]
    assert all(len(f[1]) == 8 for f in frames)
    assert decode_batch(frames[0][2]).ts == 5.0
    # the replay socket, asked as vLLM's ROUTER expects (an empty delimiter, then 8 bytes), answers the
    # batches from that seq on and an end marker of seq -1 with an empty payload
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart((b"", (1).to_bytes(8, "big")))
    answers = []
    while dealer.poll(2000):
        answers.append(dealer.recv_multipart())
        if answers[-1][2] == (-1).to_bytes(8, "big", signed=True):
            break
    dealer.close(linger=0)
    assert [int.from_bytes(a[2], "big", signed=True) for a in answers] == [1, 2, -1]
    assert answers[-1][3] == b""


def test_a_port_in_use_is_refused_by_name(pub):
    with pytest.raises(ValueError, match="cannot bind KV events endpoint 'tcp://127.0.0.1:"):
        KVEventPublisher(pub.endpoint)
    with pytest.raises(ValueError, match="kv_events_endpoint must be a ZMQ endpoint"):
        EngineConfig(kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="needs a kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    with pytest.raises(ValueError, match="contiguous allocator has no prefix cache"):
        EngineConfig(allocator="contiguous", kv_events_endpoint="tcp://127.0.0.1:0")


def test_subscriber_follows_the_stream_and_joins_late_through_replay(pub):
    e1, h1 = stored([1, 2, 3, 4], 2)
    pub.publish([e1])  # before anyone listens: only the replay socket still has it
    pub.flush()
    sub = connect(pub)
    try:
        pub.publish([{"type": "BlockRemoved", "block_hashes": [h1[1]], "medium": "GPU"}])
        assert sub.wait_for(lambda v: v.received == 2, 5), sub.view()
        v = sub.view()
        assert [(h.seq, h.stored, h.removed, h.replayed) for h in v.mirror.history] == [(0, 2, 0, True),
                                                                                        (1, 0, 1, False)]
        assert v.mirror.num_blocks == 1 and v.state == "live" and v.lost == 0
    finally:
        sub.stop()
    assert sub.view().state == "stopped"


class DroppingPublisher(KVEventPublisher):
    """Sends every batch to its replay buffer but drops the live message of the given seqs (a gap)."""

    def __init__(self, *a, drop=(), **k):
        self.drop = set(drop)
        super().__init__(*a, **k)

    def _loop(self):
        send = self._pub.send_multipart

        def maybe(frames):
            if int.from_bytes(frames[1], "big") not in self.drop:
                send(frames)
        self._pub.send_multipart = maybe
        super()._loop()


@pytest.mark.parametrize("with_replay", [True, False])
def test_a_sequence_gap_is_replayed_or_counted_lost(with_replay):
    p = DroppingPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", drop={1, 2})
    sub = connect(p, replay=with_replay)
    try:
        for i in range(4):
            p.publish([stored([10 * i, 10 * i + 1], 2)[0]])
        assert sub.wait_for(lambda v: v.mirror.last_seq == 3, 5)
        v = sub.view()
        assert v.gaps == 1
        if with_replay:
            assert (v.lost, v.replayed, v.mirror.num_blocks) == (0, 2, 4)
            assert "2 replayed" in v.mirror.notes[-1]
        else:
            assert (v.lost, v.replayed, v.mirror.num_blocks) == (2, 0, 2)
            assert "2 lost" in v.mirror.notes[-1]
    finally:
        sub.stop()
        p.close()


def test_malformed_and_huge_messages_leave_the_subscriber_running():
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", max_events=1000)
    try:
        assert sub.wait_for(lambda v: v.state == "connected", 5)
        time.sleep(0.2)
        good = encode_batch([stored([1, 2], 2)[0]])
        raw.send_multipart((b"", (0).to_bytes(8, "big"), good))
        raw.send_multipart((b"", (1).to_bytes(8, "big"), b"garbage"))
        raw.send_multipart((b"only one frame",))
        raw.send_multipart((b"", (2).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]
                                                                                * 5000])))
        raw.send_multipart((b"", (3).to_bytes(8, "big"), encode_batch([stored([3, 4], 2)[0]])))
        assert sub.wait_for(lambda v: v.mirror.last_seq == 3, 5)
        v = sub.view()
        assert v.malformed == 3 and v.mirror.num_blocks == 2 and v.received == 2
        assert any("batch 1: not msgpack" in e for e in v.errors)
        assert any("5,000 events in one batch" in e for e in v.errors)
        assert any("a message of 1 frames" in e for e in v.errors)
        assert v.state == "live" and v.gaps == 0
    finally:
        sub.stop()
        raw.close(linger=0)


def test_a_publisher_restart_and_an_unreachable_endpoint_are_said():
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
    nobody = KVEventSubscriber("tcp://127.0.0.1:1")
    try:
        assert sub.wait_for(lambda v: v.state == "connected", 5)
        time.sleep(0.2)
        for seq in (0, 1, 2, 1):  # seq 1 again on a connection that never dropped: a duplicate, not a restart
            raw.send_multipart((b"", seq.to_bytes(8, "big"), encode_batch([stored([seq, 9 + seq], 2)[0]])))
        assert sub.wait_for(lambda v: v.duplicates == 1, 5)
        v = sub.view()
        assert v.malformed == 0  # a duplicate number is its own count, not a malformed payload
        assert "batch 1: a duplicate or out-of-order batch (sequence number 1 after 2" in v.last_error
        # the view is kept (a real restart drops the connection first: tests/test_watch_hostile.py)
        assert v.received == 3 and v.mirror.num_blocks == 3 and v.mirror.total_removed == 0
        raw.close(linger=0)
        assert sub.wait_for(lambda v: v.state == "disconnected", 5)
        assert nobody.wait_for(lambda v: v.state == "unreachable", 5)
        assert sub.view().mirror.num_blocks == 3  # what was shown stays
    finally:
        sub.stop()
        nobody.stop()
    with pytest.raises(ValueError, match="KV events endpoint must be a ZMQ endpoint .* got 'nonsense'"):
        KVEventSubscriber("nonsense")
    with pytest.raises(ValueError, match="the port must be a number from 1 to 65535, got '99999'"):
        KVEventSubscriber("tcp://127.0.0.1:99999")
    with pytest.raises(ValueError, match="is the address a server binds"):
        KVEventSubscriber("tcp://*:5557")
    with pytest.raises(ValueError, match="replay endpoint 'tcp://127.0.0.1' needs a host and a port"):
        KVEventSubscriber("tcp://127.0.0.1:5557", "tcp://127.0.0.1")
    with pytest.raises(ValueError, match="kv_events_endpoint 'tcp://127.0.0.1:70000': the port"):
        EngineConfig(kv_events_endpoint="tcp://127.0.0.1:70000")


def test_the_lab_engine_publishes_what_it_records(make_engine, text_ids):
    engine = make_engine(semantics="v1", block_size=8, num_blocks=32, max_model_len=96,
                         kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0")
    sub = connect(engine.kv_event_publisher)
    try:
        for i in range(3):
            engine.add_request(text_ids[:30] + text_ids[40 + i: 45 + i], SamplingParams(max_tokens=6))
        records = []
        while engine.has_unfinished():
            records.append(engine.step())
        batches = [r.kv_events for r in records if r.kv_events]
        assert sub.wait_for(lambda v: v.received == len(batches), 5), (sub.view().received, len(batches))
        v = sub.view()
        for summary, events in zip(v.mirror.history, batches):
            assert summary.stored == sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
        want = {key(h): len(b) for h, b in engine.block_manager.cached_blocks.items() if b}
        assert {h: b.copies for h, b in v.mirror.blocks.items()} == want
    finally:
        sub.stop()
        engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.kv_event_publisher.publish([stored([1, 2], 2)[0]])


# --- captures and the CLI ----------------------------------------------------------------------------------


def small_capture() -> Capture:
    e1, h1 = stored([1, 2, 3, 4], 2)
    e2, _ = stored([5, 6], 2, parent=h1[1])
    payloads = [encode_batch([e1]), encode_batch([e2]), encode_batch([{"type": "BlockRemoved", "block_hashes": [h1[0]]}]),
                encode_batch([{"type": "AllBlocksCleared"}])]
    return Capture(header=new_header("test", ["tcp://x:1"]),
                   batches=[CaptureBatch(rank=0, seq=i, t=0.1 * i, payload=p) for i, p in enumerate(payloads)])


def test_capture_round_trip_and_replay_positions(tmp_path):
    cap = small_capture()
    text = dumps_capture(cap)
    back = read_capture(text.encode())
    assert [(b.seq, b.payload) for b in back.batches] == [(b.seq, b.payload) for b in cap.batches]
    replay = CaptureReplay(back, every=2)
    counts = [replay.state(k).mirrors[0].num_blocks for k in range(len(replay) + 1)]
    assert counts == [0, 2, 3, 2, 0]
    # from a checkpoint (k=2 and 4 kept) or from scratch: the same state
    assert CaptureReplay(back, every=1000).state(3).mirrors[0].blocks.keys() == replay.state(3).mirrors[0].blocks.keys()
    with pytest.raises(ValueError, match="position 5 is outside"):
        replay.state(5)


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ('{"kind": "batch"}\n', "line 1: not a capture header"),
    ('{"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 9}\n', "version 9"),
    ('{"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 1}\nnot json\n', "line 2: not JSON"),
    ('{"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 1}\n'
     '{"kind": "batch", "rank": 0, "seq": "x", "t": 0, "payload": ""}\n', "line 2: batch field 'seq'"),
    ('{"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 1}\n'
     '{"kind": "batch", "rank": 0, "seq": 0, "t": 0, "payload": "!!"}\n', "line 2: batch payload is not base64"),
    ('{"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 1}\n{"kind": "x"}\n', "line 2: kind 'x'"),
])
def test_bad_captures_are_refused_by_line(text, words):
    with pytest.raises(ValueError, match=words):
        read_capture(text.encode())


def test_a_malformed_batch_in_a_capture_is_skipped_with_its_reason():
    cap = small_capture()
    cap.batches.insert(1, CaptureBatch(rank=0, seq=9, t=0.0, payload=b"junk"))
    state = CaptureReplay(cap).state(len(cap.batches))
    assert state.errors == ["rank 0 batch 9: skipped, not msgpack: input data was truncated"] or \
        state.errors[0].startswith("rank 0 batch 9: skipped, not msgpack")


def test_cli_watch_records_and_replay_prints_the_same(pub, tmp_path):
    path = tmp_path / "cap.jsonl"
    out = io.StringIO()
    args = Namespace(endpoints=[pub.endpoint], replay_endpoint=[pub.replay_endpoint], topic="", record=str(path),
                     duration=None, max_batches=3, tokenizer=None)
    e1, h1 = stored([1, 2, 3, 4], 2)
    pub.publish([e1])
    pub.publish([stored([5, 6], 2, parent=h1[1])[0]])
    pub.publish([{"type": "BlockRemoved", "block_hashes": [h1[1]], "medium": "GPU"}])
    pub.flush()
    assert watch_cli(args, out=out) == 0
    assert read_capture(path).header["block_size"] == 2  # learned from the events, written at the end
    text = out.getvalue()
    assert "#0      +2    stored  -0    removed  cache 2 blocks = 4 tokens  (replayed)" in text
    assert "#2      +0    stored  -1    removed  cache 2 blocks = 4 tokens" in text
    assert "rank 0: 2 cached blocks (2 distinct) = 4 tokens, 2 prefix roots" in text
    assert "a tree of 1 block" in text
    out2 = io.StringIO()
    assert replay_cli(Namespace(file=str(path), speed=0.0, tokenizer=None), out=out2) == 0
    watched = [line.replace("  (replayed)", "") for line in text.splitlines() if line.startswith("rank 0  #")]
    replayed = [line.replace("  (replayed)", "") for line in out2.getvalue().splitlines() if line.startswith("rank 0  #")]
    assert watched == replayed and len(watched) == 3


def test_capture_writer_output_is_a_valid_capture_line_by_line(tmp_path):
    path = tmp_path / "c.jsonl"
    w = CaptureWriter(path, new_header("t", ["e"]))
    w.write(0, 0, 100.0, encode_batch([stored([1, 2], 2)[0]]))
    assert len(read_capture(path).batches) == 1  # flushed as it goes: an interrupted run is still readable
    w.write(0, 1, 100.5, encode_batch([{"type": "AllBlocksCleared"}]))
    w.close()
    cap = read_capture(path)
    assert [b.t for b in cap.batches] == [0.0, 0.5]


def test_replay_checkpoints_stay_bounded_on_a_long_capture():
    e, _ = stored([1, 2], 2)
    batches = [CaptureBatch(rank=0, seq=i, t=0.0, payload=encode_batch([e] if i % 2 == 0 else
                                                                       [{"type": "AllBlocksCleared"}]))
               for i in range(1000)]
    replay = CaptureReplay(Capture(header=new_header("t", []), batches=batches), every=4, max_checkpoints=10)
    assert replay.state(1000).mirrors[0].num_blocks == 0
    assert len(replay._checkpoints) <= 10 and replay.every == 128
    assert replay.state(999).mirrors[0].num_blocks == 1 and replay.state(3).mirrors[0].num_blocks == 1


def test_a_view_is_copied_only_when_the_cache_changed(pub):
    sub = connect(pub)
    try:
        pub.publish([stored([1, 2], 2)[0]])
        assert sub.wait_for(lambda v: v.received == 1, 5)
        a, b = sub.view(), sub.view()
        assert a.mirror is b.mirror  # nothing changed: the same read-only copy
        pub.publish([stored([3, 4], 2)[0]])
        assert sub.wait_for(lambda v: v.received == 2, 5)
        c = sub.view()
        assert c.mirror is not a.mirror and (a.mirror.num_blocks, c.mirror.num_blocks) == (1, 2)
    finally:
        sub.stop()


def test_the_published_rank_is_the_configured_one(make_engine, text_ids):
    engine = make_engine(semantics="v1", block_size=8, num_blocks=16, kv_events_endpoint="tcp://127.0.0.1:0",
                         kv_events_replay_endpoint="tcp://127.0.0.1:0", kv_events_data_parallel_rank=3)
    try:
        engine.add_request(text_ids[:17], SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        engine.kv_event_publisher.flush()
        sub = connect(engine.kv_event_publisher)
        assert sub.wait_for(lambda v: v.received == 1, 5)
        sub.stop()
        assert decode_batch(sub.raw_batches()[0].payload).data_parallel_rank == 3
    finally:
        engine.close()
    with pytest.raises(ValueError, match="kv_events_data_parallel_rank must be an integer >= 0, got -1"):
        EngineConfig(kv_events_data_parallel_rank=-1)


def test_a_capture_across_a_server_restart_replays_the_restart():
    cap = small_capture()  # seq 0..3, ending with AllBlocksCleared
    again = small_capture().batches[:2]  # a restarted server: seq 0, 1 again
    cap.batches += [CaptureBatch(rank=0, seq=b.seq, t=1.0 + b.t, payload=b.payload) for b in again]
    final = CaptureReplay(cap).state(len(cap.batches)).mirrors[0]
    assert final.num_blocks == 3 and any("the publisher restarted" in n for n in final.notes)
    assert [h.cleared for h in final.history] == [False, False, False, True, True, False]


class LossyReplayPublisher(KVEventPublisher):
    """A replay socket that loses messages on the way, as a ROUTER at its send limit does (vLLM's: 1,000):
    the first answer skips the batches in ``lose``; later answers are whole."""

    def __init__(self, *a, lose=(), **k):
        self.lose, self.answers = set(lose), 0
        super().__init__(*a, **k)

    def _serve_replay(self):
        send = self._replay.send_multipart
        first = self.answers == 0

        def maybe(frames):
            if not (first and len(frames) == 5 and int.from_bytes(frames[3], "big", signed=True) in self.lose):
                send(frames)
        self._replay.send_multipart = maybe
        try:
            super()._serve_replay()
        finally:
            self._replay.send_multipart = send
            self.answers += 1


def join_after(p: KVEventPublisher, n: int) -> KVEventSubscriber:
    """Publish ``n`` one-block batches, then subscribe: everything must come from the replay socket."""
    for i in range(n):
        p.publish([stored([i, 100 + i], 2)[0]])
    p.flush()
    return KVEventSubscriber(p.endpoint, p.replay_endpoint)


def test_holes_in_a_replay_answer_are_asked_for_again():
    p = LossyReplayPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", lose={3, 4, 7})
    try:
        sub = join_after(p, 10)
        try:
            assert sub.wait_for(lambda v: v.received == 10, 10), sub.view()
            v = sub.view()
            assert [h.seq for h in v.mirror.history] == list(range(10))
            assert v.lost == 0 and v.mirror.num_blocks == 10 and p.answers >= 2
        finally:
            sub.stop()
    finally:
        p.close()


def test_batches_the_publisher_no_longer_buffers_are_counted_lost_and_said():
    p = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=4)
    try:
        sub = join_after(p, 10)
        try:
            assert sub.wait_for(lambda v: v.received == 4, 10), sub.view()
            v = sub.view()
            assert [h.seq for h in v.mirror.history] == [6, 7, 8, 9]
            # joining: batches 0-5 were published (and dropped from the buffer) before the watch began
            assert v.lost == 0 and v.before_watch == 6
            assert any("batches 0-5 (published before this watch began: not counted as lost) are no longer "
                       "buffered" in n for n in v.mirror.notes), v.mirror.notes
        finally:
            sub.stop()
    finally:
        p.close()


def test_a_silent_replay_socket_is_said():
    p = KVEventPublisher("tcp://127.0.0.1:0")
    dead = zmq.Context.instance().socket(zmq.ROUTER)  # bound, never answers
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub = KVEventSubscriber(p.endpoint, f"tcp://127.0.0.1:{port}", replay_timeout_s=0.3)
        try:
            assert sub.wait_for(lambda v: any("did not answer" in n for n in v.mirror.notes), 10), sub.view()
            time.sleep(0.2)
            p.publish([stored([1, 2], 2)[0]])
            assert sub.wait_for(lambda v: v.received == 1, 10)
        finally:
            sub.stop()
    finally:
        dead.close(linger=0)
        p.close()


@pytest.mark.parametrize("argv, words", [
    (["replay", "/nonexistent/c.jsonl"], "no such file"),
    (["replay", "/tmp"], "no such file"),
    (["watch", "tcp://127.0.0.1:5557", "--max-batches", "0"], "--max-batches must be at least 1"),
    (["watch", "tcp://127.0.0.1:5557", "--duration", "-1"], "--duration must be a number of seconds > 0"),
    (["watch", "tcp://127.0.0.1:5557", "--record", "/nonexistent/dir/c.jsonl"], "does not exist"),
    (["watch", "tcp://127.0.0.1:99999"], "the port must be a number from 1 to 65535"),
    (["watch", "tcp://127.0.0.1:5557", "--tokenizer", "/nonexistent"], "is not a folder"),
    (["replay", "--tokenizer", "/tmp", "assets/captures/vllm-shared-prefix.jsonl"], "no tokenizer could be loaded"),
])
def test_cli_bad_arguments_get_one_line(argv, words, capsys):
    from engine.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1


def test_an_unreadable_batch_in_a_capture_is_not_a_gap():
    cap = small_capture()
    cap.batches[1] = CaptureBatch(rank=0, seq=1, t=0.1, payload=b"\xc1junk")
    state = CaptureReplay(cap).state(len(cap.batches))
    assert len(state.errors) == 1 and state.errors[0].startswith("rank 0 batch 1: skipped, not msgpack")
    assert not any("gap" in n for n in state.mirrors[0].notes)


def test_metrics_parse_and_a_page_that_is_not_metrics():
    import http.server
    import threading as th

    from engine.metrics import cached_share_pct, server_hit_rate_pct, server_kv_usage_pct, usable_pool_blocks
    from engine.watch.server_metrics import fetch_metrics, parse_metrics

    text = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="32",num_gpu_blocks="33"} 1.0\n'
            '# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine="0"} 200.0\n'
            '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0"} 50.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n')
    m = parse_metrics(text)
    assert (m["num_gpu_blocks"], m["block_size"], m["prefix_cache_queries"], m["prefix_cache_hits"]) == (33, 32, 200, 50)
    assert server_hit_rate_pct(m) == 25.0 and server_kv_usage_pct(m) == 25.0
    assert usable_pool_blocks(33) == 32 and cached_share_pct(8, 33) == 25.0 and cached_share_pct(8, None) is None

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<!-- not metrics --><html></html>")

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), Html)
    th.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match="is not a Prometheus /metrics page"):
            fetch_metrics(f"http://127.0.0.1:{srv.server_port}/metrics")
    finally:
        srv.shutdown()
    with pytest.raises(ValueError, match="cannot read metrics from http://127.0.0.1:1/metrics"):
        fetch_metrics("http://127.0.0.1:1/metrics")


def test_a_copy_taken_between_a_restart_and_the_next_batch_keeps_the_restart():
    m = PrefixCacheMirror()
    m.apply(0, 1.0, [stored([1, 2], 2)[0]])
    m.restart(0)
    clone = m.copy()
    assert clone.apply(0, 2.0, []).cleared  # the restart marks the next batch, in the copy too
    assert clone.blocks is not m.blocks and clone.history is not m.history
