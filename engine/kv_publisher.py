"""Publish the lab's KV cache events over ZMQ exactly as vLLM does, so any consumer of vLLM's events
(vLLM's example subscriber, a KV-aware router, the lab's own Server page) reads the lab unchanged.

The wire format is vLLM 0.32's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``):

* a PUB socket sends each batch as three frames ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
  sequence number counting batches from 0, ``payload`` the msgpack ``KVEventBatch`` (``kv_events.py``);
* an optional ROUTER replay socket: a client (REQ or DEALER) sends the first sequence number it wants as
  8 bytes big-endian; the publisher answers every buffered batch from there as ``(topic, seq, payload)``
  and then an end marker ``(b"", (-1).to_bytes(8, "big", signed=True), b"")``;
* the last ``buffer_steps`` batches are kept for replay; the PUB socket drops batches beyond ``hwm``
  queued for a slow subscriber (ZMQ's high-water mark), which is what the replay socket is for.

Like vLLM's, one background thread owns both sockets (ZMQ sockets are not thread-safe) and ``publish``
only queues, so a step never waits on the network. Unlike vLLM's, every endpoint given is bound (vLLM
binds only ``*`` / ``::`` / ipc / inproc and connects to the rest; the lab is always the server side),
and a TCP port of 0 binds a free port, read back from ``endpoint``.

Like vLLM's scheduler, the engine publishes a batch only for a step that produced events.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import zmq

from .kv_events import encode_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """ZMQ publisher of KV event batches in vLLM's framing.

    Args:
        endpoint: where the PUB socket binds, e.g. ``tcp://127.0.0.1:5557``, ``tcp://*:5557``,
            ``ipc:///tmp/kv``; port 0 picks a free port.
        replay_endpoint: where the ROUTER replay socket binds (None: no replay).
        topic: the first frame of every message (vLLM's default "").
        buffer_steps: batches kept for replay (vLLM's default 10,000).
        hwm: ZMQ send high-water mark of the PUB socket, in messages (vLLM's default 100,000).
        data_parallel_rank: written into every batch (vLLM's ``data_parallel_rank``).

    Raises ValueError naming the endpoint when a socket cannot bind (a bad address, a port in use).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, data_parallel_rank: int = 0) -> None:
        self._ctx = zmq.Context.instance()
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue = queue.Queue()
        self._next_seq = 0
        self._seq_lock = threading.Lock()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self.endpoint = _bind(self._pub, endpoint, "endpoint")
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # no send limit per client: the answer is bounded by buffer_steps anyway, and a ROUTER at
                # its limit drops messages silently (vLLM's keeps the default 1,000: the subscriber copes)
                self._replay.set_hwm(0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint, "replay endpoint")
            else:
                self.replay_endpoint = None
        except ValueError:
            self._close_sockets()
            raise
        self.published = 0
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # --- the engine's side -------------------------------------------------------------------------------

    def publish(self, events: list[dict], ts: float | None = None) -> int | None:
        """Queue one batch of the lab's KV events (``StepRecord.kv_events``); returns its sequence number,
        or None for an empty list (nothing is sent, as vLLM sends nothing for a step without events).
        Raises RuntimeError after ``close``."""
        if not self._running:
            raise RuntimeError("the KV event publisher is closed")
        if not events:
            return None
        payload = encode_batch(events, ts=ts, data_parallel_rank=self._rank)
        with self._seq_lock:  # two threads stepping two engines on one publisher still number in order
            seq = self._next_seq
            self._next_seq += 1
            self._queue.put((seq, payload))
        return seq

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait until every queued batch was handed to ZMQ; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        """Send what is queued (up to a second), stop the thread, close the sockets. Idempotent."""
        if not self._running:
            return
        self.flush(1.0)
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the thread that owns the sockets ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            seq, payload = item
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.published += 1
            self._queue.task_done()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # (client id, empty delimiter, start seq): as vLLM's
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def _bind(sock: zmq.Socket, endpoint: str, what: str) -> str:
    """Bind ``endpoint`` (a TCP port 0 means any free port) and return the endpoint actually bound."""
    target = endpoint
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0":
        target = endpoint.rsplit(":", 1)[0] + ":*"
    try:
        sock.bind(target)
    except zmq.ZMQError as exc:
        raise ValueError(f"cannot bind KV events {what} {endpoint!r}: {exc}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound.replace("tcp://0.0.0.0:", "tcp://*:") if endpoint.startswith("tcp://*") else bound
