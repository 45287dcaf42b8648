"""Subscribe to a server's KV cache events (vLLM, SGLang, or the lab itself) in a background thread.

One ``KVEventSubscriber`` per endpoint (vLLM publishes one endpoint per data-parallel rank: the base port
plus the rank). Its thread owns the ZMQ sockets (not thread-safe) and never blocks its reader: it
decodes each batch (``kv_events.decode_batch``), applies it to a ``PrefixCacheMirror`` under a lock, and
keeps the raw batches, bounded, for a capture. A reader (a Streamlit page, the CLI) calls ``view()`` for
a consistent copy whenever it likes.

Protocol (vLLM 0.32, ``vllm/distributed/kv_events.py``; see ``kv_publisher.py``): frames ``(topic, seq,
payload)``, ``seq`` 8 bytes big-endian from 0. When a batch arrives with ``seq > last + 1`` the missed
batches are asked for on the replay socket (a DEALER socket sends ``last + 1``; the ROUTER answers
``(topic, seq, payload)`` per buffered batch, then ``seq = -1`` with an empty payload), applied in order,
and the gap is noted with how many came back. Without a replay endpoint the gap is noted as lost.

The first batch a watch sees (live, or the first the replay socket still holds) is its join point: the
batches numbered before it were published before the watch began. They are counted in ``before_watch``
and said in a note, never counted as lost: ``lost`` is only what went missing while watching.

Robustness (each case counted, described in ``last_error`` / the mirror's notes, and the thread keeps
running, nothing applied is undone): a message that is not three frames or whose payload is not a batch,
however it is built (``malformed``; ``decode_batch`` raises only MalformedBatch, and any other error while
handling one message is counted the same way rather than ending the thread); a batch of more than
``max_events`` events; a message over ``max_message_bytes``; a publisher that restarts; an endpoint nobody
listens on; a port that is not a ZMQ publisher; a server that goes away.

Connection states, read from ZMQ's socket monitor (libzmq 4.3; the events were measured on 127.0.0.1):

    connecting     CONNECT_DELAYED / CONNECTED (TCP up), the ZMTP handshake not done yet
    unreachable    CONNECT_RETRIED before any connection: nothing listens there
    connected      HANDSHAKE_SUCCEEDED: a ZMQ peer that accepts a SUB (then live / idle by batches)
    not_publisher  HANDSHAKE_FAILED_*: something accepted the TCP connection but does not speak ZMTP (e.g.
                   vLLM's HTTP port, which answers the greeting with "400 Bad Request"; a silent one fails
                   after ``handshake_timeout_s``), or a ZMQ socket that refuses a SUB peer (e.g. the replay
                   ROUTER): DISCONNECTED before any handshake and no reconnect (ZMQ gives up on a protocol
                   error). ``detail`` says which.
    disconnected   DISCONNECTED then CONNECT_RETRIED: the publisher went away and ZMQ keeps trying.

Two drops are told apart by what follows DISCONNECTED. A publisher that goes away is followed at once by
CONNECT_RETRIED (ZMQ reconnects after a connection error). A message over ``max_message_bytes``
(``zmq.MAXMSGSIZE``: refused unread, so 300 MB never reaches memory) is a protocol error, after which ZMQ
drops the connection and never reconnects it (``session_base_t::engine_error``): so a drop with no
reconnect event within ``DROP_GRACE_S`` is taken for it, counted as malformed, said, and the subscriber
reconnects itself (``disconnect`` + ``connect``); batches sent meanwhile are a gap, replayed or lost as
any gap.

A restart is seen one way: the connection drops and a handshake succeeds again (a running ZMQ publisher
never closes a subscriber's connection, so the peer is a new process, whose cache is empty): the view is
marked at once (``mirror.mark_stale``) and cleared when the new publisher's first batch arrives (the
catch-up on the replay socket then asks from batch 0); that batch is flagged ``restart`` in the capture. A
live sequence number not above the last one on a connection that never dropped is a duplicate or
out-of-order batch: skipped and counted in ``duplicates`` (not ``malformed``: the payload may be fine), the
view kept. A number more than ``MAX_SEQ_JUMP`` past the last one is held until the next live batch: if that
one continues from it the jump was real (a publisher that dropped batches at its high-water mark for a
subscriber that fell behind) and is a gap like any other; if not, the number was corrupt: skipped, counted
in ``jumps``, not counted as lost batches.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from .cache_mirror import MAX_BLOCKS, PrefixCacheMirror
from ..config import check_endpoint
from ..kv_events import MalformedBatch, decode_batch
from ..kv_publisher import END_SEQ
from ..records import plural

SILENT_AFTER_S = 5.0  # "live" turns "idle" after this long without a batch
DROP_GRACE_S = 0.5  # a drop with no reconnect event within this long was a protocol error (see above)
# A live batch more than this many numbers past the last one is not a gap but a corrupt sequence number:
# vLLM's publisher buffers 10,000 batches for replay (ZmqEventPublisher's buffer_steps), so no real gap that
# could be told apart from a broken number is larger.
MAX_SEQ_JUMP = 10_000
RESTARTED = "server restarted: the cache shown is from before; the server's is empty"
MAX_REPLAY_ROUNDS = 100  # replay requests per gap (each round brings at least one batch, or ends)
# Payload bytes a subscriber keeps for a capture (the Server page's Download capture). 50,000 batches alone did
# not bound it: a batch may be up to max_message_bytes. 64 MiB is a capture read_capture takes after base64
# (4/3 larger, under its 256 MiB) and thousands of real vLLM batches (a few KB each).
MAX_CAPTURE_BYTES = 64 * 2**20


@dataclass
class _ReplayResult:
    applied: int = 0       # batches applied from the replay socket
    skipped: int = 0       # batches asked for that the publisher no longer buffers
    answered: bool = False  # the replay socket answered at all


@dataclass
class RawBatch:
    """One batch as received, for a capture: ``rank`` (the endpoint's index), ``seq``, ``recv_ts``
    (seconds since the epoch, this machine's clock), ``payload`` (msgpack bytes, unchanged),
    ``replayed`` (came from the replay socket after a gap), ``ts`` (the batch's own timestamp, the
    publisher's clock, seconds since the epoch), ``restart`` (the first batch of a restarted publisher)."""
    rank: int
    seq: int
    recv_ts: float
    payload: bytes
    replayed: bool = False
    ts: float | None = None
    restart: bool = False


@dataclass
class StreamMarker:
    """Something the watch counted that left no batch to keep, kept in a capture beside the batches (a
    ``marker`` line, ``capture.py``) so that a replay counts it as the watch did: ``what`` is "malformed"
    (``seq`` None when no number could be read; ``refused``: ZMQ refused it unread, too big), "duplicate",
    "jump" (an impossible sequence jump), "join" (``count`` batches published before the watch began;
    ``starts_at``: the view starts at ``seq`` without them), "gap" (batches ``seq`` .. ``seq + count - 1`` missed
    live, ``recovered`` of them from the replay socket: those are the replayed batches before it) or "lost"
    (``count`` batches from ``seq`` the replay socket no longer held on a reconnect). ``text`` is what the watch
    said."""
    rank: int
    what: str
    seq: int | None
    recv_ts: float
    text: str = ""
    count: int = 1
    refused: bool = False
    starts_at: bool = False
    recovered: int = 0


# a marker's share of the capture's byte budget (its fields besides the text)
_MARKER_BYTES = 128


@dataclass
class SubscriberView:
    """A consistent copy of one subscriber's state for a reader in another thread."""
    endpoint: str
    rank: int
    state: str              # connecting | unreachable | not_publisher | connected | live | idle | disconnected | stopped
    mirror: PrefixCacheMirror
    received: int           # batches applied (live and replayed)
    replayed: int
    malformed: int
    gaps: int
    lost: int               # batches missed that the replay socket did not return (after the watch began)
    last_error: str | None
    last_batch_at: float | None
    errors: list[str] = field(default_factory=list)
    detail: str | None = None  # why the state is what it is, in words (not_publisher)
    before_watch: int = 0   # batches numbered before the first one this watch saw or replayed: not lost
    duplicates: int = 0     # live batches skipped for a number not above the last one (duplicate / out of order)
    jumps: int = 0          # live batches skipped for a number more than MAX_SEQ_JUMP past the last one


class KVEventSubscriber:
    """Watch one KV events endpoint.

    Args:
        endpoint: the publisher's PUB endpoint to connect to, e.g. ``tcp://127.0.0.1:5557``.
        replay_endpoint: its ROUTER replay endpoint (None: gaps are noted as lost).
        topic: subscribe to messages whose first frame starts with this ("" = all, vLLM's default).
        rank: the data-parallel rank this endpoint serves (labels the view).
        max_events: the most events one batch may hold before it is refused as malformed.
        max_message_bytes: ZMQ refuses bigger messages (``zmq.MAXMSGSIZE``) unread and drops the connection;
            the subscriber says so and reconnects.
        max_blocks: distinct blocks the mirror holds (``cache_mirror.MAX_BLOCKS``: its memory cap).
        handshake_timeout_s: a peer that accepts TCP but has not finished ZMQ's handshake by then is not a
            publisher (``zmq.HANDSHAKE_IVL``).
        max_capture: raw batches (and markers) kept for a capture (oldest dropped first; ``capture_dropped``
            counts the batches dropped).
        max_capture_bytes: the payload bytes kept for a capture (``MAX_CAPTURE_BYTES``, 64 MiB; a marker
            counts its text plus 128): past it the oldest are dropped, counted in ``capture_dropped``.
        on_raw: called in the subscriber's thread with each RawBatch (e.g. a recorder writing a file).

    Raises ValueError naming a malformed endpoint (``config.check_endpoint``) or one ZMQ refuses, before the
    thread starts.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", rank: int = 0,
                 max_events: int = 200_000, max_message_bytes: int = 256 * 2**20, max_capture: int = 50_000,
                 max_capture_bytes: int | None = None, on_raw=None, replay_timeout_s: float = 1.0, max_blocks: int = MAX_BLOCKS,
                 handshake_timeout_s: float = 5.0) -> None:
        check_endpoint(endpoint, "KV events endpoint")
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint, "replay endpoint")
        self.endpoint, self.replay_endpoint, self.rank = endpoint, replay_endpoint, rank
        self._topic = topic.encode()
        self._max_events = max_events
        self._max_message_bytes = max_message_bytes
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._on_raw = on_raw
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.mirror = PrefixCacheMirror(rank=rank, max_blocks=max_blocks)
        self._view_copy: tuple[int, PrefixCacheMirror] | None = None  # (version, copy) for view()
        # RawBatch and StreamMarker in the order they happened; bounded by count and by bytes
        self.capture: deque[RawBatch | StreamMarker] = deque()
        self._max_capture = max_capture
        self._max_capture_bytes = MAX_CAPTURE_BYTES if max_capture_bytes is None else max_capture_bytes
        self.capture_bytes = 0
        self.capture_dropped = 0
        self.received = self.replayed = self.malformed = self.gaps = self.lost = 0
        # a join point (the first batch seen, live or replayed) with a number above 0: the batches before it
        # were published before this watch began, so they are counted here, never as lost
        self.before_watch = 0
        # live batches skipped for their sequence number, each its own count (``malformed`` is for payloads
        # and framing): a duplicate or out-of-order number, an impossible jump
        self.duplicates = self.jumps = 0
        self.errors: deque[str] = deque(maxlen=50)  # the last is ``last_error``
        # notes, errors and applied batches in the order they happened: ("note" | "error", text) or
        # ("batch", BatchSummary); ``num_logged`` counts all ever logged (the deque keeps the last 2,000)
        self.log: deque[tuple[str, object]] = deque(maxlen=2000)
        self.num_logged = 0
        self._notes_logged = 0  # mirror notes already copied into ``log``
        self.last_batch_at: float | None = None
        self._last_seq: int | None = None   # the last batch applied (live or replayed)
        self._live_last: int | None = None  # the last batch received on the live socket
        self._held: tuple[int, list[bytes], int] | None = None  # (seq, frames, last applied): a jump, held
        self._conn = "connecting"  # from the socket monitor (see the module docstring)
        self._detail: str | None = None
        self._handshaken = False     # the current connection finished ZMQ's handshake
        self._drop: tuple[float, bool] | None = None  # (when, had it handshaken): DISCONNECTED, no retry yet
        self._peer_went_away = False  # a handshaken connection dropped and ZMQ is reconnecting
        self._restart_pending = False  # restart the view on the next batch applied
        self._flag_restart = False     # the next batch captured is a restarted publisher's first
        self._sync_pending = False  # (re)connected: ask the replay socket for what the stream missed
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.RECONNECT_IVL, 200)
        self._sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._sub.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(handshake_timeout_s * 1000)))
        self._monitor = self._sub.get_monitor_socket()
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self._close()
            raise ValueError(f"cannot connect to KV events endpoint {endpoint!r}: {exc}") from None
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._thread = threading.Thread(target=self._loop, name=f"kv-events-{endpoint}", daemon=True)
        self._thread.start()

    # --- the reader's side -------------------------------------------------------------------------------

    def view(self) -> SubscriberView:
        """A consistent copy. The mirror is copied only when a batch changed it since the last view (a copy
        shares the blocks: 0.01-0.02 s at the 100,000-block cap, ``PrefixCacheMirror.copy``; a page re-reads
        every second); the copy is shared between views of the same version and must be treated as
        read-only."""
        with self._lock:
            if self._view_copy is None or self._view_copy[0] != self.mirror.version:
                self._view_copy = (self.mirror.version, self.mirror.copy())
            return SubscriberView(endpoint=self.endpoint, rank=self.rank, state=self.state,
                                  mirror=self._view_copy[1], received=self.received, replayed=self.replayed,
                                  malformed=self.malformed, gaps=self.gaps, lost=self.lost,
                                  last_error=self.last_error, last_batch_at=self.last_batch_at,
                                  errors=list(self.errors),
                                  detail=self._detail if self._conn == "not_publisher" else None,
                                  before_watch=self.before_watch, duplicates=self.duplicates,
                                  jumps=self.jumps)

    def progress(self) -> tuple[str, int]:
        """(state, batches the mirror applied) without copying the mirror: for a reader that polls often
        (``watch`` polls ten times a second: no copy at all, not even a cheap one, under the lock the
        subscriber's thread needs for every batch)."""
        with self._lock:
            return self.state, self.mirror.num_batches

    def raw_batches(self) -> list[RawBatch]:
        """The raw batches kept so far (for a capture), oldest first."""
        with self._lock:
            return [r for r in self.capture if isinstance(r, RawBatch)]

    def capture_items(self) -> list[RawBatch | StreamMarker]:
        """The raw batches and markers kept so far, in the order they happened: what a capture holds."""
        with self._lock:
            return list(self.capture)

    def _keep(self, item: RawBatch | StreamMarker) -> None:
        """Under the lock: keep ``item`` for a capture, dropping the oldest past either bound."""
        self.capture.append(item)
        self.capture_bytes += _size(item)
        while self.capture and (len(self.capture) > self._max_capture
                                or self.capture_bytes > self._max_capture_bytes):
            old = self.capture.popleft()
            self.capture_bytes -= _size(old)
            self.capture_dropped += isinstance(old, RawBatch)

    @property
    def last_error(self) -> str | None:
        return self.errors[-1] if self.errors else None

    @property
    def state(self) -> str:
        if self._stop.is_set():
            return "stopped"
        if self._conn in ("connecting", "unreachable", "disconnected", "not_publisher"):
            return self._conn
        if self.last_batch_at is None:
            return "connected"
        return "live" if time.time() - self.last_batch_at < SILENT_AFTER_S else "idle"

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close the sockets. Idempotent; the state read so far stays readable."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for(self, predicate, timeout_s: float = 10.0, poll_s: float = 0.02) -> bool:
        """Block until ``predicate(self.view())`` is true (tests, the CLI); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.view()):
                return True
            time.sleep(poll_s)
        return predicate(self.view())

    # --- the thread --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._monitor in ready:
                    self._read_monitor()
                if self._drop is not None and time.monotonic() - self._drop[0] > DROP_GRACE_S:
                    self._dropped_by_zmq()
                if self._sync_pending:
                    self._sync_pending = False
                    self._catch_up()
                if self._sub in ready:
                    frames = self._sub.recv_multipart()
                    try:
                        self._receive(frames)
                    except Exception as exc:  # noqa: BLE001 - one bad message never ends the watch
                        self._malformed(f"a message that could not be handled ({type(exc).__name__}: "
                                        f"{str(exc)[:200]})")
        except Exception as exc:  # never die silently: say what broke, keep what was shown
            self._error(f"subscriber stopped on an unexpected error: {type(exc).__name__}: {exc}")
        finally:
            self._stop.set()
            self._close()

    def _read_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                if self._conn != "not_publisher":  # a not-publisher is retried forever: keep saying so
                    self._conn = "connecting"
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._conn, self._detail, self._handshaken = "connected", None, True
                self._sync_pending = True
                if self._peer_went_away:
                    self._peer_went_away = False
                    self._restarted()
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                           zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                self._not_publisher(f"{self.endpoint} accepted the TCP connection but did not answer ZMQ's "
                                    f"handshake: it is not a KV event publisher (an HTTP port, such as vLLM's "
                                    f"API port, answers this way). vLLM publishes KV events on the endpoint of "
                                    f"its --kv-events-config (default port 5557)")
            elif event == zmq.EVENT_DISCONNECTED:
                if self._conn != "not_publisher":
                    self._drop = (time.monotonic(), self._handshaken)
                self._handshaken = False
            elif event == zmq.EVENT_CONNECT_RETRIED:
                if self._drop is not None:  # ZMQ reconnects after a connection error: the peer went away
                    had_session, self._drop = self._drop[1], None
                    if had_session:
                        self._conn, self._peer_went_away = "disconnected", True
                elif self._conn not in ("disconnected", "not_publisher"):
                    self._conn = "unreachable"

    def _not_publisher(self, detail: str) -> None:
        if self._conn != "not_publisher" or self._detail != detail:
            self._error(f"not a KV event publisher: {detail}")
        self._conn, self._detail = "not_publisher", detail

    def _dropped_by_zmq(self) -> None:
        """ZMQ dropped the connection and did not reconnect: a protocol error (see the module docstring)."""
        _, had_session = self._drop
        self._drop = None
        if not had_session:  # a ZMQ socket that refused a SUB peer during the handshake
            self._not_publisher(f"{self.endpoint} speaks ZMQ but refused a subscriber (ZMQ dropped the connection "
                                f"during the handshake and gave up): it is not a PUB socket (a replay ROUTER "
                                f"endpoint?)")
            return
        limit = self._max_message_bytes
        self._malformed(f"a message ZMQ refused unread: over the size limit of {limit:,} bytes "
                        f"(max_message_bytes), or not valid ZMQ framing; ZMQ dropped the connection for it, "
                        f"so the subscriber reconnected (the first batch missing after it is taken for this "
                        f"message; any others sent meanwhile are a gap)", refused=True)
        try:
            self._sub.disconnect(self.endpoint)
        except zmq.ZMQError:
            pass  # ZMQ already forgot the endpoint
        self._conn = "connecting"
        self._sub.connect(self.endpoint)

    def _restarted(self) -> None:
        """A handshake succeeded after the publisher went away: a new publisher process (see above)."""
        with self._lock:
            self.mirror.mark_stale(f"{RESTARTED} (the connection to {self.endpoint} dropped and came back: a "
                                   f"restarted publisher; the view clears at its first batch)")
        self._error(f"the publisher at {self.endpoint} restarted (it went away and a new one answered)")
        self._restart_pending = True
        self._last_seq = None
        self._live_last = None
        self._held = None

    def _receive(self, frames: list[bytes], replayed: bool = False) -> int | None:
        """Decode and apply one message; returns its seq (None if unreadable)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(f"a message of {len(frames)} frames (sizes {[len(f) for f in frames][:5]}), "
                            f"expected (topic, 8-byte seq, payload)")
            return None
        seq = int.from_bytes(frames[1], "big")
        if not replayed:
            if self._held is not None:
                self._settle_jump(seq)
            if not self._check_sequence(seq, frames):
                return seq
            self._live_last = seq
        return self._apply(seq, frames, replayed)

    def _apply(self, seq: int, frames: list[bytes], replayed: bool) -> int:
        """Decode and apply one batch whose sequence number was accepted."""
        if self._last_seq is not None and seq <= self._last_seq:
            return seq  # already applied (a replay overlapping the live stream)
        try:
            batch = decode_batch(frames[2], max_events=self._max_events)
        except MalformedBatch as exc:
            self._malformed(f"batch {seq}: {exc}", seq=seq)
            self._last_seq = seq
            return seq
        raw = RawBatch(rank=self.rank, seq=seq, recv_ts=time.time(), payload=frames[2], replayed=replayed,
                       ts=batch.ts)
        with self._lock:
            if self._restart_pending:
                self.mirror.restart(seq)
                self._restart_pending, self._flag_restart = False, True
            raw.restart, self._flag_restart = self._flag_restart, False
            summary = self.mirror.apply(seq, batch.ts, batch.events, replayed=replayed)
            self._log("batch", summary)
            self.received += 1
            self.replayed += replayed
            self.last_batch_at = raw.recv_ts
            self._keep(raw)
        self._last_seq = seq
        if self._on_raw is not None:
            self._on_raw(raw)
        return seq

    def _check_sequence(self, seq: int, frames: list[bytes]) -> bool:
        """False when the live batch ``seq`` is skipped: a duplicate or out-of-order batch (a number not above
        the last live one while the connection never dropped: a real restart drops it first, see
        ``_restarted``), or a jump of more than MAX_SEQ_JUMP past the last one, which is held (``_held``)
        until the next live batch tells whether it was real (``_settle_jump``)."""
        if self._live_last is not None and seq <= self._live_last:
            self._skipped("duplicates", f"batch {seq}: a duplicate or out-of-order batch (sequence number {seq} after "
                            f"{self._live_last} on a connection that never dropped); the view is kept", seq=seq)
            return False
        last = self._last_seq if self._last_seq is not None else self._live_last
        if last is not None and seq - last - 1 > MAX_SEQ_JUMP:
            self._held = (seq, frames, last)
            self.note(f"batch {seq}: sequence number jumped from {last} to {seq}, more than {MAX_SEQ_JUMP:,} at once: "
                      f"held until the next batch says whether the publisher really skipped them (it continues "
                      f"from {seq}) or the number is corrupt")
            return False
        last = self._last_seq
        if last is None:
            if seq > 0 and self.replay_endpoint is None:
                self._joined(seq, seq, f"joined at batch {seq}: the view starts there; batches 0-{seq - 1} came before this "
                          f"watch (not counted as lost) and there is no replay endpoint to ask for them, so blocks "
                          f"they stored are unknown (their removals are counted as unknown, their children drawn "
                          f"as roots)")
            elif seq > 0:
                # joined a running publisher: fetch what it still buffers, so the view starts complete
                r = self._replay(0, seq)
                if not r.answered:
                    self._joined(seq, seq, f"joined at batch {seq}; the replay socket {self.replay_endpoint} did "
                                 f"not answer within {self._replay_timeout_ms / 1000:g} s, so batches 0-{seq - 1}, "
                                 f"published before this watch (not counted as lost), are missing")
                    return True
                self._count_unbuffered(0, r, before_watch=True)
                text = (f"joined at batch {seq}; {plural(r.applied, 'earlier batch', 'earlier batches')} came from "
                        f"the replay socket")
                with self._lock:
                    self.mirror.join_note = text
                self.note(text)
            return True
        if seq > last + 1:
            with self._lock:
                if self.mirror.take_refused(last + 1):
                    self._log_notes()
                    last = self._last_seq = last + 1
        if seq > last + 1:
            recovered = self._replay(last + 1, seq).applied
            with self._lock:
                self.gaps += 1
                self.lost += seq - (last + 1) - recovered
                self.mirror.note_gap(last + 1, seq, recovered)
            self._emit(StreamMarker(self.rank, "gap", last + 1, time.time(), count=seq - last - 1,
                                    recovered=recovered))
        return True

    def _settle_jump(self, seq: int) -> None:
        """The live batch after a held jump (see ``_check_sequence``). If it continues from the held number
        (``seq`` = held + 1) the jump was real: a publisher that dropped batches for a subscriber that fell
        behind (ZMQ's send high-water mark drops silently), or one that restarted without the connection
        dropping. It is then a gap (asked of the replay socket, the rest lost) and the held batch is applied:
        skipping it instead would skip every later batch too, each as far past the last applied one. Otherwise
        the held number was corrupt: skipped and counted in ``jumps``, not as lost."""
        held_seq, frames, last = self._held
        self._held = None
        if seq != held_seq + 1:
            self._skipped("jumps", f"batch {held_seq}: sequence number jumped from {last} to {held_seq}: not "
                          f"counted as lost (more than {MAX_SEQ_JUMP:,} batches at once, more than vLLM's replay "
                          f"buffer holds, and the next batch, {seq}, did not continue from it: not a real gap)",
                          seq=held_seq)
            return
        self.note(f"batch {seq} continued from batch {held_seq}: the jump from {last} was real (the publisher "
                  f"skipped or dropped the batches between, e.g. at its high-water mark for a subscriber that fell "
                  f"behind); counted as a gap")
        recovered = self._replay(last + 1, held_seq).applied
        with self._lock:
            self.gaps += 1
            self.lost += held_seq - (last + 1) - recovered
            self.mirror.note_gap(last + 1, held_seq, recovered)
        self._emit(StreamMarker(self.rank, "gap", last + 1, time.time(), count=held_seq - last - 1,
                                recovered=recovered))
        self._live_last = held_seq
        self._apply(held_seq, frames, replayed=False)

    def _catch_up(self) -> None:
        """On every (re)connect: batches published before the subscription reached the publisher (ZMQ's
        "slow joiner") or while the connection was down never arrive live; fetch them from the replay
        socket, from the first one not yet applied."""
        if self.replay_endpoint is None:
            return
        joining = self._last_seq is None
        start = 0 if joining else self._last_seq + 1
        r = self._replay(start, None)
        if not r.answered:
            self.note(f"(re)connected; the replay socket {self.replay_endpoint} did not answer within "
                      f"{self._replay_timeout_ms / 1000:g} s, so batches sent before the subscription are missing")
            return
        self._count_unbuffered(start, r, before_watch=joining)
        if r.applied:
            self.note(f"(re)connected: {plural(r.applied, 'batch', 'batches')} from {start + r.skipped} on came from the replay "
                      f"socket")

    def _count_unbuffered(self, start: int, r: _ReplayResult, before_watch: bool = False) -> None:
        """Count the batches the replay socket no longer held: lost, or, when the watch was joining (nothing
        applied yet), published before it began."""
        if r.skipped:
            with self._lock:
                if before_watch:
                    self.before_watch += r.skipped
                else:
                    self.lost += r.skipped
            self._emit(StreamMarker(self.rank, "join" if before_watch else "lost", start, time.time(),
                                    count=r.skipped))
            when = " (published before this watch began: not counted as lost)" if before_watch else ""
            self.note(f"batches {start}-{start + r.skipped - 1}{when} are no longer buffered by the publisher (its "
                      f"replay buffer starts later): blocks they stored that are still cached are missing from "
                      f"this view")

    def _emit(self, marker: StreamMarker) -> None:
        """Keep a marker for a capture and hand it to ``on_raw`` (e.g. ``watch --record``'s writer)."""
        with self._lock:
            self._keep(marker)
        if self._on_raw is not None:
            self._on_raw(marker)

    def _joined(self, seq: int, count: int, text: str) -> None:
        """The watch joined at ``seq`` with ``count`` batches before it that it will not have: said, counted in
        ``before_watch``, kept as a marker for a capture, and kept by the mirror as its join note."""
        marker = StreamMarker(self.rank, "join", seq, time.time(), text=text, count=count, starts_at=True)
        with self._lock:
            self.before_watch += count
            self.mirror.starts_at = seq
            self.mirror.join_note = text
            self._keep(marker)
        self.note(text)
        if self._on_raw is not None:
            self._on_raw(marker)

    def note(self, text: str) -> None:
        with self._lock:
            self.mirror.note(text)
            self._log_notes()

    def _log(self, kind: str, item) -> None:
        """Under the lock: append to ``log`` (after any mirror notes not yet copied there)."""
        if kind != "note":
            self._log_notes()
        self.log.append((kind, item))
        self.num_logged += 1

    def _log_notes(self) -> None:
        new = self.mirror.num_notes - self._notes_logged
        if self.mirror.num_notes < self._notes_logged:  # a fresh mirror
            new = self.mirror.num_notes
        for n in (self.mirror.notes[-new:] if new > 0 else []):
            self._log("note", n)
        self._notes_logged = self.mirror.num_notes

    def log_since(self, n: int) -> tuple[list[tuple[str, object]], int]:
        """The log entries after the first ``n`` ever logged (those the deque still holds), and the new total."""
        with self._lock:
            fresh = min(self.num_logged - n, len(self.log))
            return (list(self.log)[-fresh:] if fresh > 0 else []), self.num_logged

    def _replay(self, start: int, until: int | None) -> _ReplayResult:
        """Ask the replay socket for batches from ``start`` (up to ``until - 1``, or all it has when None)
        and apply them in order.

        A ROUTER drops messages for a client whose queue is full (ZMQ's send high-water mark: vLLM's replay
        socket keeps the default 1,000), so a long answer can arrive with holes; measured on vLLM 0.32
        joining a server with 3,000-10,000 buffered batches: jumps such as 1999 -> 2170 right after each
        1,000 messages. A hole ends this round and the next asks again from the first missing batch; only
        batches the publisher no longer buffers (the first one it sends is past the one asked for) are
        given up, counted in ``skipped``."""
        r = _ReplayResult()
        if self.replay_endpoint is None:
            return r
        expected = start
        for _ in range(MAX_REPLAY_ROUNDS):
            outcome, expected = self._replay_round(expected, until, r)
            if outcome != "hole":
                break
        return r

    def _replay_round(self, expected: int, until: int | None, r: _ReplayResult) -> tuple[str, int]:
        # A DEALER, not the REQ of vLLM's example subscriber: the ROUTER answers one request with many
        # messages, and a REQ socket delivers only the first reply to each request (the rest are dropped).
        # The DEALER adds the empty delimiter frame a REQ would, so the ROUTER sees the same request.
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.setsockopt(zmq.RCVHWM, 0)  # never drop on our side
        req.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)  # an oversized answer ends the round unread
        before = self.received
        first = True
        try:
            req.connect(self.replay_endpoint)
            req.send_multipart((b"", expected.to_bytes(8, "big")))
            while req.poll(self._replay_timeout_ms):
                frames = req.recv_multipart()[1:]  # drop the delimiter
                r.answered = True
                if len(frames) == 3 and frames[1] == END_SEQ:
                    return "done", expected
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._receive(frames, replayed=True)  # counted as malformed
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq < expected:
                    continue
                if seq > expected:
                    if not first:
                        return "hole", expected  # dropped on the way: ask again from the first missing one
                    r.skipped += seq - expected  # the publisher's buffer starts after what was asked for
                first = False
                self._receive(frames, replayed=True)
                expected = seq + 1
                if until is not None and seq >= until - 1:
                    return "done", expected  # the rest arrives live
        except zmq.ZMQError as exc:
            self._error(f"replay from {self.replay_endpoint} failed: {exc}")
        finally:
            req.close(linger=0)
            r.applied += self.received - before
        return "done", expected

    def _malformed(self, text: str, seq: int | None = None, refused: bool = False) -> None:
        self._skipped("malformed", text, seq, refused)

    def _skipped(self, counter: str, text: str, seq: int | None = None, refused: bool = False) -> None:
        """Count a skipped message in ``counter`` (malformed | duplicates | jumps), say it in the log and keep a
        marker for a capture (a replay counts it the same way)."""
        marker = StreamMarker(self.rank, _MARKER_KIND[counter], seq, time.time(), text=f"skipped {text}",
                              refused=refused)
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
            if refused:
                self.mirror.refused_pending += 1
            self._keep(marker)
        self._error(f"skipped {text}")
        if self._on_raw is not None:
            self._on_raw(marker)

    def _error(self, text: str) -> None:
        with self._lock:
            self.errors.append(text)
            self._log("error", text)

    def _close(self) -> None:
        try:
            self._sub.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sub.close(linger=0)


_MARKER_KIND = {"malformed": "malformed", "duplicates": "duplicate", "jumps": "jump"}


def _size(item: RawBatch | StreamMarker) -> int:
    """An item's share of the capture's byte budget."""
    return len(item.payload) if isinstance(item, RawBatch) else _MARKER_BYTES + len(item.text)
