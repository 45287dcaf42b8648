"""Step records: plain, JSON-serialisable data describing what one engine step did.

The engine produces one ``StepRecord`` per ``LLMEngine.step()``; the app, the lessons, the CLI and traces
only ever read these records (time travel in the app re-reads old records, it never re-runs the model).
A run can be written as a JSON-lines trace (one record per line) and read back with ``read_trace``.

Units: token counts are tokens, block ids index the physical pool, slots are ``block_id * block_size +
offset``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

# Kinds of allocator / scheduler event a StepRecord may carry.
EVENT_KINDS = (
    "admit",      # a waiting request joined the running batch
    "wait",       # the next waiting request cannot be admitted yet (not enough free memory), and why
    "allocate",   # prefill took blocks for a request's tokens
    "new_block",  # decode took one fresh block because the last one was full
    "append",     # decode wrote one token into a slot of an existing block
    "cow",        # copy-on-write: a shared, partly filled block was copied before writing
    "fork",       # a sequence now shares all of another's blocks
    "free",       # blocks returned to the free queue (count reached zero)
    "prefix_hit", # a new sequence reused cached blocks of an identical prefix
    "evict",      # a free cached block was handed out again; its hash is dropped
    "preempt",    # a running request was evicted from the batch to free blocks (recompute or swap)
    "swap_out",   # blocks copied to the CPU swap pool and released on the GPU
    "swap_in",    # blocks copied back from the swap pool into fresh GPU blocks
    "finish",     # a request (or one of its samples / beams) finished
)


@dataclass
class Event:
    """One allocator or scheduler decision.

    Attributes:
        kind: one of ``EVENT_KINDS``.
        request_id: the request concerned (None for pool-wide events).
        blocks: physical block ids involved, in order (for "cow": [source, destination]).
        message: the decision in one plain sentence, for people.
        data: extra machine-readable fields (e.g. ``{"slot": 37}``, ``{"mode": "recompute"}``).
    """

    kind: str
    request_id: str | None
    blocks: list[int] = field(default_factory=list)
    message: str = ""
    data: dict = field(default_factory=dict)


@dataclass
class SequenceState:
    """One sequence (a request's only sequence, one of its ``n`` samples or one of its beams).

    ``num_tokens`` counts prompt + generated tokens whose K/V are in the pool (0 while waiting).
    ``token_ids`` is prompt + generated so far, so a viewer can show which text a block holds:
    token ``t`` lives in logical block ``t // block_size``. ``block_table`` is the GPU table, or the CPU
    swap-pool table while ``status`` is "swapped".
    """

    seq_id: str
    request_id: str
    status: str  # "waiting" | "running" | "swapped" | "finished"
    prompt_len: int
    num_generated: int
    num_tokens: int
    block_table: list[int]
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Snapshot:
    """The pool and every block table after a step.

    ``ref_counts``, ``fills``, ``owners`` and ``block_hashes`` are indexed by physical block id: reference
    count, tokens held (0..block_size), the ids of the sequences whose block tables point at the block,
    and its prefix-cache hash (None if not cached). A block with count 0 and a hash is free but cached.
    ``swap_fills`` is indexed by CPU swap-pool block id. ``prefix_cache`` holds the cache's counters:
    queries, query tokens, hit tokens, evictions.

    For the contiguous baseline (``allocator == "contiguous"``) the pool fields describe slots (block size
    1, per-block lists empty) and ``contiguous`` holds the region's layout and accounting: capacity,
    reservation, each reservation's start/length/used, the gaps, used, reserved-but-unused, internal and
    external fragmentation, free slots and the largest gap (``ContiguousAllocator.layout``).
    """

    num_blocks: int
    block_size: int
    num_free_blocks: int
    ref_counts: list[int]
    fills: list[int]
    owners: list[list[str]]
    sequences: list[SequenceState]
    waiting: list[str]
    running: list[str]
    block_hashes: list[str | None] = field(default_factory=list)
    swapped: list[str] = field(default_factory=list)
    num_swap_blocks: int = 0
    num_free_swap_blocks: int = 0
    swap_fills: list[int] = field(default_factory=list)
    prefix_cache: dict = field(default_factory=dict)
    allocator: str = "paged"
    contiguous: dict | None = None

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def slots_used(self) -> int:
        """Token slots holding real K/V of live sequences (tokens)."""
        if self.contiguous is not None:
            return self.contiguous["used_slots"]
        return sum(f for f, c in zip(self.fills, self.ref_counts) if c > 0)

    @property
    def slots_allocated(self) -> int:
        """Token slots taken by live sequences: blocks in use x block size (paged), or reserved slots
        (contiguous)."""
        if self.contiguous is not None:
            return self.contiguous["used_slots"] + self.contiguous["reserved_unused_slots"]
        return self.num_used_blocks * self.block_size

    @property
    def num_running(self) -> int:
        return len(self.running)


@dataclass
class ScheduledSequence:
    """A sequence that ran in this step: ``num_tokens`` computed, at positions
    ``[start_pos, start_pos + num_tokens)``."""

    seq_id: str
    request_id: str
    num_tokens: int
    start_pos: int


@dataclass
class StepRecord:
    """Everything one ``LLMEngine.step()`` did.

    Attributes:
        step: 1-based step number.
        kind: "prefill", "decode" or "idle" (nothing could run).
        scheduled: sequences that ran and how many tokens each computed.
        events: allocator and scheduler events, in the order they happened.
        new_tokens: sequence id -> token id sampled this step.
        new_text: sequence id -> text of that token.
        finished: sequence ids that finished this step.
        snapshot: pool and block tables after the step.
        elapsed_s: wall time of the step, seconds.
    """

    step: int
    kind: str
    scheduled: list[ScheduledSequence]
    events: list[Event]
    new_tokens: dict[str, int]
    new_text: dict[str, str]
    finished: list[str]
    snapshot: Snapshot
    elapsed_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepRecord":
        snap = dict(d["snapshot"])
        snap["sequences"] = [SequenceState(**r) for r in snap["sequences"]]
        return cls(
            step=d["step"],
            kind=d["kind"],
            scheduled=[ScheduledSequence(**s) for s in d["scheduled"]],
            events=[Event(**e) for e in d["events"]],
            new_tokens=dict(d["new_tokens"]),
            new_text=dict(d["new_text"]),
            finished=list(d["finished"]),
            snapshot=Snapshot(**snap),
            elapsed_s=d.get("elapsed_s", 0.0),
        )


def write_trace(records: Iterable[StepRecord], path: str | Path) -> int:
    """Write records as JSON lines (one record per line); returns how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec.to_dict(), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: str | Path) -> Iterator[StepRecord]:
    """Read a JSON-lines trace written by ``write_trace``.

    Raises:
        ValueError: a line is not a valid record (names the line number).
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield StepRecord.from_dict(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a step record ({exc})") from exc
