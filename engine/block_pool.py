"""The block pool: the physical KV blocks, who counts on them, which are free, which hold a cached prefix
(vLLM V1's ``vllm/v1/core/block_pool.py``; PagedAttention, Kwon et al., SOSP 2023).

It knows blocks, not requests: the per-request block tables live in the KV cache manager above it
(``engine.kv_cache_manager``), which asks the pool for new blocks, hands blocks back, and registers full
blocks in the prefix cache. The bytes live in ``engine.kv_cache.KVCache``.

State, kept in plain lists and dicts (nano-vllm style), each indexed by physical block id:
- ``free_block_queue``: free block ids in eviction order. Allocation takes from the front, freed blocks go
  to the back (vLLM's ``FreeKVCacheBlockQueue``), so a fresh pool hands out 0, 1, 2, ... in order. It is an
  ``OrderedDict`` (a doubly linked list with O(1) removal), because a prefix-cache hit may take a free
  block out of the middle.
- ``ref_counts[b]``: how many block tables point at block ``b``. A block is free exactly when it is 0.
- ``fills[b]``: tokens held in block ``b`` (0..block_size).
- ``block_hashes[b]``: the prefix-cache hash of a full block (None: not cached), and ``cached_blocks``:
  hash -> every block carrying it, an ordered set (vLLM's ``BlockHashToBlockMap``). Two blocks may carry
  the same hash (two requests computed the same prefix before either was cached); evicting one leaves
  the others findable.
- KV cache groups (a hybrid model: ``engine.single_type_kv_cache_manager``): every group draws from this
  one pool, and a block is cached under its hash *and its group* (vLLM's ``BlockHashWithGroupId``,
  vllm/v1/core/kv_cache_utils.py:74), as the same prefix has other K/V in a sliding-window layer than in a
  full one: ``group_cached_blocks[g]`` is group ``g``'s map (``cached_blocks`` is group 0's) and
  ``block_groups[b]`` the group of a cached block.

A block hash is chained: SHA-256 over the parent block's hash and this block's token ids, so equal hashes
mean equal whole prefixes (``block_hash``). A free cached block keeps its hash until the free queue hands
it out again (least recently freed first); that eviction drops the hash ("BlockRemoved").

KV cache events in vLLM's schema (``vllm/distributed/kv_events.py``) are queued in ``kv_events`` and
drained once per engine step: {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size", "lora_id", "medium", "lora_name"}, {"type": "BlockRemoved", "block_hashes", "medium"},
{"type": "AllBlocksCleared"}; BlockStored and BlockRemoved carry their KV cache group's "group_idx" (0
included, vLLM's ``BlockPool`` sets it on every event: vllm/v1/core/block_pool.py:372, 559, 622), and a
BlockStored, once drained through ``KVCacheManager.drain_kv_events``, its group's "kv_cache_spec_kind" and
"kv_cache_spec_sliding_window" (vLLM's ``KVCacheManager.take_events``, vllm/v1/core/kv_cache_manager.py:
696-721). Typed lab events
(``engine.records.EventKind``: EVICT, RESET_PREFIX_CACHE) go to the event log; their sentences are
written in ``engine.narration``.

``stats`` holds the prefix cache's counters (vLLM's ``PrefixCacheStats``): the KV cache manager counts
queries and hits there, the pool its evictions.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from .records import EventKind, EventLog

NONE_HASH = ""


class NoFreeBlocksError(RuntimeError):
    """Raised when an operation needs a free block and the pool has none; nothing was changed."""


def block_hash(parent_hash: str, token_ids) -> str:
    """Hash of a full block: SHA-256 over the parent block's hash and this block's token ids (16 hex chars).

    Chaining makes the hash identify the whole prefix up to this block, not just its own tokens.
    """
    h = hashlib.sha256(parent_hash.encode())
    h.update(b"|" + ",".join(map(str, token_ids)).encode())
    return h.hexdigest()[:16]


def prefix_hashes(token_ids: list[int], block_size: int, num_blocks: int):
    """The chained hashes of the first ``num_blocks`` full blocks of ``token_ids``, computed lazily (a
    lookup that misses early hashes no further)."""
    parent = NONE_HASH
    for i in range(num_blocks):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        yield parent


def new_stats() -> dict:
    """Zeroed prefix-cache counters: first admissions, re-admissions after a preemption, evictions."""
    return {"requests": 0, "queries": 0, "hits": 0, "preempted_requests": 0, "preempted_queries": 0,
            "preempted_hits": 0, "evictions": 0}


class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` token slots.

    Args:
        num_blocks, block_size: positive integers (checked by the manager that builds the pool).
        log: the event log EVICT and RESET_PREFIX_CACHE go to.
        evict_uncached_first: ``free_blocks`` puts blocks without a hash at the front of the free queue
            (reused first), cached ones at the back (vLLM V1's ``BlockPool.free_blocks``); False puts all
            at the back in the order given (the paper's engine).
    """

    def __init__(self, num_blocks: int, block_size: int, log: EventLog, evict_uncached_first: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.log = log
        self.evict_uncached_first = evict_uncached_first
        self.free_block_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.ref_counts: list[int] = [0] * num_blocks
        self.fills: list[int] = [0] * num_blocks
        self.block_hashes: list[str | None] = [None] * num_blocks
        self.cached_blocks: dict[str, dict[int, None]] = {}
        self.group_cached_blocks: list[dict[str, dict[int, None]]] = [self.cached_blocks]
        self.block_groups: dict[int, int] = {}  # cached block -> its KV cache group (absent: group 0)
        self.stats = new_stats()
        self.kv_events: list[dict] = []
        self._last_stored: tuple | None = None  # key of the last BlockStored (a request's logical block)
        self.peak_used_blocks = 0  # most blocks in use at any moment, also within a step
        self.resets = 0  # times ``reset_prefix_cache`` dropped every hash (a recorder's cue for a full snapshot)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_queue)

    # ------------------------------------------------------------------------------------ take and give
    def get_new_block(self) -> int:
        """Take the block at the front of the free queue (count 1, empty), evicting its cached hash if it
        carries one. The caller checks that a block is free."""
        b, _ = self.free_block_queue.popitem(last=False)
        if self.block_hashes[b] is not None:
            self._evict(b)
        self.ref_counts[b] = 1
        self.fills[b] = 0
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return b

    def _evict(self, b: int) -> None:
        """Drop free block ``b``'s hash: the cache must no longer find it ("BlockRemoved", EVICT)."""
        old = self.block_hashes[b]
        group = self.block_groups.pop(b, 0)
        cache = self.group_cached_blocks[group]
        copies = cache[old]
        del copies[b]
        if not copies:
            del cache[old]
        self.block_hashes[b] = None
        self.stats["evictions"] += 1
        self.kv_events.append({"type": "BlockRemoved", "block_hashes": [old], "medium": "GPU", "group_idx": group})
        self.log.emit(EventKind.EVICT, None, [b], hash=old, still_cached=len(copies))

    def touch(self, blocks: list[int]) -> None:
        """One more reference to each of these (cached) blocks; a free one leaves the free queue."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.free_block_queue[b]
            self.ref_counts[b] += 1

    def release(self, b: int, enqueue: bool = True) -> bool:
        """Drop one reference to block ``b``; at zero it is free (a cached block keeps its hash and content
        until evicted) and, with ``enqueue``, joins the back of the free queue. Returns whether it became
        free."""
        self.ref_counts[b] -= 1
        if self.ref_counts[b]:
            return False
        if self.block_hashes[b] is None:
            self.fills[b] = 0
        if enqueue:
            self.free_block_queue[b] = None
        return True

    def free_blocks(self, blocks: list[int]) -> list[int]:
        """Drop one reference to each block, given in eviction order (first = evicted first; vLLM frees a
        request's blocks tail first). Blocks that became free join the free queue: all at the back, or with
        ``evict_uncached_first`` the uncached ones at the front, so they are reused before any cached
        prefix is evicted. Returns the blocks that became free, in that order."""
        freed = [b for b in blocks if self.release(b, enqueue=False)]
        if not self.evict_uncached_first:
            for b in freed:
                self.free_block_queue[b] = None
            return freed
        uncached = [b for b in freed if self.block_hashes[b] is None]
        for b in reversed(uncached):
            self.free_block_queue[b] = None
            self.free_block_queue.move_to_end(b, last=False)
        for b in freed:
            if self.block_hashes[b] is not None:
                self.free_block_queue[b] = None
        return freed

    # ------------------------------------------------------------------------------------- prefix cache
    def _cache(self, group: int) -> dict[str, dict[int, None]]:
        while len(self.group_cached_blocks) <= group:
            self.group_cached_blocks.append({})
        return self.group_cached_blocks[group]

    def get_cached_block(self, h: str, group: int = 0) -> int | None:
        """The first block carrying hash ``h`` in KV cache group ``group`` (None: no such prefix is cached)."""
        blocks = self._cache(group).get(h)
        return next(iter(blocks)) if blocks else None

    def cache_full_block(self, b: int, parent: str, tokens: list[int], key: tuple, group: int = 0) -> None:
        """Give full block ``b`` (holding ``tokens``, after the prefix hashed ``parent``) its chained hash
        and make it findable in KV cache group ``group``, with a "BlockStored" KV event. Consecutive blocks
        of one request and group cached in one go share one event, as vLLM's ``cache_full_blocks`` sends
        one per call and group (hashes in order, their tokens concatenated, the parent of the first):
        ``key`` is (request, logical block index)."""
        h = block_hash(parent, tokens)
        self._make_findable(b, h, group)
        seq, index = key
        last = self.kv_events[-1] if self.kv_events else None
        if last is not None and last["type"] == "BlockStored" and self._last_stored == (seq, group, index - 1):
            last["block_hashes"].append(h)
            last["token_ids"].extend(tokens)
        else:
            self.kv_events.append(self._stored_event([h], parent if index > 0 else None, tokens, group))
        self._last_stored = (seq, group, index)

    def cache_blocks(self, entries: list[tuple[int, str]], parent: str | None, tokens: list[int], group: int) -> None:
        """Make each (block, hash) of ``entries`` findable in KV cache group ``group`` and send one
        "BlockStored" with their hashes (possibly none) and ``tokens``, the whole range the call covered,
        after the prefix hashed ``parent`` (None: from the start): vLLM's ``cache_full_blocks`` with a block
        mask (a sliding-window group keeps only the blocks a hit can use)."""
        for b, h in entries:
            self._make_findable(b, h, group)
        self.kv_events.append(self._stored_event([h for _, h in entries], parent, tokens, group))
        self._last_stored = None

    def _make_findable(self, b: int, h: str, group: int) -> None:
        """Block ``b`` carries hash ``h`` and is found by it in KV cache group ``group``'s cached-block map."""
        self.block_hashes[b] = h
        self._cache(group).setdefault(h, {})[b] = None
        if group:
            self.block_groups[b] = group

    def _stored_event(self, hashes: list[str], parent: str | None, tokens, group: int) -> dict:
        """vLLM's "BlockStored" KV event (its schema, ``engine/kv_events.py``), with its KV cache group's
        ``group_idx`` (0 included, as vLLM 0.32's ``BlockPool._build_block_stored_event`` sets it,
        vllm/v1/core/block_pool.py:363-374); the group's spec kind and window are added when the KV cache
        manager drains the events (``KVCacheManager.drain_kv_events``), as vLLM's ``take_events`` does."""
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": list(tokens), "block_size": self.block_size, "lora_id": None, "medium": "GPU",
                "lora_name": None, "group_idx": group}

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, as vLLM's ``BlockPool.reset_prefix_cache``: refused (returns False,
        changes nothing) while any block is in use. Afterwards no block has a hash or holds tokens. The
        hit-rate counters start again (vLLM's ``PrefixCacheStats.reset``); evictions are kept."""
        if self.num_used_blocks:
            return False
        dropped = sum(h is not None for h in self.block_hashes)
        self.block_hashes[:] = [None] * self.num_blocks
        self.fills[:] = [0] * self.num_blocks
        self.cached_blocks = {}
        self.group_cached_blocks = [self.cached_blocks]
        self.block_groups = {}
        self.resets += 1
        self.stats.update({k: 0 for k in self.stats if k != "evictions"})
        self.kv_events.append({"type": "AllBlocksCleared"})
        self.log.emit(EventKind.RESET_PREFIX_CACHE, None, [], num_blocks=dropped)
        return True

    def drain_kv_events(self) -> list[dict]:
        """vLLM-schema KV cache events since the last drain, in order (one engine step's batch)."""
        events, self.kv_events = self.kv_events, []
        self._last_stored = None
        return events

    # ------------------------------------------------------------------------------------------ checks
    def invariant_violations(self, tables) -> list[str]:
        """Broken invariants given every block table (empty when consistent): counts equal table
        references, free exactly at count 0, and the prefix cache both ways: every hashed block is
        findable by its hash, every cache entry points at a block carrying that hash."""
        bad = []
        refs = [0] * self.num_blocks
        for table in tables:
            for b in table:
                if b >= 0:  # -1: the null block of a sliding-window table, nobody's block
                    refs[b] += 1
        if refs != list(self.ref_counts):
            bad.append(f"reference counts {list(self.ref_counts)} differ from table references {refs}")
        if set(self.free_block_queue) != {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}:
            bad.append("the free queue is not exactly the blocks with count 0")
        for b, h in enumerate(self.block_hashes):
            if h is not None and b not in self.group_cached_blocks[self.block_groups.get(b, 0)].get(h, {}):
                bad.append(f"block {b} carries hash {h} but the cache cannot find it")
        for g, cache in enumerate(self.group_cached_blocks):
            for h, blocks in cache.items():
                if not blocks:
                    bad.append(f"cache entry {h} holds no block")
                bad += [f"cache entry {h} points at block {b}, which carries {self.block_hashes[b]}"
                        for b in blocks if self.block_hashes[b] != h or self.block_groups.get(b, 0) != g]
        return bad
