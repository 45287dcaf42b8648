"""Captures of KV event streams: save the raw batches a server sent, replay them later without it.

Format: JSON lines (one object per line, UTF-8), so a capture can be read with any tool and diffed:

    {"kind": "header", "format": "paged-attention-lab.kv-capture", "version": 1, "created": ISO 8601,
     "source": free text (what was recorded), "endpoints": [endpoint per rank], "model": str | null,
     "block_size": int | null, "num_gpu_blocks": int | null (the server's pool, vLLM's count incl. its
     null block, when known), "notes": [str]}
    {"kind": "batch", "rank": int, "seq": int, "t": float, "ts": float, "replayed": bool, "payload": base64,
     "restart": true}
    {"kind": "metrics", "rank": int, "t": float, "values": {name: number}}     (optional, /metrics scrapes)

``payload`` is the msgpack payload exactly as received (``kv_events.decode_batch`` reads it), so a capture
keeps whatever the server sent, including fields the lab does not read; ``t`` is seconds since the first
line of the capture was recorded (the receiver's clock); ``ts`` is the batch's own timestamp (the
publisher's clock, seconds since the epoch, the payload's ``ts`` copied out). Both are kept: ``t`` says when
the lab saw a batch, ``ts`` when the server made it, and they differ most for a late join, whose replayed
batches all arrive at once (179 batches within 0.1 s of ``t``). ``replay_gap`` paces a replay by ``ts``.
``restart`` (present only when true) marks the first batch of a restarted publisher, which a watcher knew
from the connection (a replay could not tell it from a gap when the new sequence numbers run past the old).

Version 1 throughout: ``ts`` and ``restart`` were added later as optional fields (older readers ignore
fields they do not know; captures written before them read as before, the replay taking ``ts`` from the
payload), so captures written before and after read both ways.

``read_capture`` validates every line and raises ``ValueError`` naming the line number and the field;
``replay_states`` rebuilds the cache after each batch for the Server page's step / back / scrub.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .cache_mirror import PrefixCacheMirror
from .kv_events import MAX_TS, MalformedBatch, decode_batch, ts_problem

FORMAT = "paged-attention-lab.kv-capture"
VERSION = 1
MAX_CAPTURE_BYTES = 256 * 2**20  # read_capture refuses bigger files before reading them


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


@dataclass
class Capture:
    header: dict
    batches: list[CaptureBatch] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted({b.rank for b in self.batches})


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


def dumps_capture(capture: Capture) -> str:
    """The whole capture as JSON lines text (what the Server page offers for download)."""
    lines = [json.dumps(capture.header)]
    lines += [batch_line(b.rank, b.seq, b.t, b.payload, b.replayed, b.ts, b.restart) for b in capture.batches]
    lines += [json.dumps({"kind": "metrics", **m}) for m in capture.metrics]
    return "\n".join(lines) + "\n"


def write_capture(path: str | Path, capture: Capture) -> None:
    Path(path).write_text(dumps_capture(capture), encoding="utf-8")


class CaptureWriter:
    """Append batches to a capture file as they arrive (the CLI's ``watch --record``): the header first,
    one line per batch, flushed, so an interrupted recording is still a valid capture."""

    def __init__(self, path: str | Path, header: dict) -> None:
        self.path, self.header = Path(path), header
        self._f = open(path, "w", encoding="utf-8")
        self._t0: float | None = None
        self._f.write(json.dumps(header) + "\n")
        self._f.flush()

    def write(self, rank: int, seq: int, recv_ts: float, payload: bytes, replayed: bool = False,
              ts: float | None = None, restart: bool = False) -> None:
        if self._t0 is None:
            self._t0 = recv_ts
        self._f.write(batch_line(rank, seq, recv_ts - self._t0, payload, replayed, ts, restart) + "\n")
        self._f.flush()

    def close(self, **header_updates) -> None:
        """Close; ``header_updates`` (e.g. ``block_size`` learned from the events) are written into the
        header line, where a value is still missing."""
        self._f.close()
        fill = {k: v for k, v in header_updates.items() if v is not None and self.header.get(k) is None}
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
    capture = Capture(header=header)
    for n, line in lines[1:]:
        obj = _json((n, line))
        kind = obj.get("kind")
        if kind == "batch":
            capture.batches.append(_batch(n, obj))
        elif kind == "metrics":
            capture.metrics.append({k: v for k, v in obj.items() if k != "kind"})
        else:
            raise ValueError(f"line {n}: kind {kind!r} is not one of 'batch', 'metrics'")
    return capture


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
        self.every = every
        self.max_checkpoints = max_checkpoints
        self._checkpoints: dict[int, tuple[dict[int, PrefixCacheMirror], list[str]]] = {
            0: ({r: PrefixCacheMirror(rank=r) for r in capture.ranks}, [])}

    def __len__(self) -> int:
        return len(self.capture.batches)

    def state(self, position: int) -> ReplayState:
        if not 0 <= position <= len(self):
            raise ValueError(f"position {position} is outside the capture's 0..{len(self)} batches")
        base = max(k for k in self._checkpoints if k <= position)
        mirrors0, errors0 = self._checkpoints[base]
        mirrors = {r: m.copy() for r, m in mirrors0.items()}
        errors = list(errors0)
        for k in range(base, position):
            self.apply_batch(mirrors, errors, self.capture.batches[k])
            if (k + 1) % self.every == 0 and k + 1 not in self._checkpoints:
                self._checkpoints[k + 1] = ({r: m.copy() for r, m in mirrors.items()}, list(errors))
                self._thin()
        return ReplayState(position=position, mirrors=mirrors, errors=errors)

    def _thin(self) -> None:
        while len(self._checkpoints) > self.max_checkpoints:
            self.every *= 2
            self._checkpoints = {k: v for k, v in self._checkpoints.items() if k % self.every == 0}

    @staticmethod
    def apply_batch(mirrors: dict[int, PrefixCacheMirror], errors: list[str], b: CaptureBatch) -> None:
        """Apply one capture batch to its rank's mirror: an unreadable one goes to ``errors``, a sequence
        number not above the last is a publisher restart, a jump is a gap (nothing can be replayed)."""
        mirror = mirrors[b.rank]
        try:
            batch = decode_batch(b.payload)
        except MalformedBatch as exc:
            where = f" (line {b.line} of the capture)" if b.line is not None else ""
            errors.append(f"rank {b.rank} batch {b.seq}: skipped, {exc}{where}")
            mirror.last_seq = b.seq  # it arrived (unreadable): not a gap in the sequence
            return
        if b.restart:
            mirror.restart(b.seq)  # the watcher saw the publisher go and come back
        elif mirror.last_seq is not None and b.seq <= mirror.last_seq:
            mirror.restart(b.seq)  # a capture holds each batch once, in the order applied: a restart
        elif mirror.last_seq is not None and b.seq > mirror.last_seq + 1:
            mirror.note_gap(mirror.last_seq + 1, b.seq, 0)
        mirror.apply(b.seq, batch.ts, batch.events, replayed=b.replayed)


def capture_from_raw(raw_batches, header: dict) -> Capture:
    """A Capture from a subscriber's ``RawBatch`` list (``kv_subscriber``), times relative to the first."""
    raw = sorted(raw_batches, key=lambda r: r.recv_ts)
    t0 = raw[0].recv_ts if raw else 0.0
    return Capture(header=header, batches=[CaptureBatch(rank=r.rank, seq=r.seq, t=r.recv_ts - t0, payload=r.payload,
                                                        replayed=r.replayed, ts=getattr(r, "ts", None),
                                                        restart=getattr(r, "restart", False)) for r in raw])


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
