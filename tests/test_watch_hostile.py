"""Watching servers that misbehave (issue 23, items 1-10): a sender, a wrong port, a restart or a capture
can never stop the watcher, and every such case is said.

Every socket here is on 127.0.0.1. A raw PUB (or XPUB, which tells when the subscription reached it) plays
the misbehaving publisher; the size limit is lowered through ``max_message_bytes`` so no test sends more
than a few KB."""

from __future__ import annotations

import io
import re
import socket
import threading
import time
from argparse import Namespace

import msgspec
import pytest
import zmq

from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.capture import (Capture, CaptureBatch, CaptureReplay, capture_from_raw, dumps_capture, new_header,
                            read_capture)
from engine.kv_events import MalformedBatch, decode_batch, encode_batch, hash_key
from engine.watch.kv_subscriber import RESTARTED, KVEventSubscriber
from engine.watch.command import replay as replay_cli
from engine.watch.command import watch as watch_cli

NESTED_1K = b"\x91" * 1000 + b"\xc0"  # the payload: 1,000 nested one-element arrays, then nil


def stored(i: int, parent: int | None = None, block_size: int = 2) -> dict:
    """A BlockStored of one block with hash ``i`` (the lab's form: hex), tokens [i, i + 1]."""
    return {"type": "BlockStored", "block_hashes": [format(i, "064x")],
            "parent_block_hash": None if parent is None else format(parent, "064x"),
            "token_ids": [i, i + 1][:block_size] + [0] * (block_size - 2), "block_size": block_size,
            "lora_id": None, "medium": "GPU"}


def frames(seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    return b"", seq.to_bytes(8, "big"), payload


def raw_pub(port: int | None = None) -> tuple[zmq.Socket, int]:
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    if port is None:
        return sock, sock.bind_to_random_port("tcp://127.0.0.1")
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock, port


def subscribed(sub: KVEventSubscriber) -> None:
    """Wait for ZMQ's handshake with the publisher (the view's state reads live / idle once batches came)."""
    assert sub.wait_for(lambda v: sub._conn == "connected", 5), sub.view().state
    time.sleep(0.2)  # the subscription travels to the publisher after the handshake


@pytest.fixture
def watched():
    """``watched(**kw)`` -> (pub, sub): a raw PUB on a free 127.0.0.1 port and a KVEventSubscriber (``kw``: its
    options) connected and subscribed to it; both closed after the test."""
    made: list[tuple[zmq.Socket, KVEventSubscriber]] = []

    def make(**kw) -> tuple[zmq.Socket, KVEventSubscriber]:
        pub, port = raw_pub()
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", **kw)
        made.append((pub, sub))
        subscribed(sub)
        return pub, sub
    yield make
    for pub, sub in made:
        sub.stop()
        pub.close()


def send_until(pub: zmq.Socket, sub: KVEventSubscriber, messages, done, timeout_s: float = 5.0) -> bool:
    """Send ``messages`` (a list of frame tuples) once, then wait for ``done(view)``."""
    for m in messages:
        pub.send_multipart(m)
    return sub.wait_for(done, timeout_s)


# --- 1. a deeply nested payload ---------------------------------------------------------------------------


def test_a_deeply_nested_payload_is_a_malformed_batch():
    for payload in (NESTED_1K, b"\x91" * 5000 + b"\xc0", b"\x81\xa1k" * 3000 + b"\xc0"):
        with pytest.raises(MalformedBatch, match="nested too deep"):
            decode_batch(payload)


def test_a_deeply_nested_payload_is_skipped_and_the_watch_goes_on(watched):
    pub, sub = watched()
    assert send_until(pub, sub, [frames(0, encode_batch([stored(1)])), frames(1, NESTED_1K),
                                 frames(2, encode_batch([stored(2)]))], lambda v: v.received == 2)
    v = sub.view()
    assert v.malformed == 1 and v.gaps == 0 and v.state == "live"
    assert any(e.startswith("skipped batch 1: nested too deep") for e in v.errors), v.errors
    assert sub._thread.is_alive()


def test_any_error_while_handling_one_message_is_counted_not_fatal(watched, monkeypatch):
    import engine.watch.kv_subscriber as ks

    real = ks.decode_batch
    calls = {"n": 0}

    def flaky(payload, max_events=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("something no decoder should raise")
        return real(payload, max_events=max_events)
    monkeypatch.setattr(ks, "decode_batch", flaky)
    pub, sub = watched()
    assert send_until(pub, sub, [frames(0, encode_batch([stored(1)])), frames(1, encode_batch([stored(2)]))],
                      lambda v: v.received == 1 and v.malformed == 1)
    assert "could not be handled (KeyError" in sub.view().last_error
    assert sub._thread.is_alive()


# --- 2. replay of a hostile capture -----------------------------------------------------------------------


HEADER = '{"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 1}\n'


def test_replay_of_a_deeply_nested_capture_names_the_line(tmp_path, capsys):
    from engine.cli import main

    import base64

    good = base64.b64encode(encode_batch([stored(1)])).decode()
    deep = base64.b64encode(b"\x91" * 5000 + b"\xc0").decode()
    path = tmp_path / "deep.jsonl"
    path.write_text(HEADER + f'{{"kind": "batch", "rank": 0, "seq": 0, "t": 0, "payload": "{good}"}}\n'
                    f'{{"kind": "batch", "rank": 0, "seq": 1, "t": 0, "payload": "{deep}"}}\n')
    assert main(["replay", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert "rank 0 batch 1: skipped, nested too deep" in out and "(line 3 of the capture)" in out
    assert "1 malformed" in out  # the same words as the live watch's count
    path.write_text(HEADER + "[" * 200_000 + "\n")
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2: JSON nested too deep" in err and "Traceback" not in err and err.count("\n") == 1


# --- 3. a message over the size limit ---------------------------------------------------------------------


def test_a_message_over_the_size_limit_is_said_and_the_watch_reconnects(watched):
    pub, sub = watched(max_message_bytes=1000)
    pub.send_multipart(frames(0, encode_batch([stored(1)])))
    pub.send_multipart(frames(1, b"\x00" * 5000))  # over the limit: refused unread, the connection dropped
    assert sub.wait_for(lambda v: v.malformed == 1, 5), sub.view()
    v = sub.view()
    assert "over the size limit of 1,000 bytes" in v.last_error and "reconnected" in v.last_error
    assert v.state != "disconnected"  # the server did not go away
    subscribed(sub)
    assert send_until(pub, sub, [frames(seq, encode_batch([stored(100 + seq)])) for seq in range(2, 40)],
                      lambda v: v.received == 39), sub.view()
    v = sub.view()
    # the refused message was batch 1: counted once, as malformed, not also as a gap and a lost batch
    assert v.mirror.num_blocks == 39 and v.gaps == 0 and v.lost == 0 and v.malformed == 1
    assert v.state == "live"


# --- 4. a server restart ----------------------------------------------------------------------------------


def test_a_restart_marks_the_old_cache_at_once_and_the_first_new_batch_clears_it():
    pub, port = raw_pub()
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        subscribed(sub)
        assert send_until(pub, sub, [frames(s, encode_batch([stored(s + 1)])) for s in range(3)],
                          lambda v: v.received == 3)
        pub.close()
        assert sub.wait_for(lambda v: v.state == "disconnected", 5)
        assert sub.view().mirror.stale is None  # gone is not restarted (yet)
        pub, _ = raw_pub(port)  # the restarted server: a new publisher on the same port, no batch yet
        assert sub.wait_for(lambda v: v.mirror.stale is not None, 5), sub.view()
        v = sub.view()
        assert v.mirror.stale.startswith(RESTARTED) and RESTARTED == ("server restarted: the cache shown is from "
                                                                      "before; the server's is empty")
        assert v.mirror.num_blocks == 3 and v.received == 3  # still shown, marked
        assert "restarted" in v.last_error
        subscribed(sub)
        # its sequence numbers run past the old ones (it published before we reconnected): only the
        # reconnect tells this is a restart, not a gap
        assert send_until(pub, sub, [frames(7, encode_batch([stored(50)]))], lambda v: v.received == 4)
        v = sub.view()
        assert v.mirror.stale is None and v.mirror.prefixes() == {(50, 51)} and v.mirror.history[-1].cleared
        assert v.gaps == 0
        raws = sub.raw_batches()
        assert [r.restart for r in raws] == [False, False, False, True]
        # the capture keeps the restart: a replay ends with the same cache
        back = read_capture(dumps_capture(capture_from_raw(raws, new_header("t", ["e"]))).encode())
        assert back.batches[-1].restart
        assert CaptureReplay(back).state(4).mirrors[0].prefixes() == {(50, 51)}
    finally:
        sub.stop()
        pub.close()


# --- 5. a late join without a replay endpoint -------------------------------------------------------------


def test_a_late_join_without_replay_says_where_the_view_starts(watched):
    pub, sub = watched()
    assert send_until(pub, sub, [frames(40, encode_batch([stored(1)]))], lambda v: v.received == 1)
    v = sub.view()
    assert v.mirror.starts_at == 40 and v.lost == 0 and v.before_watch == 40  # a join point, not a loss
    assert any(n.startswith("joined at batch 40: the view starts there") and "unknown" in n
               for n in v.mirror.notes), v.mirror.notes
    from viz.server import mirror_warnings

    assert any("starts at batch 40" in w and "unknown" in w for w in mirror_warnings(v.mirror))


class XPub:
    """A publisher that sends its messages once a subscriber's subscription reaches it (XPUB says when)."""

    def __init__(self, messages) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.messages = messages
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.sock.poll(10_000):
            self.sock.recv()  # the subscription
            for m in self.messages:
                self.sock.send_multipart(m)

    def close(self) -> None:
        self.thread.join(timeout=11)
        self.sock.close()


def watch_args(endpoint: str, **kw) -> Namespace:
    return Namespace(**{"endpoints": [endpoint], "replay_endpoint": [], "topic": "", "record": None,
                        "duration": None, "max_batches": None, "tokenizer": None, **kw})


def test_watch_prints_the_join_note_live_and_the_streams_counts_at_the_end(tmp_path):
    x = XPub([frames(5, encode_batch([stored(1)])), frames(6, b"garbage"), frames(8, encode_batch([stored(2)]))])
    out = io.StringIO()
    try:
        assert watch_cli(watch_args(x.endpoint, max_batches=2, duration=10.0, record=str(tmp_path / "c.jsonl")),
                         out=out) == 0
    finally:
        x.close()
    text = out.getvalue()
    lines = text.splitlines()
    join = next(i for i, line in enumerate(lines) if "note: joined at batch 5: the view starts there" in line)
    first = next(i for i, line in enumerate(lines) if line.startswith("rank 0  #5"))
    assert join < first  # said while watching, before the first batch, not only in the final state
    assert ("  stream: 2 batches applied (0 from the replay socket), 1 malformed, 0 duplicate or out of order, "
            "0 impossible sequence jumps, 1 gap, 1 batch lost, 5 batches published before the watch began (not "
            "counted as lost)" in text), text
    # 7. the capture keeps each batch's own time beside the receive time
    cap = read_capture(tmp_path / "c.jsonl")
    assert all(b.ts is not None and b.ts == decode_batch(b.payload).ts for b in cap.batches)


# --- 6. a port that is not a ZMQ publisher ----------------------------------------------------------------


class FakeHttp:
    """A TCP server that answers like an HTTP server given ZMQ's greeting (uvicorn: 400, then close), or
    says nothing (``silent``)."""

    def __init__(self, silent: bool = False) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen()
        self.srv.settimeout(0.2)
        self.endpoint = f"tcp://127.0.0.1:{self.srv.getsockname()[1]}"
        self.silent, self.open, self.conns = silent, True, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.open:
            try:
                c, _ = self.srv.accept()
            except OSError:
                continue
            if self.silent:
                self.conns.append(c)
                continue
            c.recv(64)
            c.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            c.close()

    def close(self) -> None:
        self.open = False
        self.thread.join(timeout=2)
        for c in self.conns:
            c.close()
        self.srv.close()


@pytest.mark.parametrize("kind", ["http", "silent", "router"])
def test_a_port_that_is_not_a_publisher_is_said(kind):
    from viz.server import state_line

    if kind == "router":
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        close = router.close
    else:
        server = FakeHttp(silent=kind == "silent")
        endpoint, close = server.endpoint, server.close
    sub = KVEventSubscriber(endpoint, handshake_timeout_s=0.5)
    try:
        assert sub.wait_for(lambda v: v.state == "not_publisher", 5), sub.view().state
        time.sleep(0.3)  # ZMQ retries: it stays said, and never reads "connected" or "went away"
        v = sub.view()
        assert v.state == "not_publisher" and v.detail
        line = state_line(v)
        assert line.startswith("not a KV event publisher") and "went away" not in line
        if kind != "router":
            assert "did not answer ZMQ's handshake" in v.detail and "HTTP" in v.detail
        else:
            assert "not a PUB socket" in v.detail
    finally:
        sub.stop()
        close()


def test_watch_says_not_a_publisher():
    server = FakeHttp()
    out = io.StringIO()
    try:
        assert watch_cli(watch_args(server.endpoint, duration=0.5), out=out) == 0
    finally:
        server.close()
    text = out.getvalue()
    assert f"{server.endpoint}: not a KV event publisher" in text and ": connected" not in text
    assert "last state not_publisher" in text


# --- 7. replay by the server's time -----------------------------------------------------------------------


def paced_capture(with_ts: bool) -> Capture:
    """A late join's capture: every batch received at once (t = 0), made 1 s and then 2 s apart (ts)."""
    stamps = [1000.0, 1001.0, 1003.0]
    return Capture(header=new_header("t", ["e"]), batches=[
        CaptureBatch(rank=0, seq=i, t=0.0, payload=encode_batch([stored(i + 1)], ts=ts), replayed=True,
                     ts=ts if with_ts else None) for i, ts in enumerate(stamps)])


@pytest.mark.parametrize("with_ts", [True, False])  # False: a capture written before ``ts`` was a field
def test_replay_waits_the_servers_time_between_batches(with_ts, tmp_path, monkeypatch):
    import engine.watch.command as w

    path = tmp_path / "c.jsonl"
    text = dumps_capture(paced_capture(with_ts))
    assert ('"ts": 1001.0' in text) == with_ts and '"t": 0.0' in text  # both kept
    path.write_text(text)
    waits: list[float] = []
    monkeypatch.setattr(w.time, "sleep", waits.append)
    assert replay_cli(Namespace(file=str(path), speed=10.0, tokenizer=None), out=io.StringIO()) == 0
    assert waits == pytest.approx([0.1, 0.2])


# --- 8. the mirror's memory ---------------------------------------------------------------------------------


def test_the_mirror_holds_at_most_max_blocks_and_says_so():
    m = PrefixCacheMirror(max_blocks=100)
    for i in range(250):
        m.apply(i, 0.0, [stored(i + 1)] * (2 if i == 200 else 1))  # batch 200 stores its block twice
    assert len(m.blocks) == 100 and m.capped_out == 150
    assert m.num_blocks == sum(b.copies for b in m.blocks.values()) == 101
    assert min(int(h, 16) for h in m.blocks) == 151  # the oldest were dropped
    assert sum("at most 100 distinct blocks" in n for n in m.notes) == 1  # said once
    from viz.server import mirror_warnings

    assert any("memory cap" in w and "150" in w for w in mirror_warnings(m))
    # a copy keeps capping the same way (a replay applies to copies)
    c = m.copy()
    c.apply(250, 0.0, [stored(1000)])
    assert len(c.blocks) == 100 and c.capped_out == 151 and len(m.blocks) == 100


def test_the_mirrors_bookkeeping_stays_bounded_under_churn():
    m = PrefixCacheMirror(max_blocks=50)
    for i in range(20_000):  # store and evict forever: nothing may grow with the number of batches
        m.apply(i, 0.0, [stored(i + 1), {"type": "BlockRemoved", "block_hashes": [format(i + 1, "064x")]}])
    assert len(m.blocks) == 0 and m.capped_out == 0 and len(m._order) <= 2 * 50 + 1024 + 1


def test_the_subscriber_passes_the_cap_to_its_mirror(watched):
    pub, sub = watched(max_blocks=3)
    assert send_until(pub, sub, [frames(0, encode_batch([stored(i + 1) for i in range(5)]))],
                      lambda v: v.received == 1)
    v = sub.view()
    assert len(v.mirror.blocks) == 3 and v.mirror.capped_out == 2


# --- 10. out-of-range flags -------------------------------------------------------------------------------


@pytest.mark.parametrize("speed", ["1e-300", "1e-6", "nan", "inf", "-1", "1e5"])
def test_replay_speed_out_of_range_is_refused_by_value(speed, capsys, tmp_path):
    from engine.cli import main

    path = tmp_path / "c.jsonl"
    path.write_text(dumps_capture(paced_capture(True)))
    assert main(["replay", "--speed", speed, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--speed must be 0 (as fast as possible) or a multiple of the recorded pace from 0.01 to 10000, got " \
           f"{float(speed)}" in err and err.count("\n") == 1


def test_hash_key_of_an_int_is_16_hex_digits():  # the helper above keys blocks as the subscriber does
    assert hash_key(5) == "0000000000000005" and msgspec.msgpack.decode(encode_batch([]))[1] == []


def test_a_restart_with_a_replay_endpoint_catches_up_from_the_new_publishers_first_batch():
    from engine.kv_publisher import KVEventPublisher

    p = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    endpoints = (p.endpoint, p.replay_endpoint)
    sub = KVEventSubscriber(*endpoints)
    try:
        subscribed(sub)
        for i in range(5):
            p.publish([stored(i + 1)])
        assert sub.wait_for(lambda v: v.received == 5, 5)
        p.close()
        assert sub.wait_for(lambda v: v.state == "disconnected", 5)
        p = KVEventPublisher(*endpoints)  # restarted: it publishes before the watcher is back
        for i in range(7):
            p.publish([stored(100 + i)])
        p.flush()
        assert sub.wait_for(lambda v: v.received == 12 and v.mirror.stale is None, 10), sub.view()
        v = sub.view()
        # the new publisher's batches 0-6 came from its replay socket: none of the old blocks, no gap, none lost
        assert v.mirror.prefixes() == {(100 + i, 101 + i) for i in range(7)}
        assert (v.gaps, v.lost, v.malformed) == (0, 0, 0) and v.replayed >= 7
        assert [r.seq for r in sub.raw_batches()][-7:] == list(range(7))
        assert [r.restart for r in sub.raw_batches()] == [False] * 5 + [True] + [False] * 6
    finally:
        sub.stop()
        p.close()


# --- trial after issue 23: impossible jumps, duplicates, removals of unknown blocks ----------------------


def test_an_impossible_sequence_jump_is_not_counted_as_lost_and_the_watch_goes_on(watched):
    pub, sub = watched()
    msgs = [frames(s, encode_batch([stored(s + 1)])) for s in range(3)]
    msgs += [frames(2**64 - 2, encode_batch([stored(99)])), frames(3, encode_batch([stored(4)]))]
    assert send_until(pub, sub, msgs, lambda v: v.mirror.last_seq == 3)
    v = sub.view()
    assert v.lost == 0 and v.gaps == 0 and v.mirror.lost_batches == 0, (v.lost, v.gaps)
    assert (v.jumps, v.malformed, v.duplicates) == (1, 0, 0)  # its own count: the payload was fine
    assert v.received == 4 and v.mirror.num_blocks == 4
    assert any(f"sequence number jumped from 2 to {2**64 - 2}: not counted as lost" in e for e in v.errors)


def test_a_repeated_old_seq_on_the_same_connection_is_a_skipped_duplicate_not_a_restart(watched):
    pub, sub = watched()
    msgs = [frames(s, encode_batch([stored(s + 1)])) for s in range(16)]
    msgs += [frames(13, encode_batch([stored(500)])), frames(16, encode_batch([stored(17)]))]
    assert send_until(pub, sub, msgs, lambda v: v.mirror.last_seq == 16)
    v = sub.view()
    assert v.mirror.num_blocks == 17 and v.received == 17
    assert (v.duplicates, v.malformed, v.jumps) == (1, 0, 0)  # its own count: the payload was fine
    assert v.mirror.starts_at is None and v.lost == 0
    assert not any("joined at" in n or "restarted" in n for n in v.mirror.notes), v.mirror.notes
    assert not any("restarted" in e for e in v.errors), v.errors
    assert any("batch 13: a duplicate or out-of-order batch" in e for e in v.errors), v.errors


def test_a_removal_of_a_hash_never_stored_in_a_complete_watch_is_called_unknown():
    from engine.watch.command import state_lines

    m = PrefixCacheMirror()
    m.apply(0, 0.0, [stored(1)])
    m.apply(1, 0.0, [{"type": "BlockRemoved", "block_hashes": [format(77, "064x")], "medium": "GPU"}])
    text = "\n".join(state_lines(m))
    assert "1 removal of blocks never stored" in text and "before the watch began" not in text, text
    late = PrefixCacheMirror()
    late.starts_at = 5
    late.apply(5, 0.0, [{"type": "BlockRemoved", "block_hashes": [format(77, "064x")], "medium": "GPU"}])
    assert "before the watch began" in "\n".join(state_lines(late))


def test_watch_prints_notes_errors_and_batches_in_the_order_they_arrived():
    msgs = [frames(s, encode_batch([stored(s + 1)])) for s in range(3)]
    msgs += [frames(s, NESTED_1K) for s in range(3, 7)] + [frames(7, encode_batch([stored(8)]))]
    x = XPub(msgs)
    out = io.StringIO()
    try:
        assert watch_cli(watch_args(x.endpoint, max_batches=4, duration=10.0), out=out) == 0
    finally:
        x.close()
    lines = out.getvalue().splitlines()
    order = [next(i for i, line in enumerate(lines) if line.startswith(f"rank 0  skipped batch {s}:"))
             for s in range(3, 7)]
    b2 = next(i for i, line in enumerate(lines) if line.startswith("rank 0  #2 "))
    b7 = next(i for i, line in enumerate(lines) if line.startswith("rank 0  #7 "))
    assert b2 < order[0] < order[1] < order[2] < order[3] < b7, lines


# --- trial after the fixes: a late join is not a loss ------------------------------------------------------


def test_a_late_join_at_a_huge_seq_counts_nothing_lost():
    """The first batch seen is a join point: batches 0 .. 10^9 - 1 were published before the watch began."""
    x = XPub([frames(10**9, encode_batch([stored(1)])), frames(10**9 + 1, encode_batch([stored(2)])),
              frames(10**9 + 3, encode_batch([stored(3)]))])
    out = io.StringIO()
    try:
        assert watch_cli(watch_args(x.endpoint, max_batches=3, duration=10.0), out=out) == 0
    finally:
        x.close()
    text = out.getvalue()
    assert ("3 batches applied (0 from the replay socket), 0 malformed, 0 duplicate or out of order, 0 impossible "
            "sequence jumps, 1 gap, 1 batch lost, 1,000,000,000 batches published before the watch began (not "
            "counted as lost)") in text, text
    assert "joined at batch 1000000000: the view starts there" in text and "(not counted as lost)" in text


def test_watch_counts_duplicates_and_jumps_apart_from_malformed_payloads():
    msgs = [frames(s, encode_batch([stored(s + 1)])) for s in range(3)]
    msgs += [frames(1, encode_batch([stored(50)])),            # a duplicate number
             frames(2, encode_batch([stored(51)])),            # another
             frames(10**12, encode_batch([stored(52)])),       # an impossible jump
             frames(3, b"not msgpack at all\xc1"),             # a malformed payload
             frames(4, encode_batch([stored(5)]))]
    x = XPub(msgs)
    out = io.StringIO()
    try:
        assert watch_cli(watch_args(x.endpoint, max_batches=4, duration=10.0), out=out) == 0
    finally:
        x.close()
    text = out.getvalue()
    assert ("4 batches applied (0 from the replay socket), 1 malformed, 2 duplicate or out of order, 1 impossible "
            "sequence jump, 0 gaps, 0 batches lost") in text, text


def test_a_real_gap_larger_than_max_seq_jump_is_a_gap_and_the_watch_goes_on(watched):
    """A publisher that dropped more than MAX_SEQ_JUMP batches for a subscriber that fell behind (its
    high-water mark): the batch after the jump continues from it, so the jump was real. Before, every later
    batch was skipped as another impossible jump from the last one applied: the watch showed nothing more."""
    from engine.watch.kv_subscriber import MAX_SEQ_JUMP

    far = 3 + MAX_SEQ_JUMP + 17
    pub, sub = watched()
    msgs = [frames(s, encode_batch([stored(s + 1)])) for s in range(3)]
    msgs += [frames(far + k, encode_batch([stored(1000 + k)])) for k in range(5)]
    assert send_until(pub, sub, msgs, lambda v: v.mirror.last_seq == far + 4), sub.view().errors
    v = sub.view()
    assert v.received == 8 and v.mirror.num_blocks == 8
    assert (v.gaps, v.lost, v.jumps, v.malformed) == (1, far - 3, 0, 0)
    assert any(f"continued from batch {far}: the jump from 2 was real" in n for n in v.mirror.notes)


@pytest.mark.slow
def test_watch_receives_a_400000_block_run_from_the_labs_publisher_and_reports_the_cap(monkeypatch):
    """The trial's run: 400,000 distinct blocks (400 batches of 1,000 BlockStored events, 16-token blocks)
    from the project's publisher to ``watch``, whose mirror holds 100,000. Before, watch's poll loop copied
    the whole mirror (0.3-0.9 s at 100,000 blocks) ten times a second under the lock the subscriber needs for
    every batch: it applied about 6,000 blocks a second and stopped (``--duration``) with most of the run
    unreceived. Now it reads counts only while watching and copies the mirror once, for the final state."""
    from engine.watch.cache_mirror import MAX_BLOCKS
    from engine.kv_publisher import KVEventPublisher

    copies = {"n": 0}
    real_copy = PrefixCacheMirror.copy

    def counted(self):
        copies["n"] += 1
        return real_copy(self)
    monkeypatch.setattr(PrefixCacheMirror, "copy", counted)
    p = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")  # a late join replays

    def publish() -> None:
        time.sleep(0.5)
        for b in range(400):
            p.publish([{"type": "BlockStored", "block_hashes": [format(b * 1000 + k + 1, "064x")],
                        "parent_block_hash": None, "token_ids": [k % 500] * 16, "block_size": 16,
                        "lora_id": None, "medium": "GPU"} for k in range(1000)])
    t = threading.Thread(target=publish, daemon=True)
    t.start()
    out = io.StringIO()
    try:
        args = watch_args(p.endpoint, replay_endpoint=[p.replay_endpoint], max_batches=400, duration=120.0)
        assert watch_cli(args, out=out) == 0
    finally:
        t.join(timeout=60)
        p.close()
    text = out.getvalue()
    assert MAX_BLOCKS == 100_000
    assert re.search(r"  stream: 400 batches applied \(\d+ from the replay socket\), 0 malformed, 0 duplicate or "
                     r"out of order, 0 impossible sequence jumps, 0 gaps, 0 batches lost, 300,000 blocks dropped "
                     r"from the view by its 100,000-block cap", text), text[-2000:]
    assert "rank 0: 100,000 cached blocks (100,000 distinct)" in text and "stored 400,000" in text
    assert ("rank 0  note: batch 100: the view holds at most 100,000 distinct blocks and 4,000,000 token ids (its "
            "memory cap)") in text
    assert sum(line.startswith("rank 0  #") for line in text.splitlines()) == 400  # every batch printed
    assert copies["n"] <= 1, copies  # the final state only, never while watching


def test_roots_with_small_int_hashes_print_distinctly():
    """vLLM's default hashes are 64-bit ints, printed as 16 hex digits; a 12-digit prefix of hashes 1 and 2
    was "000000000000" for both."""
    from engine.watch.cache_mirror import hash_labels
    from engine.watch.command import state_lines

    m = PrefixCacheMirror()
    for seq, h in enumerate((1, 2, 3, 2**40, 2**40 + 1)):
        m.apply(seq, 0.0, decode_batch(encode_batch([stored(h)])).events)  # the wire's int hashes, decoded
    roots = [line.split()[1] for line in state_lines(m) if line.startswith("  root ")]
    assert roots == ["0000000000000001", "0000000000000002", "0000000000000003", "0000010000000000",
                     "0000010000000001"]
    # a bytes hash (hex of a digest): 12 digits, more where two shown would read the same
    a, b, c = "ab" * 6 + "0" * 52, "ab" * 6 + "1" + "0" * 51, "cd" * 32
    labels = hash_labels([a, b, c])
    assert labels == {a: "ab" * 6 + "0", b: "ab" * 6 + "1", c: "cd" * 6}


@pytest.mark.parametrize("ts, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"),
                                       (1e300, "1e+300"), (-1.0, "-1.0"), (2**63, str(2**63))])
def test_a_batch_whose_ts_is_not_a_time_is_malformed(ts, shown):
    with pytest.raises(MalformedBatch, match=re.escape(f"ts is {shown}, not a time")):
        decode_batch(msgspec.msgpack.encode([ts, [], 0]))
    assert decode_batch(encode_batch([stored(1)], ts=1_700_000_000.5)).ts == 1_700_000_000.5  # a real one


def test_a_live_batch_with_a_nan_ts_is_counted_malformed_named_and_the_watch_goes_on(watched):
    pub, sub = watched()
    msgs = [frames(0, encode_batch([stored(1)])), frames(1, encode_batch([stored(2)], ts=float("nan"))),
            frames(2, encode_batch([stored(3)], ts=float("inf"))), frames(3, encode_batch([stored(4)]))]
    assert send_until(pub, sub, msgs, lambda v: v.mirror.last_seq == 3)
    v = sub.view()
    assert v.malformed == 2 and v.received == 2 and v.mirror.prefixes() == {(1, 2), (4, 5)}
    assert any(e.startswith("skipped batch 1: ts is nan, not a time") for e in v.errors), v.errors
    assert any(e.startswith("skipped batch 2: ts is inf, not a time") for e in v.errors), v.errors
    assert all(h.ts == h.ts and abs(h.ts) < 1e12 for h in v.mirror.history)


@pytest.mark.parametrize("ts", ["1e300", "NaN", "-5"])
def test_a_capture_line_whose_ts_is_not_a_time_is_refused_by_line(ts):
    import base64

    good = base64.b64encode(encode_batch([stored(1)])).decode()
    text = HEADER + f'{{"kind": "batch", "rank": 0, "seq": 0, "t": 0, "ts": {ts}, "payload": "{good}"}}\n'
    with pytest.raises(ValueError, match=r"line 2: batch field 'ts' is .*expected the publisher's time in seconds"):
        read_capture(text.encode())


def test_a_copy_of_a_full_mirror_is_cheap_and_independent():
    """``view()`` copies the mirror under the lock the subscriber's thread needs for every batch: a copy of
    100,000 blocks took 0.6-1.1 s (each block copied) and starved the subscriber while a page polled."""
    m = PrefixCacheMirror()
    m.apply(0, 0.0, [{"type": "BlockStored", "block_hashes": [format(i, "016x") for i in range(100_000)],
                      "parent_block_hash": None, "token_ids": [7] * (2 * 100_000), "block_size": 2,
                      "lora_id": None, "medium": "GPU"}])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        c = m.copy()
        best = min(best, time.perf_counter() - t0)
    assert best < 0.15, f"copy of 100,000 blocks took {best:.3f} s"
    # independent: the original's later changes (a second copy of a hash, a removal) do not reach the copy
    h0, h1 = format(0, "016x"), format(1, "016x")
    m.apply(1, 0.0, [{"type": "BlockStored", "block_hashes": [h0], "parent_block_hash": None, "token_ids": [7, 7],
                      "block_size": 2, "lora_id": None, "medium": "GPU"},
                     {"type": "BlockRemoved", "block_hashes": [h1], "medium": "GPU"}])
    assert m.blocks[h0].copies == 2 and h1 not in m.blocks and m.num_blocks == 100_000
    assert c.blocks[h0].copies == 1 and c.blocks[h1].copies == 1 and c.num_blocks == 100_000
    m.apply(2, 0.0, [{"type": "BlockRemoved", "block_hashes": [h0], "medium": "GPU"}])
    assert m.blocks[h0].copies == 1 and c.blocks[h0].copies == 1
