"""The block manager: which physical KV blocks each sequence owns (PagedAttention, Kwon et al., SOSP 2023).

It decides *what* to allocate; the bytes live in ``engine.kv_cache.KVCache``. It needs no model, so the
lessons drive it directly.

State, kept in plain lists and dicts (nano-vllm style):
- ``free_block_queue``: free physical block ids, in eviction order. Allocation takes from the front, freed
  blocks go to the back (vLLM's free block queue), so a fresh manager hands out 0, 1, 2, ... in order. It
  is an ``OrderedDict`` (a doubly linked list with O(1) removal), because a prefix-cache hit may take a
  free block out of the middle.
- ``ref_counts[b]``: how many block tables point at block ``b``. A block is free exactly when it is 0.
- ``fills[b]``: tokens held in block ``b`` (0..block_size).
- ``block_tables[seq]``: logical block ``i`` of ``seq`` (tokens ``i*B .. i*B+B-1``) -> physical block id.
- ``num_tokens[seq]``: tokens whose K/V slots ``seq`` holds.

Token ``t`` of a sequence lives in logical block ``t // B`` at offset ``t % B``; its slot id is
``block_table[t // B] * B + t % B``, which indexes the flattened pool ``[num_blocks * B, ...]``.

Sharing: ``fork`` makes a second table point at the same blocks (counts rise). Writing into a shared,
partly filled block first copies it to a fresh block (copy-on-write); the copy is queued so the owner of
the KV tensors copies the data before the write. Full blocks are never copied: nobody writes them again.

Automatic prefix caching (vLLM's design): a *full* block whose tokens are known gets a hash chained from
its parent block's hash and its own token ids, so equal hashes mean equal whole prefixes. A new sequence
reuses the blocks of its longest cached prefix, whether in use by others or free-but-cached; the last
prompt token is never taken from the cache, so the model computes at least one token and has logits.
Free cached blocks keep their hash until the free queue hands them out again (least recently freed first);
that eviction drops the stale hash. Two blocks may carry the same hash (two sequences computed the same
prefix before either was cached): the cache keeps every such block (hash -> blocks, as vLLM's
``BlockHashToBlockMap``), so evicting one leaves the others findable. ``stats`` counts prefix-cache
queries and hits of first admissions apart from re-admissions after a preemption (vLLM's
``PrefixCacheStats``: a re-admitted request mostly hits its own freed blocks, which says nothing about
sharing). ``reset_prefix_cache`` drops every hash while no block is in use (vLLM's ``reset_prefix_cache``).

Watermark (vLLM v0's ``BlockSpaceManager``): admission and swap-in keep ``watermark_blocks`` free
(``watermark`` x ``num_blocks``, rounded down), so a request just admitted is not preempted at its first
decode steps. It is waived when no sequence holds blocks, so a lone request that fits the pool always
runs. A swap-in also needs one free block per sequence for its next token.

Swapping: ``swap_out`` moves a set of sequences' blocks to a separate CPU swap pool (their GPU blocks are
released) and ``swap_in`` brings them back into fresh GPU blocks, preserving sharing inside the set.

Every decision is appended to the event log (``engine.records.EventLog``, the engine's own when it
passes one); data movement the KV tensors must do
is queued in ``pending_ops`` as ``(kind, src, dst)`` with kind "copy" (GPU->GPU), "swap_out" (GPU->CPU) or
"swap_in" (CPU->GPU), to be executed in order before the next forward pass.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from .metrics import blocks_for
from .records import EventKind, EventLog, PoolDelta

NONE_HASH = ""


class TrackedList(list):
    """A list of fixed length that adds the index of every item write to ``dirty`` (a set shared by the
    lists it tracks), so the block manager knows which blocks a step changed without scanning the pool.
    Reads stay those of a plain list."""

    __slots__ = ("dirty",)

    def __init__(self, values=(), dirty: set[int] | None = None) -> None:
        super().__init__(values)
        self.dirty = dirty if dirty is not None else set()

    def __setitem__(self, index, value) -> None:
        if isinstance(index, slice):
            self.dirty.update(range(*index.indices(len(self))))
        else:
            self.dirty.add(index % len(self))  # a negative index names the same block
        super().__setitem__(index, value)


class NoFreeBlocksError(RuntimeError):
    """Raised when an operation needs a free block and the pool has none; nothing was changed."""


def block_hash(parent_hash: str, token_ids) -> str:
    """Hash of a full block: SHA-256 over the parent block's hash and this block's token ids (16 hex chars).

    Chaining makes the hash identify the whole prefix up to this block, not just its own tokens.
    """
    h = hashlib.sha256(parent_hash.encode())
    h.update(b"|" + ",".join(map(str, token_ids)).encode())
    return h.hexdigest()[:16]


class BlockManager:
    """Paged allocation of ``num_blocks`` blocks of ``block_size`` token slots.

    Args:
        num_blocks: physical blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).
        enable_prefix_caching: reuse full blocks of identical prefixes (needs token ids on allocate/append).
        num_swap_blocks: blocks in the CPU swap pool (0: no swapping).
        watermark: share of the pool that admission and swap-in keep free, in [0, 1) (vLLM v0: 0.01).
        event_log: where decisions are logged (the engine's); default a log of the manager's own.
        evict_uncached_first: freed blocks without a prefix-cache hash go to the front of the free queue
            (reused first), cached ones to the back (vLLM V1's ``BlockPool.free_blocks``); False puts all at
            the back in the order freed (the paper's engine).

    Raises:
        ValueError: a size is not a positive integer (``num_swap_blocks`` may be 0), or a bad watermark.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_swap_blocks: int = 0, watermark: float = 0.0, event_log: EventLog | None = None,
                 evict_uncached_first: bool = False) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(num_swap_blocks, bool) or not isinstance(num_swap_blocks, int) or num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be an integer >= 0, got {num_swap_blocks!r}")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a number in [0, 1), got {watermark!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.evict_uncached_first = evict_uncached_first
        self.free_block_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Writes to the per-block lists mark the block in ``_dirty``, so a step's snapshot records only the
        # blocks it changed (``snapshot_fields``); ``_snapshot`` is the last one taken (None: next is full).
        self._dirty: set[int] = set()
        self._swap_dirty: set[int] = set()
        self._snapshot = None
        self.ref_counts = TrackedList([0] * num_blocks, self._dirty)
        self.fills = TrackedList([0] * num_blocks, self._dirty)
        self.block_tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}
        # prefix caching
        self.token_ids: dict[str, list[int]] = {}  # tokens of sequences that gave them (for hashing)
        self.block_hashes: list[str | None] = TrackedList([None] * num_blocks, self._dirty)
        self.cached_blocks: dict[str, dict[int, None]] = {}  # hash -> every block with it (an ordered set)
        self.stats = {"requests": 0, "queries": 0, "hits": 0, "preempted_requests": 0, "preempted_queries": 0,
                      "preempted_hits": 0, "evictions": 0}
        self.watermark_blocks = int(watermark * num_blocks)
        # swap pool (CPU)
        self.num_swap_blocks = num_swap_blocks
        self.swap_free: list[int] = list(range(num_swap_blocks))
        self.swap_ref_counts = [0] * num_swap_blocks
        self.swap_fills = TrackedList([0] * num_swap_blocks, self._swap_dirty)
        self.swap_tables: dict[str, list[int]] = {}
        self.swap_num_tokens: dict[str, int] = {}
        self.pending_ops: list[tuple[str, int, int]] = []
        # vLLM's KV cache events (vllm/distributed/kv_events.py) in its schema, drained each step:
        # {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        # "medium", "lora_name"}, {"type": "BlockRemoved", "block_hashes", "medium"}, {"type": "AllBlocksCleared"}
        self.kv_events: list[dict] = []
        self._last_stored: tuple[str, int] | None = None  # (sequence, logical block) of the last BlockStored
        self.log = event_log if event_log is not None else EventLog()
        self.peak_used_blocks = 0  # most blocks in use at any moment, also within a step

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_queue)

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self.swap_free)

    @property
    def events(self) -> list:
        """Events logged and not yet drained."""
        return self.log.events

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / block_size)."""
        return blocks_for(num_tokens, self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Physical blocks holding the longest cached prefix of ``token_ids`` (full blocks only, never the
        block of the last token). Changes nothing. Empty when prefix caching is off."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        parent = NONE_HASH
        for i in range((len(token_ids) - 1) // self.block_size):
            parent = block_hash(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
            blocks = self.cached_blocks.get(parent)
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def free_blocks_needed(self, num_tokens: int, token_ids: list[int] | None = None) -> int:
        """Free-queue blocks that allocating ``num_tokens`` tokens would consume: fresh blocks, plus cached
        hits that currently sit free (ref count 0) in the queue."""
        return self._free_blocks_needed(num_tokens, self.match_prefix(token_ids) if token_ids is not None else [])

    def _free_blocks_needed(self, num_tokens: int, hits: list[int]) -> int:
        return self.blocks_needed(num_tokens) - len(hits) + sum(self.ref_counts[b] == 0 for b in hits)

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None) -> bool:
        return self.free_blocks_needed(num_tokens, token_ids) <= self.num_free_blocks

    def _watermark(self) -> int:
        """Blocks admission and swap-in keep free: the watermark, waived while no block is in use."""
        return self.watermark_blocks if self.num_used_blocks else 0

    def admission_refusal(self, token_lists: list[list[int]], reservation: int | None = None) -> str | None:
        """Why sequences with these tokens cannot all be allocated now, keeping the watermark free (None if
        they can). Conservative: each sequence counts only the prefix-cache hits that exist before any of
        them is allocated. ``reservation`` is the contiguous allocator's; blocks are taken as needed here."""
        need = sum(self.free_blocks_needed(len(ids), ids) for ids in token_lists)
        keep = self._watermark()
        if need + keep <= self.num_free_blocks:
            return None
        return refusal(need, keep, self.num_free_blocks)

    def append_blocks_needed(self, seq_ids: list[str]) -> int:
        """Free blocks that one more token for each of these sequences takes: one for each full last block,
        and for a partly filled last block shared by k of them, k copies if others share it too, else k - 1
        (the last of them to write finds it no longer shared and writes in place)."""
        need, sharers = 0, {}
        for s in seq_ids:
            last = self._table(s)[-1]
            if self.num_tokens[s] % self.block_size == 0:
                need += 1
            elif self.ref_counts[last] > 1:
                sharers[last] = sharers.get(last, 0) + 1
        return need + sum(k if self.ref_counts[b] > k else k - 1 for b, k in sharers.items())

    def slot(self, seq_id: str, position: int) -> int:
        """Slot id of token ``position`` of ``seq_id``.

        Raises:
            ValueError: the position is not held by the sequence.
        """
        if not 0 <= position < self.num_tokens.get(seq_id, 0):
            raise ValueError(f"position {position} is not held by sequence {seq_id!r} "
                             f"({self.num_tokens.get(seq_id, 0)} tokens)")
        table = self.block_tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slot ids of tokens ``start .. end-1`` of ``seq_id``. Raises ValueError if ``start > end``."""
        if start > end:
            raise ValueError(f"slot_mapping range start {start} is after end {end}")
        return [self.slot(seq_id, p) for p in range(start, end)]

    def table_of(self, seq_id: str) -> tuple[list[int], int] | None:
        """(block table, tokens held) of ``seq_id``: its GPU table, or its CPU swap-pool table while swapped
        out; None if it holds nothing."""
        if seq_id in self.block_tables:
            return self.block_tables[seq_id], self.num_tokens[seq_id]
        if seq_id in self.swap_tables:
            return self.swap_tables[seq_id], self.swap_num_tokens[seq_id]
        return None

    def attention_view(self, seq_id: str) -> tuple[list[int], int]:
        """What attention needs to read ``seq_id``'s K/V: (block table, 0)."""
        return self._table(seq_id), 0

    def reservation_for(self, prompt_len: int, max_len: int, final_len: int | None = None) -> None:
        """Paging reserves nothing ahead: blocks are taken as tokens arrive."""
        return None

    max_seqs_per_request = None  # any number of samples / beams share blocks

    def snapshot_fields(self) -> dict:
        """The allocator's part of a ``records.Snapshot`` for ``records.make_snapshot``: the full per-block
        lists the first time, afterwards only the blocks written since the previous call (a ``PoolDelta``),
        so its cost follows what the step changed, not the pool's size."""
        if self._snapshot is None:
            fields = self.pool_fields()
        else:
            owners: dict[int, list[str]] = {b: [] for b in self._dirty}
            for seq_id, table in self.block_tables.items():
                for b in table:
                    if b in owners:
                        owners[b].append(seq_id)
            blocks = {b: (self.ref_counts[b], self.fills[b], owners[b], self.block_hashes[b]) for b in self._dirty}
            swap = {c: self.swap_fills[c] for c in self._swap_dirty}
            fields = self.pool_fields(lists=False)
            fields["pool_delta"] = PoolDelta(self._snapshot, blocks, swap)
        self._dirty.clear()
        self._swap_dirty.clear()
        return fields

    def snapshot_taken(self, snapshot) -> None:
        """Called with the snapshot built from the last ``snapshot_fields``: the next one is relative to it."""
        self._snapshot = snapshot

    def invariant_violations(self) -> list[str]:
        """Broken invariants (empty when consistent): counts equal table references, free exactly at count
        0, and the prefix cache both ways: every hashed block is findable by its hash, every cache entry
        points at a block carrying that hash."""
        bad = []
        refs = [0] * self.num_blocks
        for table in self.block_tables.values():
            for b in table:
                refs[b] += 1
        if refs != self.ref_counts:
            bad.append(f"reference counts {self.ref_counts} differ from table references {refs}")
        free = set(self.free_block_queue)
        if free != {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}:
            bad.append("the free queue is not exactly the blocks with count 0")
        for b, h in enumerate(self.block_hashes):
            if h is not None and b not in self.cached_blocks.get(h, {}):
                bad.append(f"block {b} carries hash {h} but the cache cannot find it")
        for h, blocks in self.cached_blocks.items():
            if not blocks:
                bad.append(f"cache entry {h} holds no block")
            bad += [f"cache entry {h} points at block {b}, which carries {self.block_hashes[b]}"
                    for b in blocks if self.block_hashes[b] != h]
        return bad

    def pool_fields(self, lists: bool = True) -> dict:
        """The pool's part of a ``records.Snapshot`` (per-block lists indexed by physical block id), so a
        lesson driving a bare manager draws it with the same figures as the engine's snapshots.
        ``lists=False``: only the fields that are not per-block lists."""
        fields = dict(num_blocks=self.num_blocks, block_size=self.block_size, num_free_blocks=self.num_free_blocks,
                      num_swap_blocks=self.num_swap_blocks, num_free_swap_blocks=self.num_free_swap_blocks,
                      prefix_cache=dict(self.stats))
        if lists:
            fields.update(ref_counts=list(self.ref_counts), fills=list(self.fills), owners=self.owners(),
                          block_hashes=list(self.block_hashes), swap_fills=list(self.swap_fills))
        return fields

    # ----------------------------------------------------------------------------------------- changes
    def allocate(self, seq_id: str, num_tokens: int, token_ids: list[int] | None = None) -> list[int]:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens (prefill); see
        ``allocate_with_prefix``. Returns the block table."""
        return self.allocate_with_prefix(seq_id, num_tokens, token_ids)[0]

    def allocate_with_prefix(self, seq_id: str, num_tokens: int, token_ids: list[int] | None = None,
                             reservation: int | None = None, preempted: bool = False,
                             query_tokens: int | None = None) -> tuple[list[int], int]:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens (prefill).

        With prefix caching and ``token_ids``, the longest cached prefix is reused (reference counts rise,
        free cached blocks leave the free queue); the rest takes fresh blocks from the free queue. Full
        fresh blocks are registered in the cache at once (their K/V are computed in this same step).
        ``preempted``: a re-admission after a preemption; its query and hits are counted apart in ``stats``.
        ``query_tokens``: the tokens the prefix-cache query counts (default ``num_tokens``; V1 allocates
        a first prefill chunk but queries the whole sequence). ``reservation`` is ignored (the contiguous allocator's).

        Returns:
            (block table, number of leading tokens whose K/V are already cached and need no compute).

        Raises:
            ValueError: ``seq_id`` already holds blocks, ``num_tokens`` < 1, or ``token_ids`` has another length.
            NoFreeBlocksError: fewer free blocks than needed (nothing is taken).
        """
        if seq_id in self.block_tables or seq_id in self.swap_tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"got {len(token_ids)} token ids for num_tokens {num_tokens}")
        hits = self.match_prefix(token_ids) if token_ids is not None else []
        need = self._free_blocks_needed(num_tokens, hits)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {need} free blocks for {num_tokens} tokens, {self.num_free_blocks} free"
            )
        if self.enable_prefix_caching and token_ids is not None:
            prefix = "preempted_" if preempted else ""
            self.stats[prefix + "requests"] += 1
            self.stats[prefix + "queries"] += num_tokens if query_tokens is None else query_tokens
            self.stats[prefix + "hits"] += len(hits) * self.block_size
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free_block_queue[b]
            self.ref_counts[b] += 1
        table = hits + [self._take_block() for _ in range(self.blocks_needed(num_tokens) - len(hits))]
        for i, b in enumerate(table):
            self.fills[b] = min(self.block_size, num_tokens - i * self.block_size)
        self.block_tables[seq_id] = table
        self.num_tokens[seq_id] = num_tokens
        self.token_ids.pop(seq_id, None)  # never hash a block from an earlier sequence's tokens
        if token_ids is not None:
            self.token_ids[seq_id] = list(token_ids)
            for i in range(len(hits), num_tokens // self.block_size):
                self._register_full_block(seq_id, i)
        cached = len(hits) * self.block_size
        self.log.emit(EventKind.ALLOCATE, seq_id, table, self._allocation_message(seq_id, table, len(hits)),
                      num_tokens=num_tokens, cached_tokens=cached)
        if hits:
            self.log.emit(EventKind.PREFIX_HIT, seq_id, hits,
                          f"{seq_id}: reused {_n(len(hits), 'cached block')} ({cached} tokens)"
                          + (" on re-admission" if preempted else ""), num_tokens=cached, readmission=preempted)
        return list(table), cached

    def _allocation_message(self, seq_id: str, table: list[int], num_hits: int) -> str:
        """One sentence for an allocation: the tokens, the new blocks, any reused prefix, the last block's fill."""
        num_tokens, fresh = self.num_tokens[seq_id], table[num_hits:]
        taken = f"take {_n(len(fresh), 'new block')} {fresh}"
        if num_hits:
            cached = num_hits * self.block_size
            msg = (f"{seq_id}: prefix cache hit, {cached} tokens in blocks {table[:num_hits]} reused; "
                   f"{_n(num_tokens - cached, 'more token')} {taken}")
        else:
            msg = f"{seq_id}: {_n(num_tokens, 'token')} {taken}"
        return msg + f" (last block holds {self.fills[table[-1]]}/{self.block_size})"

    def append_slot(self, seq_id: str, token_id: int | None = None) -> int:
        """Reserve the slot for one more token of ``seq_id`` (decode) and return its slot id.

        - last block has room and reference count 1: write in place;
        - last block full (or no block yet): take a fresh block;
        - last block has room but is shared (count > 1): copy-on-write, i.e. take a fresh block, queue the
          copy (source, destination), point this table at the copy, decrement the source's count.
        With prefix caching and a ``token_id``, a block that becomes full is registered in the cache.

        Raises:
            KeyError: unknown ``seq_id``.
            NoFreeBlocksError: a fresh block is needed and none is free (nothing is changed).
        """
        table = self._table(seq_id)
        if seq_id in self.token_ids and token_id is None:  # checked before anything changes
            raise ValueError(f"sequence {seq_id!r} was allocated with token ids; append_slot needs token_id")
        n = self.num_tokens[seq_id]
        offset = n % self.block_size
        if offset == 0:
            if not self.free_block_queue:
                raise NoFreeBlocksError(f"sequence {seq_id!r} needs a new block for token {n}, none free")
            b = self._take_block()
            table.append(b)
            self.log.emit(EventKind.NEW_BLOCK, seq_id, [b],
                          f"{seq_id}: token {n} starts logical block {len(table) - 1}, takes block {b}",
                          position=n, logical_block=len(table) - 1)
        elif self.ref_counts[table[-1]] > 1:
            if not self.free_block_queue:
                raise NoFreeBlocksError(f"sequence {seq_id!r} must copy shared block {table[-1]}, none free")
            src = table[-1]
            dst = self._take_block()
            self.ref_counts[src] -= 1
            self.fills[dst] = self.fills[src]
            table[-1] = dst
            self.pending_ops.append(("copy", src, dst))
            self.log.emit(EventKind.COW, seq_id, [src, dst],
                          f"{seq_id}: block {src} is shared (count {self.ref_counts[src] + 1}) and partly filled, "
                          f"so it is copied to block {dst} before writing token {n}", src=src, dst=dst, position=n)
        else:
            self.log.emit(EventKind.APPEND, seq_id, [table[-1]],
                          f"{seq_id}: token {n} written into block {table[-1]} ({offset + 1}/{self.block_size})",
                          position=n)
        b = table[-1]
        assert self.ref_counts[b] == 1, "a block is only ever written by its sole owner"
        self.fills[b] = offset + 1
        self.num_tokens[seq_id] = n + 1
        if seq_id in self.token_ids:
            self.token_ids[seq_id].append(token_id)
            if offset + 1 == self.block_size:
                self._register_full_block(seq_id, len(table) - 1)
        return b * self.block_size + offset

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Make ``child_id`` share every block of ``parent_id`` (reference counts rise by one).

        Raises:
            KeyError: unknown parent. ValueError: the child already holds blocks.
        """
        table = self._table(parent_id)
        if child_id in self.block_tables or child_id in self.swap_tables:
            raise ValueError(f"sequence {child_id!r} already holds blocks")
        for b in table:
            self.ref_counts[b] += 1
        self.block_tables[child_id] = list(table)
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        if parent_id in self.token_ids:
            self.token_ids[child_id] = list(self.token_ids[parent_id])
        self.log.emit(EventKind.FORK, child_id, table, f"{child_id} forked from {parent_id}: shares blocks {table}",
                      parent=parent_id)
        return list(table)

    def free(self, seq_id: str, final_len: int | None = None) -> list[int]:
        """Release ``seq_id``'s blocks: every count drops by one; blocks reaching 0 return to the free queue
        (a cached block keeps its hash there until it is evicted). A swapped-out sequence releases its
        swap blocks instead. ``final_len`` (the contiguous allocator's accounting) is not needed here.

        Returns:
            the GPU blocks that became free (shared blocks still in use elsewhere are not among them).

        Raises:
            KeyError: unknown ``seq_id``.
        """
        if seq_id in self.swap_tables:
            self._release_swap(seq_id)
            self.token_ids.pop(seq_id, None)
            return []
        table = self._table(seq_id)
        freed = [b for b in reversed(table) if self._release_block(b, enqueue=False)]
        self._enqueue_free(freed)
        del self.block_tables[seq_id]
        del self.num_tokens[seq_id]
        self.token_ids.pop(seq_id, None)
        kept = [b for b in table if b not in freed]
        msg = f"{seq_id}: released {_n(len(table), 'block')}, {len(freed)} free again {sorted(freed)}"
        if kept:
            msg += f", {len(kept)} still in use by other sequences {kept}"
        cached = [b for b in freed if self.block_hashes[b] is not None]
        if cached:
            msg += f"; {len(cached)} keep their prefix-cache hash until evicted"
        self.log.emit(EventKind.FREE, seq_id, sorted(freed), msg, released=list(table))
        return sorted(freed)

    # -------------------------------------------------------------------------------------------- swap
    def can_swap_out(self, seq_ids: list[str]) -> bool:
        return len(self._distinct_blocks(seq_ids)) <= self.num_free_swap_blocks

    def swap_out(self, seq_ids: list[str], request_id: str | None = None) -> list[tuple[int, int]]:
        """Move the blocks of ``seq_ids`` (one request's sequences) to the CPU swap pool.

        Each distinct GPU block gets one CPU block (sharing inside the set is kept); the GPU references are
        released like ``free``. Returns the (gpu, cpu) pairs, also queued as "swap_out" ops.

        Raises:
            NoFreeBlocksError: the swap pool is too small (nothing is changed).
        """
        distinct = self._distinct_blocks(seq_ids)
        if len(distinct) > self.num_free_swap_blocks:
            raise NoFreeBlocksError(f"swap pool has {self.num_free_swap_blocks} free blocks, "
                                    f"{len(distinct)} needed for {seq_ids}")
        mapping = {}
        for b in distinct:
            c = self.swap_free.pop(0)
            mapping[b] = c
            self.swap_fills[c] = self.fills[b]
            self.pending_ops.append(("swap_out", b, c))
        for s in seq_ids:
            table = self.block_tables.pop(s)
            self.swap_tables[s] = [mapping[b] for b in table]
            for c in self.swap_tables[s]:
                self.swap_ref_counts[c] += 1
            self.swap_num_tokens[s] = self.num_tokens.pop(s)
            for b in reversed(table):
                self._release_block(b)
        pairs = list(mapping.items())
        self._swap_event("swap_out", request_id or seq_ids[0], seq_ids, pairs, [g for g, _ in pairs],
                         f"copied to the CPU swap pool ({', '.join(f'{g}->cpu{c}' for g, c in pairs)}) and "
                         f"released on the GPU")
        return pairs

    def can_swap_in(self, seq_ids: list[str]) -> bool:
        """Room to swap these sequences back in and let each write its next token, keeping the watermark
        free (vLLM v0's ``can_swap_in``: the held blocks + one per sequence + the watermark)."""
        distinct = {c for s in seq_ids for c in self.swap_tables[s]}
        # into an empty pool a request always fits: it fits the pool on its own at its longest
        headroom = len(seq_ids) + self._watermark() if self.num_used_blocks else 0
        return len(distinct) + headroom <= self.num_free_blocks

    def swap_in(self, seq_ids: list[str], request_id: str | None = None) -> list[tuple[int, int]]:
        """Bring swapped sequences back into fresh GPU blocks. Returns the (cpu, gpu) pairs, also queued as
        "swap_in" ops. Raises NoFreeBlocksError if the GPU pool is too small (nothing is changed)."""
        distinct = list(dict.fromkeys(c for s in seq_ids for c in self.swap_tables[s]))
        if len(distinct) > self.num_free_blocks:
            raise NoFreeBlocksError(f"swap-in of {seq_ids} needs {len(distinct)} blocks, {self.num_free_blocks} free")
        mapping = {}
        for c in distinct:
            b = self._take_block()
            self.ref_counts[b] = 0  # counted below, once per table entry (sharing inside the set is kept)
            mapping[c] = b
            self.fills[b] = self.swap_fills[c]
            self.pending_ops.append(("swap_in", c, b))
        for s in seq_ids:
            self.block_tables[s] = [mapping[c] for c in self.swap_tables[s]]
            for b in self.block_tables[s]:
                self.ref_counts[b] += 1
            self.num_tokens[s] = self.swap_num_tokens[s]
            self._release_swap(s, quiet=True)
        pairs = list(mapping.items())
        self._swap_event("swap_in", request_id or seq_ids[0], seq_ids, pairs, [g for _, g in pairs],
                         f"copied back from the CPU swap pool ({', '.join(f'cpu{c}->{g}' for c, g in pairs)})")
        return pairs

    def _swap_event(self, kind: str, request_id: str, seq_ids: list[str], pairs, gpu_blocks: list[int],
                    what: str) -> None:
        self.log.emit(EventKind(kind), request_id, gpu_blocks, f"{', '.join(seq_ids)}: {_n(len(pairs), 'block')} {what}",
                      pairs=[list(p) for p in pairs], seqs=list(seq_ids))

    # -------------------------------------------------------------------------------------- prefix cache
    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, as vLLM's ``reset_prefix_cache``: refused (returns False, changes nothing)
        while any block is in use, since running sequences' blocks would lose their hashes under them.
        Afterwards no free block has a hash or holds tokens, and no earlier prefix can hit. The hit-rate
        counters start again too, as vLLM's ``PrefixCacheStats.reset`` restarts its hit rate (evictions
        are kept: they happened)."""
        if self.num_used_blocks:
            return False
        dropped = sum(h is not None for h in self.block_hashes)
        self.block_hashes = TrackedList([None] * self.num_blocks, self._dirty)
        self.cached_blocks = {}
        self.fills = TrackedList([0] * self.num_blocks, self._dirty)
        self._snapshot = None  # every block changed: the next snapshot is a full one
        self.stats.update({k: 0 for k in self.stats if k != "evictions"})
        self.kv_events.append({"type": "AllBlocksCleared"})
        self.log.emit(EventKind.RESET_PREFIX_CACHE, None, [],
                      f"prefix cache reset: {_n(dropped, 'cached block')} forgotten", num_blocks=dropped)
        return True

    # ------------------------------------------------------------------------------- vLLM V1 allocation
    def blocks_to_allocate(self, seq_id: str, token_ids: list[int], num_tokens: int) -> int:
        """Free-queue blocks that holding the first ``num_tokens`` tokens of ``seq_id`` would take (vLLM V1's
        ``get_num_blocks_to_allocate``): new blocks beyond those it holds, or for a sequence holding none,
        beyond its prefix-cache hit on ``token_ids``, plus the hit blocks that sit free (ref count 0) and
        would leave the free queue. Changes nothing."""
        if seq_id in self.block_tables:
            return max(self.blocks_needed(num_tokens) - len(self.block_tables[seq_id]), 0)
        return self.free_blocks_needed(num_tokens, token_ids)

    def allocate_slots(self, seq_id: str, token_ids: list[int], num_new_tokens: int,
                       preempted: bool = False) -> int:
        """vLLM V1's ``KVCacheManager.allocate_slots`` for one sequence: hold slots for ``num_new_tokens``
        more tokens of ``token_ids`` (all the sequence's tokens, prompt + generated). A sequence holding no
        blocks first takes its longest cached prefix (``get_computed_blocks``: never the last token's
        block), recorded in ``stats`` (``preempted``: a re-admission, counted apart), and its
        ``num_new_tokens`` start after the hit. Full blocks among the held tokens enter the prefix cache
        at once (``cache_blocks``), each with a "BlockStored" KV event; a block taken from the free queue
        that carried a hash is evicted first ("BlockRemoved").

        Returns:
            the tokens found in the prefix cache (0 for a sequence that already held blocks).

        Raises:
            ValueError: ``num_new_tokens`` < 1, or the held tokens would exceed ``token_ids``.
            NoFreeBlocksError: fewer free blocks than needed (nothing is changed).
        """
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be a positive integer, got {num_new_tokens!r}")
        new = seq_id not in self.block_tables
        held = len(self.match_prefix(token_ids)) * self.block_size if new else self.num_tokens[seq_id]
        total = held + num_new_tokens
        if total > len(token_ids):
            raise ValueError(f"{seq_id}: {total} tokens to hold but only {len(token_ids)} token ids")
        if new:  # takes the hit and checks the free blocks itself
            return self.allocate_with_prefix(seq_id, total, list(token_ids[:total]), preempted=preempted,
                                             query_tokens=len(token_ids))[1]
        if num_new_tokens == 1:  # a decode token: the paper's append path (no block is shared partly filled)
            self.append_slot(seq_id, token_ids[held])
            return 0
        need = self.blocks_to_allocate(seq_id, token_ids, total)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {need} free blocks to hold {total} tokens, "
                                    f"{self.num_free_blocks} free")
        table = self.block_tables[seq_id]
        fresh = [self._take_block() for _ in range(self.blocks_needed(total) - len(table))]
        table.extend(fresh)
        for i in range(held // self.block_size, len(table)):
            self.fills[table[i]] = min(self.block_size, total - i * self.block_size)
        self.num_tokens[seq_id] = total
        self.token_ids[seq_id] = list(token_ids[:total])
        for i in range(held // self.block_size, total // self.block_size):
            self._register_full_block(seq_id, i)
        took = f"takes {_n(len(fresh), 'new block')} {fresh}" if fresh else "fits in its last block"
        written = table[held // self.block_size:]  # every block the chunk writes into, the partly filled one too
        self.log.emit(EventKind.ALLOCATE, seq_id, written,
                      f"{seq_id}: prefill chunk of {num_new_tokens} tokens (positions {held}..{total - 1}) {took}",
                      num_tokens=total, cached_tokens=0)
        return 0

    def drain_kv_events(self) -> list[dict]:
        """vLLM-schema KV cache events since the last drain, in order (one engine step's batch)."""
        events, self.kv_events = self.kv_events, []
        self._last_stored = None
        return events

    # ------------------------------------------------------------------------------------------- drains
    def drain_events(self) -> list:
        return self.log.drain()

    def drain_ops(self) -> list[tuple[str, int, int]]:
        """Data movement queued since the last drain, in order: ("copy"|"swap_out"|"swap_in", src, dst)."""
        ops, self.pending_ops = self.pending_ops, []
        return ops

    def drain_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last drain (drains every queued op)."""
        return [(s, d) for kind, s, d in self.drain_ops() if kind == "copy"]

    # ---------------------------------------------------------------------------------------- helpers
    def owners(self) -> list[list[str]]:
        """For each physical block, the sequences whose tables point at it."""
        owners: list[list[str]] = [[] for _ in range(self.num_blocks)]
        for seq_id, table in self.block_tables.items():
            for b in table:
                owners[b].append(seq_id)
        return owners

    def _table(self, seq_id: str) -> list[int]:
        try:
            return self.block_tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _take_block(self) -> int:
        b, _ = self.free_block_queue.popitem(last=False)
        old = self.block_hashes[b]
        if old is not None:  # evict a free cached block: its hash must no longer find it
            copies = self.cached_blocks[old]
            del copies[b]
            if not copies:
                del self.cached_blocks[old]
            self.block_hashes[b] = None
            self.stats["evictions"] += 1
            self.kv_events.append({"type": "BlockRemoved", "block_hashes": [old], "medium": "GPU"})
            also = (f"; {_n(len(copies), 'other block')} with the same prefix {'stays' if len(copies) == 1 else 'stay'}"
                    " cached" if copies else "")
            self.log.emit(EventKind.EVICT, None, [b],
                          f"block {b} evicted from the prefix cache (hash {old}) to be reused{also}",
                          hash=old, still_cached=len(copies))
        self.ref_counts[b] = 1
        self.fills[b] = 0
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return b

    def _release_block(self, b: int, enqueue: bool = True) -> bool:
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

    def _enqueue_free(self, blocks: list[int]) -> None:
        """Put blocks that just became free in the free queue, in eviction order (first = evicted first):
        all at the back, or with ``evict_uncached_first`` (vLLM V1's ``BlockPool.free_blocks``) the
        uncached ones at the front, so they are reused before any cached prefix is evicted."""
        if not self.evict_uncached_first:
            for b in blocks:
                self.free_block_queue[b] = None
            return
        uncached = [b for b in blocks if self.block_hashes[b] is None]
        for b in reversed(uncached):
            self.free_block_queue[b] = None
            self.free_block_queue.move_to_end(b, last=False)
        for b in blocks:
            if self.block_hashes[b] is not None:
                self.free_block_queue[b] = None

    def _register_full_block(self, seq_id: str, index: int) -> None:
        """Give logical block ``index`` of ``seq_id`` (full) its chained hash and cache it."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[seq_id]
        b = table[index]
        if self.block_hashes[b] is not None:
            return
        parent = self.block_hashes[table[index - 1]] if index > 0 else NONE_HASH
        if parent is None:  # parent not hashed (e.g. after a swap-in): leave this one out too
            return
        tokens = self.token_ids[seq_id][index * self.block_size:(index + 1) * self.block_size]
        h = block_hash(parent, tokens)
        self.block_hashes[b] = h
        self.cached_blocks.setdefault(h, {})[b] = None
        self._store_event(seq_id, index, h, parent if index > 0 else None, tokens)

    def _store_event(self, seq_id: str, index: int, h: str, parent: str | None, tokens) -> None:
        """A "BlockStored" KV event; consecutive blocks of one sequence cached in one go share one event,
        as vLLM's ``cache_full_blocks`` sends one per call (hashes in order, their tokens concatenated,
        the parent of the first)."""
        last = self.kv_events[-1] if self.kv_events else None
        if last is not None and last["type"] == "BlockStored" and self._last_stored == (seq_id, index - 1):
            last["block_hashes"].append(h)
            last["token_ids"].extend(tokens)
        else:
            self.kv_events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                                   "token_ids": list(tokens), "block_size": self.block_size, "lora_id": None,
                                   "medium": "GPU", "lora_name": None})
        self._last_stored = (seq_id, index)

    def _distinct_blocks(self, seq_ids: list[str]) -> list[int]:
        return list(dict.fromkeys(b for s in seq_ids for b in self._table(s)))

    def _release_swap(self, seq_id: str, quiet: bool = False) -> None:
        for c in self.swap_tables.pop(seq_id):
            self.swap_ref_counts[c] -= 1
            if self.swap_ref_counts[c] == 0:
                self.swap_fills[c] = 0
                self.swap_free.append(c)
        self.swap_num_tokens.pop(seq_id, None)
        if not quiet:
            self.log.emit(EventKind.FREE, seq_id, [], f"{seq_id}: released its swapped-out blocks")


def refusal(need: int, keep: int, free: int) -> str:
    """Why a request waits at the door: "needs 3 free blocks + 1 kept free (watermark), 2 free"."""
    also = f" + {keep} kept free (watermark)" if keep else ""
    return f"needs {_n(need, 'free block')}{also}, {free} free"


def _n(count: int, noun: str) -> str:
    """'1 block', '3 blocks'."""
    return f"{count} {noun}{'s' * (count != 1)}"
