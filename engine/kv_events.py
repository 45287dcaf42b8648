"""vLLM's KV cache event protocol: the schema, its msgpack encoding, and a tolerant decoder.

vLLM, SGLang and TensorRT-LLM publish what happens to their prefix cache so that KV-aware routers can
send a request where its prefix is already cached. The schema is vLLM's (``vllm/distributed/
kv_events.py``, 0.32):

    KVEventBatch = [ts, events, data_parallel_rank]          (msgspec ``array_like``: a msgpack array)
    BlockStored  = {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
                    "token_ids": [int, ...]  (every stored block's tokens, concatenated),
                    "block_size": int, "lora_id": int | None, "medium": "GPU" | "CPU" | ..., "lora_name": ...,
                    "extra_keys": ..., "group_idx": int, "kv_cache_spec_kind": "full_attention" | "sliding_window"
                    | ..., "kv_cache_spec_sliding_window": int | None}
    BlockRemoved = {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": ..., "group_idx": int}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

KV cache groups (a hybrid model: vLLM's hybrid KV cache manager): every BlockStored and BlockRemoved
carries its group's ``group_idx`` (0 included; vllm/v1/core/block_pool.py:372, 559, 622) and every
BlockStored its group's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``
(``KVCacheManager.take_events``, vllm/v1/core/kv_cache_manager.py:696-721); a field left None is not
sent (``omit_defaults``). A block hash is the request's, whatever the group (the group is added only
inside the pool's map), so two groups store the same hashes. A group that caches only some blocks of the
range its call covered sends fewer hashes than blocks, possibly none, with the whole range's token ids
and the parent of its first block: a sliding window caches the blocks a later hit can use
(``SlidingWindowManager.cache_blocks`` with ``reachable_block_mask``) and never the null blocks out of
its window (``BlockPool.cache_full_blocks``, block_pool.py:268-280). Such an event does not say which
blocks its hashes are.

sent over a ZMQ PUB socket as three frames: (topic, 8-byte big-endian sequence number, payload). A block
hash ``h`` is an int (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the low 64 bits of the
sha256 digest, ``maybe_convert_block_hash``) or the digest's bytes.

Encoding drift, read from the sources: vLLM 0.32 encodes each event as a msgpack *map* tagged by "type";
earlier vLLM releases (and SGLang's copy of the schema, ``sglang/srt/disaggregation/kv_events.py``, and
vLLM's own example subscriber) encode events ``array_like``: ``["BlockStored", hashes, parent, tokens,
block_size, lora_id, medium]``. ``decode_batch`` reads both, so one subscriber watches either server.

What is published here (``encode_batch``) is byte-for-byte what vLLM 0.32 sends: the structs below copy
its field order and options, so vLLM's own ``msgspec.msgpack.Decoder(type=KVEventBatch)`` reads the lab's
batches unchanged (tests/test_kv_events_peer.py checks this inside vLLM's environment).

Decoded events are plain dicts in the lab's own form (the one ``StepRecord.kv_events`` uses), with every
hash as a lowercase hex string so views can key, sort and print them: an int hash as 16 hex digits, a bytes
hash as its full hex.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

# --- the schema, as vLLM 0.32 defines it (field order matters: it is the encoding) -----------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three event types; ``tag=True`` adds ``"type": <class name>`` to each map."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# A batch's ``ts`` is the publisher's ``time.time()``: seconds since the epoch. Anything outside 0 .. the end of
# year 9999 (the last second ``datetime`` can show) is not a time: NaN, an infinity, 1e300.
MAX_TS = 253_402_300_799.0
# The most tokens one block may hold. vLLM's block sizes are 16 by default and at most a few hundred (its
# --block-size choices go to 256; hybrid models round theirs up to a few hundred); 4,096 leaves room for any
# real server while refusing a "block" of millions of tokens, which a mirror would otherwise keep in memory
# (measured: 30 BlockStored of 3,000,000 token ids each took a watch to ~1 GB).
MAX_BLOCK_SIZE = 4096
_ENCODER = msgspec.msgpack.Encoder()
_MASK64 = (1 << 64) - 1


class MalformedBatch(ValueError):
    """A payload that is not a KV event batch in vLLM's schema; the message names what is wrong."""


def ts_problem(ts) -> str | None:
    """None if ``ts`` is a publisher's time (a number of seconds since the epoch, 0 to ``MAX_TS``), else what is
    wrong with it, naming the value."""
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return f"ts is {_short(ts)}, expected a number of seconds"
    if not (isinstance(ts, int) or math.isfinite(ts)) or not 0 <= ts <= MAX_TS:  # NaN fails the comparison
        return (f"ts is {ts!r}, not a time: expected seconds since the epoch from 0 to {MAX_TS:,.0f} (the end of "
                f"year 9999)")
    return None


# --- hashes ------------------------------------------------------------------------------------------------


def external_hash(lab_hash: str) -> int:
    """The lab's block hash (hex sha256 digest, ``block_manager.block_hash``) as vLLM publishes one: the
    digest's low 64 bits as an int (``vllm.v1.core.kv_cache_utils.maybe_convert_block_hash``)."""
    return int(lab_hash, 16) & _MASK64


def hash_key(h: Any) -> str:
    """A published hash (int or bytes) as the hex string the lab keys blocks by: ints as 16 hex digits
    (vLLM's 64-bit form), bytes as their full hex. Raises MalformedBatch for anything else."""
    if isinstance(h, bool):
        raise MalformedBatch(f"a block hash is a bool ({h!r}), expected an int or bytes")
    if isinstance(h, int):
        return format(h & _MASK64, "016x")
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    raise MalformedBatch(f"a block hash is {type(h).__name__} ({h!r:.40}), expected an int or bytes")


# --- encode (what the lab publishes) ----------------------------------------------------------------------


def to_struct(event: dict) -> KVCacheEvent:
    """One of the lab's KV events (``StepRecord.kv_events``, hashes as hex digests) as vLLM's struct."""
    kind = event["type"]
    if kind == "BlockStored":
        parent = event.get("parent_block_hash")
        return BlockStored(block_hashes=[external_hash(h) for h in event["block_hashes"]],
                           parent_block_hash=None if parent is None else external_hash(parent),
                           token_ids=[int(t) for t in event["token_ids"]], block_size=int(event["block_size"]),
                           lora_id=event.get("lora_id"), medium=event.get("medium", "GPU"),
                           lora_name=event.get("lora_name"),
                           # vLLM's to_event_extra_keys for blocks without extra keys: one None per hash, None
                           # for an event with no hash (vllm/v1/core/kv_cache_utils.py:666-691)
                           extra_keys=[None] * len(event["block_hashes"]) or None, group_idx=event.get("group_idx"),
                           kv_cache_spec_kind=event.get("kv_cache_spec_kind"),
                           kv_cache_spec_sliding_window=event.get("kv_cache_spec_sliding_window"))
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=[external_hash(h) for h in event["block_hashes"]],
                            medium=event.get("medium", "GPU"), group_idx=event.get("group_idx"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"KV event type {kind!r} is not one of {', '.join(EVENT_TYPES)}")


def encode_batch(events: list[dict], ts: float | None = None, data_parallel_rank: int | None = 0) -> bytes:
    """The msgpack payload vLLM 0.32 would send for these events (``ts``: seconds since the epoch, now
    if None)."""
    batch = KVEventBatch(ts=time.time() if ts is None else ts, events=[to_struct(e) for e in events],
                         data_parallel_rank=data_parallel_rank)
    return _ENCODER.encode(batch)


# --- decode (what a subscriber reads) ---------------------------------------------------------------------


@dataclass
class DecodedBatch:
    """One KV event batch as the lab reads it: ``ts`` (seconds since the epoch, the publisher's clock),
    ``events`` (dicts in the lab's form, hashes as hex strings), ``data_parallel_rank`` (None if absent)."""
    ts: float
    events: list[dict] = field(default_factory=list)
    data_parallel_rank: int | None = None


# The array_like layout of earlier vLLM / SGLang: the tag first, then the fields in declaration order.
_ARRAY_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                 "medium", "lora_name"),
                 "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}


def decode_batch(payload: bytes, max_events: int | None = None) -> DecodedBatch:
    """Decode one payload (vLLM 0.32's map-tagged events or the older array-tagged ones).

    Raises MalformedBatch naming the first thing wrong (not msgpack, not a [ts, events, rank] array, a ``ts``
    that is not a time (NaN, infinite, negative or past ``MAX_TS``), an unknown event type, a missing field,
    a bad hash, a BlockStored whose tokens are not whole blocks or whose block_size is over ``MAX_BLOCK_SIZE``, or more than ``max_events`` events, arrays
    or maps nested deeper than Python's recursion limit: msgspec's decoder recurses per level, so a 1 KB
    payload of 1,000 nested one-element arrays would raise RecursionError). Never raises anything else,
    whatever the bytes: a publisher cannot stop a subscriber."""
    try:
        return _decode(payload, max_events)
    except RecursionError:
        raise MalformedBatch(f"nested too deep: a payload of {len(payload):,} bytes whose arrays or maps nest "
                             f"past Python's recursion limit (a KV event batch nests 4 levels)") from None


def _decode(payload: bytes, max_events: int | None) -> DecodedBatch:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatch(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise MalformedBatch(f"expected an array [ts, events, data_parallel_rank], got {_short(raw)}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    problem = ts_problem(ts)
    if problem:
        raise MalformedBatch(problem)
    if not isinstance(events, list):
        raise MalformedBatch(f"events is {_short(events)}, expected an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise MalformedBatch(f"data_parallel_rank is {_short(rank)}, expected an int")
    if max_events is not None and len(events) > max_events:
        raise MalformedBatch(f"{len(events):,} events in one batch, more than the limit of {max_events:,}")
    return DecodedBatch(ts=float(ts), events=[_decode_event(i, e) for i, e in enumerate(events)],
                        data_parallel_rank=rank)


def _decode_event(i: int, e: Any) -> dict:
    if isinstance(e, dict):
        kind = e.get("type")
        fields = dict(e)
    elif isinstance(e, list) and e and isinstance(e[0], str):
        kind = e[0]
        names = _ARRAY_FIELDS.get(kind, ())
        fields = dict(zip(names, e[1:]))
    else:
        raise MalformedBatch(f"event {i} is {_short(e)}, expected a map with 'type' or a tagged array")
    if kind not in EVENT_TYPES:
        raise MalformedBatch(f"event {i} has type {kind!r}, not one of {', '.join(EVENT_TYPES)}")
    if kind == "AllBlocksCleared":
        return {"type": kind}
    if not isinstance(fields.get("block_hashes"), list):
        raise MalformedBatch(f"event {i} ({kind}) has no block_hashes array")
    hashes = [hash_key(h) for h in fields["block_hashes"]]
    medium = fields.get("medium")
    group = _group_fields(i, kind, fields)
    if kind == "BlockRemoved":
        return {"type": kind, "block_hashes": hashes, "medium": medium, **group}
    tokens, size = fields.get("token_ids"), fields.get("block_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise MalformedBatch(f"event {i} (BlockStored) has block_size {_short(size)}, expected a positive int")
    if size > MAX_BLOCK_SIZE:
        raise MalformedBatch(f"event {i} (BlockStored) has block_size {size:,}, more than the {MAX_BLOCK_SIZE:,} "
                             f"tokens per block this reader takes (vLLM's blocks hold at most a few hundred)")
    if not isinstance(tokens, list):
        raise MalformedBatch(f"event {i} (BlockStored) has no token_ids array of ints")
    masked = group.get("kv_cache_spec_kind") not in (None, *WHOLE_RANGE_KINDS)
    if masked and (len(tokens) % size or len(tokens) < size * len(hashes) or not tokens):
        raise MalformedBatch(f"event {i} (BlockStored, a {group['kv_cache_spec_kind']} group): {len(tokens):,} token "
                             f"ids for {len(hashes)} block hashes of {size}, expected whole blocks, at least one and "
                             f"at least {size * len(hashes):,} tokens")
    if not masked and len(tokens) != size * len(hashes):
        raise MalformedBatch(f"event {i} (BlockStored): {len(tokens):,} token ids for {len(hashes)} blocks "
                             f"of {size}, expected {size * len(hashes):,}")
    if not all(isinstance(t, int) for t in tokens):
        raise MalformedBatch(f"event {i} (BlockStored) has no token_ids array of ints")
    parent = fields.get("parent_block_hash")
    return {"type": kind, "block_hashes": hashes, "parent_block_hash": None if parent is None else hash_key(parent),
            "token_ids": tokens, "block_size": size, "lora_id": fields.get("lora_id"), "medium": medium,
            "lora_name": fields.get("lora_name"), **group}


# KV cache spec kinds whose group caches every block of the range a BlockStored covers (one hash per
# block); any other kind (a sliding window, chunked local attention, Mamba) may skip blocks
WHOLE_RANGE_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
_GROUP_FIELDS = {"group_idx": int, "kv_cache_spec_kind": str, "kv_cache_spec_sliding_window": int}


def _group_fields(i: int, kind: str, fields: dict) -> dict:
    """The KV cache group fields an event carries (absent or None: not in the result), checked: group_idx
    and the window non-negative ints, the kind a string. A BlockRemoved carries group_idx only."""
    out = {}
    names = ("group_idx",) if kind == "BlockRemoved" else tuple(_GROUP_FIELDS)
    for name in names:
        value = fields.get(name)
        if value is None:
            continue
        want = _GROUP_FIELDS[name]
        if not isinstance(value, want) or isinstance(value, bool) or (want is int and value < 0):
            raise MalformedBatch(f"event {i} ({kind}) has {name} {_short(value)}, expected "
                                 f"{'a non-negative int' if want is int else 'a string'}")
        out[name] = value
    return out


def _short(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
