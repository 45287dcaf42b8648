"""Captures of KV event streams: save the raw batches a server sent, replay them later without it.

Format: JSON lines (one object per line, UTF-8), so a capture can be read with any tool and diffed:

    {"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 1, "created": ISO 8601,
     "source": free text (what was recorded), "endpoints": [endpoint per rank], "model": str | null,
     "block_size": int | null, "num_gpu_blocks": int | null (the server's pool, vLLM's count incl. its
     null block, when known), "notes": [str]}
    {"kind": "batch", "rank": int, "seq": int, "t": float, "ts": float, "replayed": bool, "payload": base64,
     "restart": true}
    {"kind": "metrics", "rank": int, "t": float, "values": {name: number}, "server": str}  (optional, /metrics
     scrapes; ``server`` names whose, absent in captures of one server)
    {"kind": "marker", "rank": int, "t": float, "what": "malformed" | "duplicate" | "jump" | "join" | "gap" |
     "lost", "seq": int | null, "count": int, "text": str, "refused": true, "starts_at": true,
     "recovered": int}   (optional)

A ``marker`` line is something the watch counted that left no batch to keep (``kv_subscriber.StreamMarker``):
a malformed message (``seq`` null when no number could be read; ``refused``: ZMQ refused it unread, so the
first batch missing after it is taken for it), a duplicate or out-of-order batch, an impossible sequence jump,
the join point of a late watch (``count`` batches published before it; ``starts_at``: the view starts at
``seq``), a gap (``count`` batches from ``seq`` missed live, ``recovered`` of them replayed: a gap the replay
socket filled leaves no hole in the capture, yet the watch counted it) or batches lost on a reconnect. A
header with ``"markers": true`` (the watch and the Server page write it) says gaps are in marker lines: a
replay counts those and infers none from holes in the sequence numbers; captures without it (older ones,
``peer/record_capture.py``) are read as before, a hole being a gap. So a replay reports the same malformed,
duplicate, jump, gap, lost and before-the-watch counts as the watch; a reader keeps each marker with the batch
line after it (``CaptureBatch.markers``, or ``Capture.trailing`` after the last batch).

``payload`` is the msgpack payload exactly as received (``kv_events.decode_batch`` reads it), so a capture
keeps whatever the server sent, including fields the lab does not read; ``t`` is seconds since the first
line of the capture was recorded (the receiver's clock); ``ts`` is the batch's own timestamp (the
publisher's clock, seconds since the epoch, the payload's ``ts`` copied out). Both are kept: ``t`` says when
the lab saw a batch, ``ts`` when the server made it, and they differ most for a late join, whose replayed
batches all arrive at once (179 batches within 0.1 s of ``t``). ``replay_gap`` paces a replay by ``ts``.
``restart`` (present only when true) marks the first batch of a restarted publisher, which a watcher knew
from the connection (a replay could not tell it from a gap when the new sequence numbers run past the old).

Sequence numbers are 0 to 2**64 - 1 (8 bytes on the wire) and ranks 0 to ``MAX_RANK``; ``read_capture``
refuses others naming the line and the value.

Version 1 throughout: ``ts``, ``restart`` and marker lines were added later as optional fields (older readers ignore
fields they do not know; captures written before them read as before, the replay taking ``ts`` from the
payload), so captures written before and after read both ways.

Servers: a batch's ``rank`` is its stream's index over the whole watch (``servers.py``); the header's
``servers`` says which streams are whose (a server's data-parallel ranks, in order), and each server's own
pool size. A capture without ``servers`` (older ones, ``peer/record_capture.py``) is one server whose ranks
are the streams.

``read_capture`` validates every line and raises ``ValueError`` naming the line number and the field;
``replay_states`` rebuilds the cache after each batch for the Server page's step / back / scrub.
"""

from __future__ import annotations

import base64
import json
import math
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .cache_mirror import PrefixCacheMirror
from ..kv_events import MAX_TS, MalformedBatch, decode_batch, ts_problem

FORMAT = "paged-attention-lab.kv-capture"
VERSION = 1
MAX_CAPTURE_BYTES = 256 * 2**20  # read_capture refuses bigger files before reading them
MAX_SEQ = 2**64 - 1  # a sequence number is 8 bytes big-endian on the wire
MAX_RANK = 4095      # data-parallel ranks (vLLM numbers them from 0; no deployment comes near 4,096)
MARKER_KINDS = ("malformed", "duplicate", "jump", "join", "gap", "lost")


@dataclass
class CaptureBatch:
    rank: int
    seq: int
    t: float
    payload: bytes
    replayed: bool = False
    ts: float | None = None      # the publisher's timestamp (None: not written, read it from the payload)
    restart: bool = False
    line: int | None = None      # the line of the file it was read from, for error messages
    markers: list[dict] = field(default_factory=list)  # marker lines just before this batch (applied first)


@dataclass
class Capture:
    header: dict
    batches: list[CaptureBatch] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    trailing: list[dict] = field(default_factory=list)  # marker lines after the last batch

    @property
    def ranks(self) -> list[int]:
        return sorted({b.rank for b in self.batches} | {m["rank"] for b in self.batches for m in b.markers}
                      | {m["rank"] for m in self.trailing})


def new_header(source: str, endpoints: list[str], model: str | None = None, block_size: int | None = None,
               num_gpu_blocks: int | None = None, notes: list[str] | None = None) -> dict:
    return {"kind": "header", "format": FORMAT, "version": VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "source": source,
            "endpoints": list(endpoints), "model": model, "block_size": block_size,
            "num_gpu_blocks": num_gpu_blocks, "notes": list(notes or [])}


def batch_line(rank: int, seq: int, t: float, payload: bytes, replayed: bool = False, ts: float | None = None,
               restart: bool = False) -> str:
    """One batch as a capture line (no newline)."""
    obj = {"kind": "batch", "rank": rank, "seq": seq, "t": round(t, 6)}
    if ts is not None:
        obj["ts"] = ts
    obj.update(replayed=replayed, payload=base64.b64encode(payload).decode())
    if restart:
        obj["restart"] = True
    return json.dumps(obj)


def marker_line(m: dict) -> str:
    """One marker (a dict of the marker line's fields) as a capture line (no newline)."""
    obj = {"kind": "marker", "rank": m["rank"], "t": round(m.get("t", 0.0), 6), "what": m["what"],
           "seq": m.get("seq"), "count": m.get("count", 1), "text": m.get("text", "")}
    obj.update({k: True for k in ("refused", "starts_at") if m.get(k)})
    if m.get("recovered"):
        obj["recovered"] = m["recovered"]
    return json.dumps(obj)


def marker_dict(marker, t: float) -> dict:
    """A ``kv_subscriber.StreamMarker`` as a marker line's fields, ``t`` seconds into the capture."""
    return {"rank": marker.rank, "t": t, "what": marker.what, "seq": marker.seq, "count": marker.count,
            "text": marker.text, "refused": marker.refused, "starts_at": marker.starts_at,
            "recovered": getattr(marker, "recovered", 0)}


def dumps_capture(capture: Capture) -> str:
    """The whole capture as JSON lines text (what the Server page offers for download)."""
    lines = [json.dumps(capture.header)]
    for b in capture.batches:
        lines += [marker_line(m) for m in b.markers]
        lines.append(batch_line(b.rank, b.seq, b.t, b.payload, b.replayed, b.ts, b.restart))
    lines += [marker_line(m) for m in capture.trailing]
    lines += [json.dumps({"kind": "metrics", **m}) for m in capture.metrics]
    return "\n".join(lines) + "\n"


def write_capture(path: str | Path, capture: Capture) -> None:
    Path(path).write_text(dumps_capture(capture), encoding="utf-8")


class CaptureWriter:
    """Append batches to a capture file as they arrive (the CLI's ``watch --record``): the header first,
    one line per batch, flushed, so an interrupted recording is still a valid capture."""

    def __init__(self, path: str | Path, header: dict) -> None:
        self.path, self.header = Path(path), header
        self._lock = threading.Lock()  # subscriber threads (one per stream) and /metrics pollers all write
        self._f = open(path, "w", encoding="utf-8")
        self._t0: float | None = None
        self._f.write(json.dumps(header) + "\n")
        self._f.flush()

    def write(self, rank: int, seq: int, recv_ts: float, payload: bytes, replayed: bool = False,
              ts: float | None = None, restart: bool = False) -> None:
        with self._lock:
            self._write(rank, seq, recv_ts, payload, replayed, ts, restart)

    def _write(self, rank, seq, recv_ts, payload, replayed, ts, restart) -> None:
        if self._t0 is None:
            self._t0 = recv_ts
        self._f.write(batch_line(rank, seq, recv_ts - self._t0, payload, replayed, ts, restart) + "\n")
        self._f.flush()

    def add(self, item) -> None:
        """Write a subscriber's ``RawBatch`` or ``StreamMarker`` (its ``on_raw`` callback)."""
        if hasattr(item, "payload"):
            self.write(item.rank, item.seq, item.recv_ts, item.payload, item.replayed, item.ts, item.restart)
            return
        with self._lock:
            if self._t0 is None:
                self._t0 = item.recv_ts
            self._f.write(marker_line(marker_dict(item, item.recv_ts - self._t0)) + "\n")
            self._f.flush()

    def add_metrics(self, server: str | None, at: float, values: dict) -> None:
        """Write one /metrics scrape (``server``: whose; None for a capture of one server) read at ``at``
        (seconds since the epoch, this machine's clock)."""
        with self._lock:
            if self._f.closed:
                return
            if self._t0 is None:
                self._t0 = at
            obj = {"kind": "metrics", "rank": 0, "t": round(at - self._t0, 6), "at": at, "values": values}
            if server is not None:
                obj["server"] = server
            self._f.write(json.dumps(obj) + "\n")
            self._f.flush()

    def close(self, replace: dict | None = None, **header_updates) -> None:
        """Close; ``header_updates`` (e.g. ``block_size`` learned from the events) are written into the
        header line, where a value is still missing; ``replace``'s values are written whatever was there (e.g.
        the servers' entries with the pool sizes their /metrics gave)."""
        fill = {k: v for k, v in header_updates.items() if v is not None and self.header.get(k) is None}
        fill.update(replace or {})
        with self._lock:
            self._f.close()
        if fill:
            lines = self.path.read_text(encoding="utf-8").split("\n", 1)
            self.header.update(fill)
            self.path.write_text(json.dumps(self.header) + "\n" + (lines[1] if len(lines) > 1 else ""),
                                 encoding="utf-8")


def read_capture(source: str | Path | bytes) -> Capture:
    """Read a capture from a path or from its bytes (an upload). Raises ValueError naming the bad line."""
    if isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise ValueError(f"capture {str(source)!r}: no such file")
        size = Path(source).stat().st_size
        if size > MAX_CAPTURE_BYTES:
            raise ValueError(f"capture {source} is {size / 2**20:.0f} MiB, more than the "
                             f"{MAX_CAPTURE_BYTES // 2**20} MiB this reader takes")
        data = Path(source).read_bytes()
    else:
        data = source
        if len(data) > MAX_CAPTURE_BYTES:
            raise ValueError(f"the capture is {len(data) / 2**20:.0f} MiB, more than the "
                             f"{MAX_CAPTURE_BYTES // 2**20} MiB this reader takes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"a capture is UTF-8 JSON lines; byte {exc.start} is not UTF-8") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError("the capture is empty: expected a header line first")
    header = _json(lines[0])
    if header.get("kind") != "header" or header.get("format") != FORMAT:
        raise ValueError(f"line 1: not a capture header (expected kind 'header' and format {FORMAT!r})")
    if header.get("version") != VERSION:
        raise ValueError(f"line 1: capture version {header.get('version')!r}, this reader takes {VERSION}")
    _check_servers(header.get("servers"))
    capture = Capture(header=header)
    pending: list[dict] = []
    for n, line in lines[1:]:
        obj = _json((n, line))
        kind = obj.get("kind")
        if kind == "batch":
            capture.batches.append(_batch(n, obj))
            capture.batches[-1].markers, pending = pending, []
        elif kind == "marker":
            pending.append(_marker(n, obj))
        elif kind == "metrics":
            capture.metrics.append({k: v for k, v in obj.items() if k != "kind"})
        else:
            raise ValueError(f"line {n}: kind {kind!r} is not one of 'batch', 'marker', 'metrics'")
    capture.trailing = pending
    return capture


def _check_servers(servers) -> None:
    """The header's optional ``servers`` list, or ValueError naming the bad entry (line 1)."""
    if servers is None:
        return
    from .servers import NAME_RE

    if not isinstance(servers, list):
        raise ValueError(f"line 1: header field 'servers' is {servers!r:.60}, expected a list")
    names, streams = set(), set()
    for e in servers:
        name = e.get("name") if isinstance(e, dict) else None
        if not isinstance(name, str) or not NAME_RE.match(name) or name in names:
            raise ValueError(f"line 1: header 'servers' entry {e!r:.80}: 'name' must be a distinct server name")
        names.add(name)
        ss = e.get("streams")
        if (not isinstance(ss, list) or not ss or any(not isinstance(x, int) or isinstance(x, bool) or
                                                       not 0 <= x <= MAX_RANK or x in streams for x in ss)):
            raise ValueError(f"line 1: header 'servers' entry {name!r}: 'streams' is {ss!r:.60}, expected distinct "
                             f"stream numbers from 0 to {MAX_RANK:,}")
        streams.update(ss)
        pool = e.get("num_gpu_blocks")
        if pool is not None and (not isinstance(pool, int) or isinstance(pool, bool) or pool < 0):
            raise ValueError(f"line 1: header 'servers' entry {name!r}: 'num_gpu_blocks' is {pool!r}")


def _json(numbered: tuple[int, str]) -> dict:
    n, line = numbered
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {n}: not JSON ({exc.msg})") from None
    except RecursionError:  # e.g. 200,000 "[": json recurses per level
        raise ValueError(f"line {n}: JSON nested too deep ({len(line):,} characters; a capture line nests 1 "
                         f"level)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {n}: expected a JSON object")
    return obj


def _batch(n: int, obj: dict) -> CaptureBatch:
    for name, kind in (("rank", int), ("seq", int), ("t", (int, float)), ("payload", str)):
        if not isinstance(obj.get(name), kind) or isinstance(obj.get(name), bool):
            raise ValueError(f"line {n}: batch field {name!r} is {obj.get(name)!r}")
    _check_numbers(n, "batch", obj["rank"], obj["seq"])
    try:
        payload = base64.b64decode(obj["payload"], validate=True)
    except ValueError:
        raise ValueError(f"line {n}: batch payload is not base64") from None
    ts = obj.get("ts")
    if ts is not None and ts_problem(ts):
        raise ValueError(f"line {n}: batch field 'ts' is {ts!r}, expected the publisher's time in seconds (0 to "
                         f"{MAX_TS:,.0f})")
    return CaptureBatch(rank=obj["rank"], seq=obj["seq"], t=float(obj["t"]), payload=payload,
                        replayed=bool(obj.get("replayed", False)), ts=None if ts is None else float(ts),
                        restart=obj.get("restart") is True, line=n)


def _check_numbers(n: int, kind: str, rank: int, seq: int | None) -> None:
    """Refuse a rank or sequence number no publisher can send, naming the line and the value."""
    if not 0 <= rank <= MAX_RANK:
        raise ValueError(f"line {n}: {kind} field 'rank' is {rank!r}, expected a data-parallel rank from 0 to "
                         f"{MAX_RANK:,}")
    if seq is not None and not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"line {n}: {kind} field 'seq' is {seq!r}, expected a sequence number from 0 to 2**64 - 1 "
                         f"(8 bytes on the wire)")


def _marker(n: int, obj: dict) -> dict:
    seq, count = obj.get("seq"), obj.get("count", 1)
    if not isinstance(obj.get("rank"), int) or isinstance(obj.get("rank"), bool):
        raise ValueError(f"line {n}: marker field 'rank' is {obj.get('rank')!r}")
    if obj.get("what") not in MARKER_KINDS:
        raise ValueError(f"line {n}: marker field 'what' is {obj.get('what')!r}, not one of "
                         f"{', '.join(MARKER_KINDS)}")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool)):
        raise ValueError(f"line {n}: marker field 'seq' is {seq!r}")
    recovered = obj.get("recovered", 0)
    for name, value in (("count", count), ("recovered", recovered)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEQ + 1:
            raise ValueError(f"line {n}: marker field {name!r} is {value!r}, expected a number of batches")
    if recovered > count:
        raise ValueError(f"line {n}: marker field 'recovered' is {recovered}, more than its count {count}")
    if obj["what"] in ("gap", "lost") and seq is None:
        raise ValueError(f"line {n}: a {obj['what']} marker without 'seq'")
    if not isinstance(obj.get("t", 0.0), (int, float)) or not isinstance(obj.get("text", ""), str):
        raise ValueError(f"line {n}: marker field 't' or 'text' is not a number / a string")
    _check_numbers(n, "marker", obj["rank"], seq)
    return {"rank": obj["rank"], "t": float(obj.get("t", 0.0)), "what": obj["what"], "seq": seq, "count": count,
            "text": obj.get("text", ""), "refused": obj.get("refused") is True,
            "starts_at": obj.get("starts_at") is True and seq is not None, "recovered": recovered}


# --- replay ---------------------------------------------------------------------------------------------


@dataclass
class ReplayState:
    """The caches of every rank after the first ``position`` batches of a capture."""
    position: int
    mirrors: dict[int, PrefixCacheMirror]
    errors: list[str]


class CaptureReplay:
    """Step through a capture as the Server page's Step / Back / scrub do: ``state(k)`` is every rank's
    cache after the first k batches (0 <= k <= len). Checkpoints every ``every`` batches keep Back and a
    scrub cheap (apply at most ``every - 1`` batches from the nearest one). At most ``max_checkpoints``
    are kept: past that, ``every`` doubles and the checkpoints off the new grid are dropped, so memory
    stays bounded (about ``max_checkpoints`` copies of the cache) on captures of any length."""

    def __init__(self, capture: Capture, every: int = 64, max_checkpoints: int = 128) -> None:
        self.capture = capture
        self.infer_gaps = not capture.header.get("markers")  # see the module docstring
        self.every = every
        self.max_checkpoints = max_checkpoints
        self._checkpoints: dict[int, tuple[dict[int, PrefixCacheMirror], list[str]]] = {
            0: ({r: PrefixCacheMirror(rank=r) for r in capture.ranks}, [])}

    def __len__(self) -> int:
        return len(self.capture.batches)

    def state(self, position: int) -> ReplayState:
        """Every rank's cache after the first ``position`` batches (and, at the end, the markers after the
        last batch)."""
        state = self._state(position)
        if position == len(self) and self.capture.trailing:
            for m in self.capture.trailing:
                self.apply_marker(state.mirrors, state.errors, m, self.infer_gaps)
        return state

    def _state(self, position: int) -> ReplayState:
        if not 0 <= position <= len(self):
            raise ValueError(f"position {position} is outside the capture's 0..{len(self)} batches")
        base = max(k for k in self._checkpoints if k <= position)
        mirrors0, errors0 = self._checkpoints[base]
        mirrors = {r: m.copy() for r, m in mirrors0.items()}
        errors = list(errors0)
        for k in range(base, position):
            self.apply_batch(mirrors, errors, self.capture.batches[k], self.infer_gaps)
            if (k + 1) % self.every == 0 and k + 1 not in self._checkpoints:
                self._checkpoints[k + 1] = ({r: m.copy() for r, m in mirrors.items()}, list(errors))
                self._thin()
        return ReplayState(position=position, mirrors=mirrors, errors=errors)

    def _thin(self) -> None:
        while len(self._checkpoints) > self.max_checkpoints:
            self.every *= 2
            self._checkpoints = {k: v for k, v in self._checkpoints.items() if k % self.every == 0}

    @staticmethod
    def apply_marker(mirrors: dict[int, PrefixCacheMirror], errors: list[str], m: dict,
                     infer_gaps: bool = True) -> None:
        """Count one marker line as the watch that wrote it did (``kv_subscriber.StreamMarker``): a join sets
        ``before_watch`` (and where the view starts); a skipped message goes to ``errors`` and its count; a
        malformed batch whose number was read arrived (a gap before it is a gap, it is not one)."""
        rank, seq = m["rank"], m.get("seq")
        mirror = mirrors.setdefault(rank, PrefixCacheMirror(rank=rank))
        text = m.get("text") or f"skipped a {m['what']} message" + (f" (batch {seq})" if seq is not None else "")
        if m["what"] == "gap":  # the watch's own count, replayed batches included (see the module docstring)
            mirror.note_gap(seq, seq + m.get("count", 0), m.get("recovered", 0))
            mirror.last_seq = seq + m.get("count", 0) - 1
            return
        if m["what"] == "lost":
            mirror.lost_batches += m.get("count", 0)
            mirror.note(f"batches {seq}-{seq + m.get('count', 0) - 1} are no longer buffered by the publisher "
                        f"(lost on a reconnect)")
            return
        if m["what"] == "join":
            mirror.before_watch += m.get("count", 0)
            if m.get("starts_at"):
                mirror.starts_at, mirror.join_note = seq, text
                mirror.note(text)
            return
        errors.append(f"rank {rank}  {text}")
        if m["what"] == "duplicate":
            mirror.duplicates += 1
        elif m["what"] == "jump":
            mirror.jumps += 1
        else:
            mirror.malformed += 1
            if m.get("refused"):
                mirror.refused_pending += 1
            elif seq is not None:
                if infer_gaps:
                    _gap_before(mirror, seq)
                mirror.last_seq = seq  # it arrived (unreadable): not a gap in the sequence

    @staticmethod
    def apply_batch(mirrors: dict[int, PrefixCacheMirror], errors: list[str], b: CaptureBatch,
                    infer_gaps: bool = True) -> bool:
        """Apply one capture batch to its rank's mirror, after the markers just before it: an unreadable one
        goes to ``errors`` (a jump before it is still a gap), a sequence number not above the last is a
        publisher restart, a jump is a gap (nothing can be replayed) unless ``infer_gaps`` is False (a capture
        whose gaps are in marker lines). True if it was applied."""
        for m in b.markers:
            CaptureReplay.apply_marker(mirrors, errors, m, infer_gaps)
        mirror = mirrors.setdefault(b.rank, PrefixCacheMirror(rank=b.rank))
        try:
            batch = decode_batch(b.payload)
        except MalformedBatch as exc:
            where = f" (line {b.line} of the capture)" if b.line is not None else ""
            errors.append(f"rank {b.rank} batch {b.seq}: skipped, {exc}{where}")
            mirror.malformed += 1
            if not b.restart and infer_gaps:
                _gap_before(mirror, b.seq)
            mirror.last_seq = b.seq  # it arrived (unreadable): not a gap in the sequence
            return False
        if b.restart:
            mirror.restart(b.seq)  # the watcher saw the publisher go and come back
        elif mirror.last_seq is not None and b.seq <= mirror.last_seq:
            mirror.restart(b.seq)  # a capture holds each batch once, in the order applied: a restart
        elif infer_gaps:
            _gap_before(mirror, b.seq)
        mirror.apply(b.seq, batch.ts, batch.events, replayed=b.replayed)
        return True


def _gap_before(mirror: PrefixCacheMirror, seq: int) -> None:
    """Batch ``seq`` arrived: note the gap before it, if any (its first batch taken for a message ZMQ refused
    unread, when one is pending, as the watch did: ``kv_subscriber``)."""
    if mirror.last_seq is not None and seq > mirror.last_seq + 1:
        mirror.take_refused(mirror.last_seq + 1)
    if mirror.last_seq is not None and seq > mirror.last_seq + 1:
        mirror.note_gap(mirror.last_seq + 1, seq, 0)


def capture_from_raw(raw_batches, header: dict) -> Capture:
    """A Capture from a subscriber's ``RawBatch`` and ``StreamMarker`` list (``kv_subscriber``:
    ``capture_items``), times relative to the first; each marker kept with the batch after it."""
    raw = sorted(raw_batches, key=lambda r: r.recv_ts)  # stable: one subscriber's items keep their order
    t0 = raw[0].recv_ts if raw else 0.0
    capture, pending = Capture(header=header), []
    for r in raw:
        if not hasattr(r, "payload"):
            pending.append(marker_dict(r, r.recv_ts - t0))
            continue
        capture.batches.append(CaptureBatch(rank=r.rank, seq=r.seq, t=r.recv_ts - t0, payload=r.payload,
                                            replayed=r.replayed, ts=getattr(r, "ts", None),
                                            restart=getattr(r, "restart", False), markers=pending))
        pending = []
    capture.trailing = pending
    return capture


def server_time(b: CaptureBatch) -> float | None:
    """The publisher's timestamp of a batch: the ``ts`` field, or from the payload for captures written
    before it existed; None when neither can be read."""
    if b.ts is not None:
        return b.ts
    try:
        return decode_batch(b.payload).ts
    except MalformedBatch:
        return None


def replay_gap(previous: CaptureBatch, b: CaptureBatch) -> float:
    """Seconds between two batches as the server made them (``ts``), for a replay at the recorded pace;
    the receive times ``t`` where either ``ts`` is unreadable. Never negative (a restarted server's clock,
    or another rank's, can be behind)."""
    a, z = server_time(previous), server_time(b)
    gap = z - a if a is not None and z is not None and math.isfinite(z - a) else b.t - previous.t
    return max(0.0, gap)


def server_scrapes(capture: Capture, name: str | None) -> list[dict]:
    """The capture's /metrics lines of server ``name`` (lines without ``server`` belong to a capture of one
    server: they are its, whatever its name)."""
    named = any("server" in m for m in capture.metrics)
    return [m for m in capture.metrics if isinstance(m.get("values"), dict)
            and (not named or m.get("server") == name)]


def server_pool(capture: Capture, name: str | None) -> int | None:
    """Server ``name``'s pool size (vLLM's ``num_gpu_blocks``): its header entry, else the header's (a capture
    of one server), else its last /metrics line that has it; None when the capture does not say."""
    for e in capture.header.get("servers") or []:
        if e.get("name") == name and e.get("num_gpu_blocks"):
            return e["num_gpu_blocks"]
    if not capture.header.get("servers") and capture.header.get("num_gpu_blocks"):
        return capture.header["num_gpu_blocks"]
    pools = [m["values"]["num_gpu_blocks"] for m in server_scrapes(capture, name) if m["values"].get("num_gpu_blocks")]
    return int(pools[-1]) if pools else None
