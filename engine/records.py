"""Step records: plain, JSON-serialisable data describing what one engine step did.

The engine produces one ``StepRecord`` per ``LLMEngine.step()``; the app, the lessons, the CLI and traces
only ever read these records (time travel in the app re-reads old records, it never re-runs the model).
A run can be written as a JSON-lines trace (one record per line) and read back with ``read_trace``.

Units: token counts are tokens, block ids index the physical pool, slots are ``block_id * block_size +
offset``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import MISSING, asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from enum import StrEnum
from pathlib import Path
from typing import Iterable, Iterator

from pydantic import TypeAdapter, ValidationError


def plural(count: int, one: str, many: str | None = None) -> str:
    """'1 block', '2 blocks', '1,000 prefixes' (``many`` where adding "s" is wrong)."""
    return f"{count:,} {one if count == 1 else (many or one + 's')}"

class EventKind(StrEnum):
    """Kinds of allocator / scheduler event a StepRecord may carry (a ``str``: compares equal to its value)."""

    ADMIT = "admit"            # a waiting request joined the running batch
    WAIT = "wait"              # the next waiting request cannot be admitted yet (not enough free memory), and why
    ALLOCATE = "allocate"      # prefill took blocks (or a contiguous reservation) for a sequence's tokens
    NEW_BLOCK = "new_block"    # decode took one fresh block because the last one was full
    APPEND = "append"          # decode wrote one token into a slot of an existing block
    COW = "cow"                # copy-on-write: a shared, partly filled block was copied before writing
    FORK = "fork"              # a sequence now shares all of another's blocks (contiguous: a copy in its own row)
    FREE = "free"              # blocks returned to the free queue (count reached zero)
    PREFIX_HIT = "prefix_hit"  # a new sequence reused cached blocks of an identical prefix
    EVICT = "evict"            # a free cached block was handed out again; its hash is dropped
    PREEMPT = "preempt"        # a running request was evicted from the batch to free blocks (recompute or swap)
    SWAP_OUT = "swap_out"      # blocks copied to the CPU swap pool and released on the GPU
    SWAP_IN = "swap_in"        # blocks copied back from the swap pool into fresh GPU blocks
    FINISH = "finish"          # a request (or one of its samples / beams) finished
    RESET_PREFIX_CACHE = "reset_prefix_cache"  # every free block's hash dropped (vLLM: reset_prefix_cache)
    LEAVE_WINDOW = "leave_window"  # a sliding-window KV cache group gave back blocks its window left


EVENT_KINDS = tuple(k.value for k in EventKind)
STEP_KINDS = ("prefill", "decode", "mixed", "idle")


class SeqStatus(StrEnum):
    """Where a sequence (and its request) is: vLLM's waiting / running / swapped / finished."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


# ``Event.data`` per kind: the one table of payload fields (name -> type). Fields not listed are not set;
# ``read_trace`` refuses a trace whose events carry other fields or other types.
#
# | kind               | data fields                                                                 |
# | ------------------ | --------------------------------------------------------------------------- |
# | admit              | num_tokens (prompt + generated, tokens), computed (tokens the prefill       |
# |                    | computes), readmission (bool: re-admitted after a recompute preemption)      |
# | wait               | reason (str)                                                                |
# | allocate           | num_tokens; cached_tokens (prefix-cache hit); contiguous: start, length      |
# |                    | (the reservation, slots); KV cache groups: group_blocks (each group's new   |
# |                    | blocks, in group order; ``blocks`` tells the full group's table)            |
# | new_block          | position (token index), logical_block; groups: group_blocks (as allocate)   |
# | append             | position; groups: group_blocks (each group's block written into)            |
# | cow                | src, dst (physical blocks), position                                        |
# | fork               | parent (sequence id); contiguous: start, length (the child's row, slots),   |
# |                    | copied (the parent's written slots copied into that row's first slots)      |
# | free               | released (the sequence's table); contiguous: start, length, used,           |
# |                    | final_len (slots / tokens)                                                  |
# | prefix_hit         | num_tokens (hit tokens), readmission (bool)                                 |
# | evict              | hash, still_cached (other blocks with the same hash stay findable: int)     |
# | preempt            | mode ("recompute" | "swap"), reason                                         |
# | swap_out / swap_in | pairs ([gpu, cpu] / [cpu, gpu]), seqs (sequence ids)                         |
# | finish             | reason ("stop" | "length" | "pruned"), final_len (tokens)                    |
# | reset_prefix_cache | num_blocks (hashes dropped)                                                 |
# | leave_window       | group (the KV cache group), position (tokens computed: the window of the    |
# |                    | next token starts at position - window + 1)                                 |
EVENT_DATA: dict[str, dict[str, type | tuple[type, ...]]] = {
    "admit": {"num_tokens": int, "computed": int, "readmission": bool},
    "wait": {"reason": str},
    "allocate": {"num_tokens": int, "cached_tokens": int, "start": int, "length": int, "group_blocks": list},
    "new_block": {"position": int, "logical_block": int, "group_blocks": list},
    "append": {"position": int, "group_blocks": list},
    "cow": {"src": int, "dst": int, "position": int},
    "fork": {"parent": str, "start": int, "length": int, "copied": int},
    "free": {"released": list, "start": int, "length": int, "used": int, "final_len": int},
    "prefix_hit": {"num_tokens": int, "readmission": bool},
    "evict": {"hash": str, "still_cached": int},
    "preempt": {"mode": str, "reason": str},
    "swap_out": {"pairs": list, "seqs": list},
    "swap_in": {"pairs": list, "seqs": list},
    "finish": {"reason": str, "final_len": int},
    "reset_prefix_cache": {"num_blocks": int},
    "leave_window": {"group": int, "position": int},
}


@dataclass
class Event:
    """One allocator or scheduler decision.

    Attributes:
        kind: an ``EventKind``.
        request_id: the request (or sequence) concerned; None for pool-wide events.
        blocks: physical block ids involved, in order (for "cow": [source, destination]).
        message: the decision in one plain sentence, for people.
        data: machine-readable fields, per kind as in ``EVENT_DATA``.
    """

    kind: EventKind
    request_id: str | None
    blocks: list[int] = field(default_factory=list)
    message: str = ""
    data: dict = field(default_factory=dict)


def changed_blocks(events) -> list[int]:
    """The physical blocks a step changed, sorted: every block named by one of its ``events`` other than a
    plain ``append`` (a token written into a block with room). So the blocks it allocated, took for a new
    token, copied from and to (copy-on-write), forked, freed, swapped out or in, or found in the prefix cache.
    What every stage outlines in the pool (the Playground, the presenter view, the exports:
    ``viz.stage.StageStep.changed``); of a beam step's phase, pass that phase's events."""
    return sorted({b for e in events if e.kind != "append" for b in event_blocks(e)})


def event_blocks(event) -> list[int]:
    """The physical blocks an event names: ``blocks`` (the shown group's table), and with KV cache groups every
    group's blocks it carries in ``data["group_blocks"]`` (allocate, new_block, append), so a hybrid step's
    outlines cover the sliding group's blocks too. The null entry (-1) is nobody's block and is left out."""
    extra = [b for group in event.data.get("group_blocks", ()) for b in group if b >= 0]
    return list(event.blocks) + [b for b in extra if b not in event.blocks]


def blocks_new_in_tables(events) -> set[int]:
    """The ``changed_blocks`` a block table took anew in a step: allocated (less those a prefix-cache hit of
    the same request only reused), taken for a new token, copied to (a copy-on-write's destination), swapped
    in. Not those a table only kept or lost (a fork's shared blocks, a hit, a copy's source, a free): what the
    block-table picture outlines (``viz.block_table``). Always a subset of ``changed_blocks(events)``."""
    hits: dict[str | None, set[int]] = {}
    for e in events:
        if e.kind == "prefix_hit":
            hits.setdefault(e.request_id, set()).update(e.blocks)
    new: set[int] = set()
    for e in events:
        if e.kind == "allocate":
            new.update(b for b in event_blocks(e) if b not in hits.get(e.request_id, set()))
        elif e.kind in ("new_block", "swap_in"):
            new.update(event_blocks(e))
        elif e.kind == "cow":
            new.add(e.data["dst"] if "dst" in e.data else e.blocks[-1])
    return new


class EventLog:
    """The engine's log of one step's events. The engine owns it and hands it to its allocator and its
    scheduler, which append to it; the engine drains it into the step's record. A bare ``BlockManager``
    (the lessons drive one directly) makes its own."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, kind: EventKind, request_id: str | None, blocks=(), message: str | None = None,
             facts: dict | None = None, **data) -> Event:
        """Log one event. Without a ``message``, its sentence is written from the typed event by
        ``engine.narration`` (``facts``: figures the sentence names beyond ``data``, not recorded)."""
        blocks = list(blocks)
        if message is None:
            from .narration import sentence  # narration reads EventKind from here

            message = sentence(kind, request_id, blocks, data, facts or {})
        event = Event(EventKind(kind), request_id, blocks, message, data)
        self.events.append(event)
        return event

    def drain(self) -> list[Event]:
        events, self.events = self.events, []
        return events


@dataclass
class SequenceState:
    """One sequence (a request's only sequence, one of its ``n`` samples or one of its beams).

    ``num_tokens`` counts prompt + generated tokens whose K/V are in the pool (0 while waiting).
    ``token_ids`` is prompt + generated so far, so a viewer can show which text a block holds:
    token ``t`` lives in logical block ``t // block_size``. ``block_table`` is the GPU table, or the CPU
    swap-pool table while ``status`` is "swapped".

    ``group_block_tables``: with KV cache groups (``Snapshot.kv_cache_groups`` not empty: a hybrid or
    sliding-window model), the sequence's table in every group, in group order, each as long as
    ``block_table``, ``NULL_BLOCK`` (-1) where a sliding-window group gave a block back (its window left
    it); ``block_table`` is then the first full-attention group's table (the first group's if none is full
    attention). Empty for a model of one full-attention group, where ``block_table`` says it all.
    """

    seq_id: str
    request_id: str
    status: SeqStatus
    prompt_len: int
    num_generated: int
    num_tokens: int
    block_table: list[int]
    token_ids: list[int]
    finish_reason: str | None = None
    group_block_tables: list[list[int]] = field(default_factory=list)


@dataclass
class Snapshot:
    """The pool and every block table after a step.

    ``ref_counts``, ``fills``, ``owners`` and ``block_hashes`` are indexed by physical block id: reference
    count, tokens held (0..block_size), the ids of the sequences whose block tables point at the block,
    and its prefix-cache hash (None if not cached). A block with count 0 and a hash is free but cached.
    ``swap_fills`` is indexed by CPU swap-pool block id. ``prefix_cache`` holds the cache's counters
    (``BlockManager.stats``: requests, queries, hits of first admissions; the same for re-admissions after
    a preemption; evictions).

    For the contiguous baseline (``allocator == "contiguous"``) the pool fields describe slots (block size
    1, per-block lists empty) and ``contiguous`` holds the region's layout and accounting: capacity,
    reservation, each reservation's start/length/used, the gaps, used, reserved-but-unused, internal and
    external fragmentation, free slots and the largest gap (``ContiguousAllocator.layout``).

    ``kv_cache_groups``: one dict per KV cache group of a hybrid (or sliding-window) model, in group order
    (``kv_cache_group_dicts``): ``{"kind": "full_attention" | "sliding_window", "sliding_window": tokens
    or None, "layers": [decoder layer indices]}``; every group draws from this one pool and each sequence
    has a table per group (``SequenceState.group_block_tables``). Empty for a model of one
    full-attention group.
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
    kv_cache_groups: list[dict] = field(default_factory=list)

    def __getattr__(self, name: str):
        # Only reached for an attribute not set yet: the per-block lists of a snapshot built from a
        # ``PoolDelta`` (``make_snapshot``), filled in on first read.
        if name in POOL_LIST_FIELDS and "_pool_delta" in self.__dict__:
            _materialize(self)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def slots_used(self) -> int:
        """Token slots holding K/V of live sequences (``engine.metrics.slots_used``)."""
        from .metrics import slots_used
        return slots_used(self)

    @property
    def slots_allocated(self) -> int:
        """Token slots taken by live sequences (``engine.metrics.slots_allocated``)."""
        from .metrics import slots_allocated
        return slots_allocated(self)

    @property
    def num_running(self) -> int:
        return len(self.running)


NULL_BLOCK = -1  # a group's table entry where a sliding window gave its block back (vLLM's null block)
GROUP_KINDS = ("full_attention", "sliding_window")


def kv_cache_group_dicts(groups) -> list[dict]:
    """``Snapshot.kv_cache_groups`` of an allocator's KV cache groups (``KVCacheGroupSpec``s, or None): one
    dict per group, ``{"kind", "sliding_window", "layers"}``; empty for None or a lone full-attention group
    (a model whose every layer attends to everything)."""
    if not groups or (len(groups) == 1 and groups[0].sliding_window is None):
        return []
    return [{"kind": g.kind, "sliding_window": g.sliding_window, "layers": list(g.layer_ids)} for g in groups]


def shown_group(kv_cache_groups: list[dict]) -> int:
    """The group whose table is ``SequenceState.block_table``: the first full-attention group, else 0."""
    return next((g for g, d in enumerate(kv_cache_groups) if d["kind"] == "full_attention"), 0)


POOL_LIST_FIELDS = ("ref_counts", "fills", "owners", "block_hashes", "swap_fills")


@dataclass
class PoolDelta:
    """What changed in the pool's per-block lists since the previous step's snapshot ``prev``.

    ``blocks``: physical block id -> (reference count, fill, owners, hash) after the step; ``swap_fills``:
    swap-pool block id -> fill. A step touches a handful of blocks, so recording only those keeps a step's
    cost independent of the pool's size (a full snapshot of a 65,536-block pool took ~8 ms a step); the
    full lists are built when a view first reads them (``Snapshot.__getattr__``).
    """

    prev: "Snapshot"
    blocks: dict[int, tuple[int, int, list[str], str | None]]
    swap_fills: dict[int, int]


def make_snapshot(**fields) -> "Snapshot":
    """A ``Snapshot`` from an allocator's ``snapshot_fields`` plus the engine's: when they carry a
    ``pool_delta`` instead of the per-block lists, those lists are left to be built on first read."""
    delta = fields.pop("pool_delta", None)
    if delta is None:
        return Snapshot(**fields)
    snap = object.__new__(Snapshot)
    defaults = {f.name: (f.default_factory() if f.default_factory is not MISSING else f.default)
                for f in dataclass_fields(Snapshot) if f.name not in POOL_LIST_FIELDS}
    snap.__dict__.update({k: v for k, v in defaults.items() if v is not MISSING})
    snap.__dict__.update(fields)
    snap.__dict__["_pool_delta"] = delta
    return snap


def _materialize(snap: "Snapshot") -> None:
    """Build ``snap``'s per-block lists: copy the nearest snapshot back whose lists exist, then apply every
    delta since, oldest first. Iterative, so a long unviewed run costs no recursion depth."""
    chain, base = [], snap
    while "ref_counts" not in base.__dict__:
        delta = base.__dict__["_pool_delta"]
        chain.append(delta)
        base = delta.prev
    counts, fills, owners = list(base.ref_counts), list(base.fills), list(base.owners)
    hashes, swap_fills = list(base.block_hashes), list(base.swap_fills)
    for delta in reversed(chain):
        for b, (count, fill, who, h) in delta.blocks.items():
            counts[b], fills[b], owners[b], hashes[b] = count, fill, who, h
        for c, fill in delta.swap_fills.items():
            swap_fills[c] = fill
    snap.__dict__.update(ref_counts=counts, fills=fills, owners=owners, block_hashes=hashes, swap_fills=swap_fills)
    del snap.__dict__["_pool_delta"]  # its lists exist now; the chain behind it is not needed for them


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
        kind: "prefill", "decode", "mixed" (V1: decode tokens and prefill chunks in one step) or "idle"
            (nothing could run).
        scheduled: sequences that ran and how many tokens each computed.
        events: allocator and scheduler events, in the order they happened.
        new_tokens: sequence id -> token id sampled this step.
        new_text: sequence id -> text of that token.
        finished: sequence ids that finished this step.
        snapshot: pool and block tables after the step.
        elapsed_s: wall time of the step, seconds.
        kv_events: the step's KV cache events in vLLM's schema (``vllm/distributed/kv_events.py``), in
            order: ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
            "block_size"}``, ``{"type": "BlockRemoved", "block_hashes"}``, ``{"type": "AllBlocksCleared"}``.
        semantics: "paper" (vLLM V0 as the paper describes it) or "v1" (vLLM V1), the engine's.
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
    kv_events: list[dict] = field(default_factory=list)
    semantics: str = "paper"

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepRecord":
        """A record from ``to_dict``'s output, checked field by field (types strictly, counts >= 0, event
        kinds and their data as in ``EVENT_DATA``, per-block lists as long as the pool).

        Raises:
            ValueError: the first field that is wrong, by its path (e.g. ``snapshot.num_free_blocks``).
        """
        try:
            # JSON mode: strict types, with enums and lists read from their JSON forms
            record = _record_adapter().validate_json(json.dumps(d), strict=True)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ValueError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        _check_record(record)
        return record


@functools.cache
def _record_adapter():
    return TypeAdapter(StepRecord)


def _check_record(rec: "StepRecord") -> None:
    """What types alone do not say: counts >= 0, free <= total, per-block lists sized to the pool."""
    snap = rec.snapshot
    if rec.step < 1 or rec.kind not in STEP_KINDS:
        raise ValueError(f"step {rec.step} / kind {rec.kind!r}: a step is >= 1 and one of {', '.join(STEP_KINDS)}")
    if rec.semantics not in ("paper", "v1"):
        raise ValueError(f"semantics: {rec.semantics!r} is not 'paper' or 'v1'")
    for name in ("num_blocks", "block_size", "num_free_blocks", "num_swap_blocks", "num_free_swap_blocks"):
        if getattr(snap, name) < 0:
            raise ValueError(f"snapshot.{name}: {getattr(snap, name)} is negative")
    if snap.num_free_blocks > snap.num_blocks or snap.num_free_swap_blocks > snap.num_swap_blocks:
        raise ValueError(f"snapshot: more free blocks ({snap.num_free_blocks}) than blocks ({snap.num_blocks})")
    for name in ("ref_counts", "fills", "owners", "block_hashes"):
        values = getattr(snap, name)
        if values and len(values) != snap.num_blocks:
            raise ValueError(f"snapshot.{name}: {len(values)} entries for {snap.num_blocks} blocks")
    if any(v < 0 for v in snap.ref_counts) or any(not 0 <= v <= snap.block_size for v in snap.fills):
        raise ValueError("snapshot: a reference count is negative or a fill is outside 0..block_size")
    if snap.ref_counts and snap.ref_counts.count(0) != snap.num_free_blocks:
        raise ValueError(f"snapshot.num_free_blocks: {snap.num_free_blocks}, but {snap.ref_counts.count(0)} blocks "
                         f"have reference count 0")
    if not (math.isfinite(rec.elapsed_s) and rec.elapsed_s >= 0):
        raise ValueError(f"elapsed_s: {rec.elapsed_s!r} is not a duration in seconds")
    if (rec.kind == "idle") != (not rec.scheduled):
        raise ValueError(f"kind {rec.kind!r}: a step is idle exactly when it scheduled nothing "
                         f"({len(rec.scheduled)} sequences scheduled)")
    _check_groups(snap)
    sliding = any(g["kind"] == "sliding_window" for g in snap.kv_cache_groups)
    for i, e in enumerate(rec.kv_events):
        _check_kv_event(i, e, snap.block_size, sliding and e.get("type") == "BlockStored")
    for i, e in enumerate(rec.events):
        schema = EVENT_DATA[e.kind]
        for key, value in e.data.items():
            if key not in schema or isinstance(value, bool) != (schema[key] is bool) \
                    or not isinstance(value, schema[key]):
                raise ValueError(f"events.{i}.data.{key}: {value!r} is not a field of a {e.kind!r} event "
                                 f"of that type")


def _check_groups(snap: "Snapshot") -> None:
    """KV cache groups: each dict well formed (its kind, a window exactly for a sliding group, its layers
    disjoint from the others'); each sequence has one table per group (none without groups), all as long as
    ``block_table``, the shown group's equal to it, ids in the pool, ``NULL_BLOCK`` only in a sliding group."""
    groups, seen = snap.kv_cache_groups, set()
    for g, d in enumerate(groups):
        if set(d) != {"kind", "sliding_window", "layers"}:
            raise ValueError(f"snapshot.kv_cache_groups.{g}: keys {sorted(d)} are not kind, sliding_window, layers")
        kind, window, layers = d["kind"], d["sliding_window"], d["layers"]
        if kind not in GROUP_KINDS:
            raise ValueError(f"snapshot.kv_cache_groups.{g}.kind: {kind!r} is not one of {', '.join(GROUP_KINDS)}")
        sliding = kind == "sliding_window"
        if (window is not None) != sliding or (sliding and (isinstance(window, bool) or not isinstance(window, int)
                                                            or window < 1)):
            raise ValueError(f"snapshot.kv_cache_groups.{g}.sliding_window: {window!r} for a {kind} group "
                             f"(a positive number of tokens for sliding_window, null for full_attention)")
        if not isinstance(layers, list) or not layers or not all(
                isinstance(l, int) and not isinstance(l, bool) and l >= 0 for l in layers) or seen & set(layers):
            raise ValueError(f"snapshot.kv_cache_groups.{g}.layers: {layers!r} is not a non-empty list of layer "
                             f"indices that no other group has")
        seen.update(layers)
    shown = shown_group(groups) if groups else None
    for i, s in enumerate(snap.sequences):
        tables = s.group_block_tables
        where = f"snapshot.sequences.{i}.group_block_tables"
        if len(tables) != len(groups):
            raise ValueError(f"{where}: {len(tables)} tables for {len(groups)} KV cache groups ({s.seq_id})")
        if not groups:
            continue
        if tables[shown] != s.block_table:
            raise ValueError(f"{where}.{shown}: {tables[shown]} is not the block_table {s.block_table} ({s.seq_id})")
        for g, table in enumerate(tables):
            if len(table) != len(s.block_table):
                raise ValueError(f"{where}.{g}: {len(table)} entries, block_table has {len(s.block_table)} ({s.seq_id})")
            low = NULL_BLOCK if groups[g]["kind"] == "sliding_window" else 0
            limit = snap.num_swap_blocks if s.status == "swapped" else snap.num_blocks
            bad = [b for b in table if not low <= b < limit]
            if bad:
                raise ValueError(f"{where}.{g}: block {bad[0]} is not a block of the pool (0..{limit - 1}"
                                 f"{', or -1 in a sliding-window group' if low else ''}) ({s.seq_id})")


# vLLM's KV event types (vllm/distributed/kv_events.py) and the fields each must carry here
KV_EVENT_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                   "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}


def _check_kv_event(i: int, e: dict, block_size: int, sliding: bool = False) -> None:
    """A KV event in vLLM's schema: a known type, its fields, hashes given, and for BlockStored token ids of
    whole blocks at the pool's block size, one block per hash, except that a sliding-window group's
    BlockStored covers a range of which it caches only the blocks a hit can use, possibly none
    (vLLM's ``cache_full_blocks`` with a block mask; ``SlidingWindowManager.cache_blocks``)."""
    kind = e.get("type")
    if kind not in KV_EVENT_FIELDS:
        raise ValueError(f"kv_events.{i}.type: {kind!r} is not one of {', '.join(KV_EVENT_FIELDS)}")
    missing = [f for f in KV_EVENT_FIELDS[kind] if f not in e]
    if missing:
        raise ValueError(f"kv_events.{i}: a {kind} event lacks {', '.join(missing)}")
    if kind == "AllBlocksCleared":
        return
    hashes = e["block_hashes"]
    masked = kind == "BlockStored" and sliding  # a model with a sliding group: its block mask may keep none
    if not isinstance(hashes, list) or not (hashes or masked) or not all(isinstance(h, (str, int)) for h in hashes):
        raise ValueError(f"kv_events.{i}.block_hashes: {hashes!r} is not a non-empty list of hashes")
    if kind == "BlockStored":
        tokens, size = e["token_ids"], e["block_size"]
        whole = isinstance(tokens, list) and tokens and size and len(tokens) % size == 0 \
            and len(hashes) <= len(tokens) // size if masked else isinstance(tokens, list) and len(tokens) == len(hashes) * size
        if size != block_size or not whole \
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise ValueError(f"kv_events.{i}: a BlockStored of {len(hashes)} blocks of {size} tokens needs "
                             f"{len(hashes) * size} token ids{' or more, whole blocks (a sliding-window group)' if masked else ''}"
                             f" (pool block size {block_size})")


def write_trace(records: Iterable[StepRecord], path: str | Path) -> int:
    """Write records as JSON lines (one record per line); returns how many were written."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec.to_dict(), separators=(",", ":")) + "\n")
            n += 1
    return n


def read_trace(path: str | Path) -> Iterator[StepRecord]:
    """Read a JSON-lines trace written by ``write_trace``, checking every record (``StepRecord.from_dict``)
    and that step numbers increase and the semantics stay the same. An iterator: records come (and errors are raised) as it is consumed;
    ``list(read_trace(path))`` reads the whole trace.

    Raises:
        ValueError: a line is not JSON (NaN and Infinity included) or not a valid record, or its step does
            not follow the previous one (names the line number and the field).
    """
    last_step, semantics = 0, None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line, parse_constant=_no_constant)
            except (ValueError, RecursionError) as exc:  # JSON errors, NaN; RecursionError: absurdly deep JSON
                raise ValueError(f"{path}:{lineno}: not JSON ({type(exc).__name__})") from None
            try:
                record = StepRecord.from_dict(data)
            except (ValueError, TypeError, RecursionError) as exc:
                raise ValueError(f"{path}:{lineno}: not a step record ({exc})") from None
            if record.step <= last_step:
                raise ValueError(f"{path}:{lineno}: step {record.step} does not follow step {last_step}")
            if semantics is not None and record.semantics != semantics:
                raise ValueError(f"{path}:{lineno}: semantics {record.semantics!r}, but the trace began in {semantics!r}")
            last_step, semantics = record.step, record.semantics
            yield record


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")
