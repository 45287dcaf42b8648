"""The KV cache manager: which physical blocks each sequence holds, and prefix matching (vLLM V1's
``vllm/v1/core/kv_cache_manager.py``; PagedAttention, Kwon et al., SOSP 2023).

It decides *what* to allocate; the blocks are counted in the ``BlockPool`` (``engine.block_pool``) and
the bytes live in ``engine.kv_cache.KVCache``. It needs no model, so the lessons drive it directly.

Layers: ``KVCacheManager`` -> one ``SingleTypeKVCacheManager`` per KV cache group
(``engine.single_type_kv_cache_manager``: ``FullAttentionManager``, ``SlidingWindowManager``) -> the shared
``BlockPool``. The group managers hold the block tables; this class adds what is per sequence whatever
the group: tokens held, token ids (for hashing), the prefix-cache lookup and its counters, the event log
and the data movement queued for the KV tensors. The paper's operations (fork, copy-on-write) act on the
full-attention group, the only kind the paper's engine has.

KV cache groups (vLLM V1's hybrid KV cache manager; ``groups``, one ``KVCacheGroupSpec`` each): a model
whose layers all attend to everything has one group; a hybrid model (sliding-window and full-attention
layers) has one per kind, each with its own block table per request, all drawing from one pool. Then this
class is vLLM's ``HybridKVCacheCoordinator`` (vllm/v1/core/kv_cache_coordinator.py, vLLM 0.32) as well:
``allocate_slots`` first lets each group give back the blocks its window left
(``remove_skipped_blocks``), counts the blocks every group needs, takes them group by group, and caches
each group's full blocks (one "BlockStored" per group); a new request's prefix-cache hit is the length
every group agrees on (``find_longest_cache_hit``: full attention from the left, then a sliding group
searched from the right within that length, once, as vLLM's "simple hybrid" of one full and one other
kind; a uniform sliding-window model (Mistral) has its one sliding group only). ``block_tables`` are the
first full-attention group's (the one a figure shows; with no full group, the first group's),
``group_block_tables(seq)`` every group's.

State, kept in plain lists and dicts (nano-vllm style):
- ``block_tables[seq]``: logical block ``i`` of ``seq`` (tokens ``i*B .. i*B+B-1``) -> physical block id.
- ``num_tokens[seq]``: tokens whose K/V slots ``seq`` holds.
- ``token_ids[seq]``: the tokens of sequences that gave them (prefix caching hashes them).

Token ``t`` of a sequence lives in logical block ``t // B`` at offset ``t % B``; its slot id is
``block_table[t // B] * B + t % B``, which indexes the flattened pool ``[num_blocks * B, ...]``.

Sharing: ``fork`` makes a second table point at the same blocks (counts rise). Writing into a shared,
partly filled block first copies it to a fresh block (copy-on-write); the copy is queued so the owner of
the KV tensors copies the data before the write. Full blocks are never copied: nobody writes them again.

Automatic prefix caching (vLLM's design): a *full* block whose tokens are known gets a hash chained from
its parent block's hash and its own token ids. A new sequence reuses the blocks of its longest cached
prefix, whether in use by others or free-but-cached; the last prompt token is never taken from the cache,
so the model computes at least one token and has logits. ``stats`` counts prefix-cache queries and hits of
first admissions apart from re-admissions after a preemption (vLLM's ``PrefixCacheStats``: a re-admitted
request mostly hits its own freed blocks, which says nothing about sharing).

Every decision is a typed event in the event log (``engine.records.EventLog``; sentences from
``engine.narration``); data movement the KV tensors must do is queued in ``pending_ops`` as
``(kind, src, dst)`` with kind "copy" (GPU->GPU), "swap_out" (GPU->CPU) or "swap_in" (CPU->GPU), to be
executed in order before the next forward pass.
"""

from __future__ import annotations

from .block_pool import NONE_HASH, BlockPool, NoFreeBlocksError, block_hash, prefix_hashes  # noqa: F401
from .metrics import blocks_for
from .records import EventKind, EventLog
from .single_type_kv_cache_manager import (NULL_BLOCK, FullAttentionManager, KVCacheGroupSpec,
                                           SingleTypeKVCacheManager, manager_for)


class KVCacheManager:
    """Per-sequence block tables over a ``BlockPool`` of ``num_blocks`` blocks of ``block_size`` slots.

    Args:
        enable_prefix_caching: reuse full blocks of identical prefixes (needs token ids on allocate/append).
        event_log: where decisions are logged (the engine's); default a log of the manager's own.
        evict_uncached_first: the pool's free order (``BlockPool.free_blocks``): vLLM V1's when True.
        group_kinds: the manager class of each KV cache group, the first full attention (the paper's
            operations and the block tables shown are that group's).
        groups: the KV cache groups of a model (``single_type_kv_cache_manager.group_layers``), in vLLM's
            order; given, they decide the managers instead of ``group_kinds``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 event_log: EventLog | None = None, evict_uncached_first: bool = False,
                 group_kinds: tuple[type[SingleTypeKVCacheManager], ...] = (FullAttentionManager,),
                 groups: tuple[KVCacheGroupSpec, ...] | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.log = event_log if event_log is not None else EventLog()
        self.pool = BlockPool(num_blocks, block_size, self.log, evict_uncached_first)
        # one manager per KV cache group, all over the one pool
        if groups is not None:
            self.managers: list[SingleTypeKVCacheManager] = [
                manager_for(spec, self.pool, enable_prefix_caching, g) for g, spec in enumerate(groups)]
        else:
            self.managers = [kind(self.pool, enable_prefix_caching) for kind in group_kinds]
            for g, m in enumerate(self.managers):
                m.group_id = g
        self.groups = groups
        # a model with other than one full-attention group takes vLLM's group-by-group path
        self.hybrid = len(self.managers) > 1 or not isinstance(self.managers[0], FullAttentionManager)
        self.full = next((m for m in self.managers if isinstance(m, FullAttentionManager)), self.managers[0])
        self.block_tables: dict[str, list[int]] = self.full.req_to_blocks  # the full-attention group's tables
        self.num_tokens: dict[str, int] = {}
        self.token_ids: dict[str, list[int]] = {}
        # KV cache groups: each sequence's prompt length and shared-prefix boundary (vLLM's
        # ``Request.num_prompt_tokens`` / ``shared_prefix_boundary``), where a sliding group keeps a hit's blocks
        self.num_prompt_tokens: dict[str, int] = {}
        self.shared_prefix_boundary: dict[str, int] = {}
        self._longest_hit = 0
        self.pending_ops: list[tuple[str, int, int]] = []

    @property
    def stats(self) -> dict:
        return self.pool.stats

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / block_size)."""
        return blocks_for(num_tokens, self.block_size)

    def _holds(self, seq_id: str) -> bool:
        return seq_id in self.block_tables

    def _table(self, seq_id: str) -> list[int]:
        try:
            return self.block_tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    # ----------------------------------------------------------------------------------------- queries
    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Physical blocks holding the longest cached prefix of ``token_ids`` (full blocks only, never the
        block of the last token). Changes nothing. Empty when prefix caching is off."""
        if not self.enable_prefix_caching:
            return []
        if self.hybrid:  # the hit every group agrees on, as the shown group's blocks
            return self.find_longest_cache_hit(token_ids)[0][self.managers.index(self.full)]
        return self.full.find_longest_cache_hit(
            prefix_hashes(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size))

    def find_longest_cache_hit(self, token_ids: list[int]) -> tuple[tuple[list[int], ...], int]:
        """The longest prefix of ``token_ids`` cached for every KV cache group at once: (each group's hit
        blocks, ``NULL_BLOCK`` where a sliding group needs none; the hit's tokens). Never the last token's
        block (vLLM's ``get_computed_blocks`` caps the hit at ``num_tokens - 1``). Changes nothing.

        vLLM 0.32's ``HybridKVCacheCoordinator.find_longest_cache_hit`` (kv_cache_coordinator.py:796-931):
        full-attention groups first (their left-to-right scan bounds the rest), then each other group
        within the length so far; a group that finds less shortens it and the search restarts, except for
        the "simple hybrid" of one full and one other kind, where one pass settles it. The full groups'
        blocks are then cut to the agreed length."""
        B, groups = self.block_size, range(len(self.managers))
        self._longest_hit = 0
        if not self.enable_prefix_caching or not token_ids:
            return tuple([] for _ in groups), 0
        max_blocks = (len(token_ids) - 1) // B
        hashes = list(prefix_hashes(token_ids, B, max_blocks))
        is_full = [isinstance(m, FullAttentionManager) for m in self.managers]
        order = sorted(groups, key=lambda g: not is_full[g])
        kinds = {(type(m), m.sliding_window) for m in self.managers}
        simple = len(kinds) == 2 and is_full[order[0]]
        blocks: list[list[int] | None] = [None] * len(self.managers)
        lengths = [0] * len(self.managers)
        self._longest_hit = 0  # the longest one group found (vLLM: ``longest_hit_length``)
        hit = max_blocks * B
        while True:
            current = hit
            for g in order:
                if is_full[g] and blocks[g] is not None:  # full attention is downward-closed: look up once
                    current = min(current, lengths[g])
                    continue
                blocks[g] = self.managers[g].find_longest_cache_hit(hashes, current // B)
                current = lengths[g] = len(blocks[g]) * B
                self._longest_hit = max(self._longest_hit, current)
            if current >= hit:
                break
            hit = current
            if simple:
                break
        return tuple(b[:hit // B] for b in blocks), hit

    def free_blocks_needed(self, num_tokens: int, token_ids: list[int] | None = None) -> int:
        """Free-queue blocks that allocating ``num_tokens`` tokens would consume: fresh blocks, plus cached
        hits that currently sit free (ref count 0) in the queue."""
        return self._free_blocks_needed(num_tokens, self.match_prefix(token_ids) if token_ids is not None else [])

    def _free_blocks_needed(self, num_tokens: int, hits: list[int]) -> int:
        return self.blocks_needed(num_tokens) - len(hits) + sum(self.pool.ref_counts[b] == 0 for b in hits)

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None) -> bool:
        return self.free_blocks_needed(num_tokens, token_ids) <= self.pool.num_free_blocks

    def append_blocks_needed(self, seq_ids: list[str]) -> int:
        """Free blocks that one more token for each of these sequences takes: one for each full last block,
        and for a partly filled last block shared by k of them, k copies if others share it too, else k - 1
        (the last of them to write finds it no longer shared and writes in place)."""
        need, sharers, refs = 0, {}, self.pool.ref_counts
        for s in seq_ids:
            last = self._table(s)[-1]
            if self.num_tokens[s] % self.block_size == 0:
                need += 1
            elif refs[last] > 1:
                sharers[last] = sharers.get(last, 0) + 1
        return need + sum(k if refs[b] > k else k - 1 for b, k in sharers.items())

    def slot(self, seq_id: str, position: int) -> int:
        """Slot id of token ``position`` of ``seq_id``. Raises ValueError if the sequence does not hold it."""
        if not 0 <= position < self.num_tokens.get(seq_id, 0):
            raise ValueError(f"position {position} is not held by sequence {seq_id!r} "
                             f"({self.num_tokens.get(seq_id, 0)} tokens)")
        return self.block_tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slot ids of tokens ``start .. end-1`` of ``seq_id``. Raises ValueError if ``start > end``."""
        if start > end:
            raise ValueError(f"slot_mapping range start {start} is after end {end}")
        return [self.slot(seq_id, p) for p in range(start, end)]

    # ------------------------------------------------------------------------------ the paper's changes
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
        a first prefill chunk but queries the whole sequence). ``reservation`` is ignored (the contiguous
        allocator's).

        Returns:
            (block table, number of leading tokens whose K/V are already cached and need no compute).

        Raises:
            ValueError: ``seq_id`` already holds blocks, ``num_tokens`` < 1, or ``token_ids`` has another length.
            NoFreeBlocksError: fewer free blocks than needed (nothing is taken).
        """
        if self._holds(seq_id):
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if token_ids is not None and len(token_ids) != num_tokens:
            raise ValueError(f"got {len(token_ids)} token ids for num_tokens {num_tokens}")
        hits = self.match_prefix(token_ids) if token_ids is not None else []
        need = self.full.get_num_blocks_to_allocate(seq_id, num_tokens, hits)
        if need > self.pool.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {need} free blocks for {num_tokens} tokens, "
                f"{self.pool.num_free_blocks} free"
            )
        if self.enable_prefix_caching and token_ids is not None:
            prefix = "preempted_" if preempted else ""
            self.stats[prefix + "requests"] += 1
            self.stats[prefix + "queries"] += num_tokens if query_tokens is None else query_tokens
            self.stats[prefix + "hits"] += len(hits) * self.block_size
        self.full.save_new_computed_blocks(seq_id, hits)
        self.full.allocate_new_blocks(seq_id, num_tokens)
        table = self.block_tables[seq_id]
        for i, b in enumerate(table):
            self.pool.fills[b] = min(self.block_size, num_tokens - i * self.block_size)
        self.num_tokens[seq_id] = num_tokens
        self.token_ids.pop(seq_id, None)  # never hash a block from an earlier sequence's tokens
        if token_ids is not None:
            self.token_ids[seq_id] = list(token_ids)
            self.full.cache_blocks(seq_id, token_ids, range(len(hits), num_tokens // self.block_size))
        cached = len(hits) * self.block_size
        self.log.emit(EventKind.ALLOCATE, seq_id, table, facts={"block_size": self.block_size},
                      num_tokens=num_tokens, cached_tokens=cached)
        if hits:
            self.log.emit(EventKind.PREFIX_HIT, seq_id, hits, num_tokens=cached, readmission=preempted)
        return list(table), cached

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
        table, pool = self._table(seq_id), self.pool
        if seq_id in self.token_ids and token_id is None:  # checked before anything changes
            raise ValueError(f"sequence {seq_id!r} was allocated with token ids; append_slot needs token_id")
        n = self.num_tokens[seq_id]
        offset = n % self.block_size
        if offset == 0:
            if not pool.num_free_blocks:
                raise NoFreeBlocksError(f"sequence {seq_id!r} needs a new block for token {n}, none free")
            b = pool.get_new_block()
            table.append(b)
            self.log.emit(EventKind.NEW_BLOCK, seq_id, [b], position=n, logical_block=len(table) - 1)
        elif pool.ref_counts[table[-1]] > 1:
            if not pool.num_free_blocks:
                raise NoFreeBlocksError(f"sequence {seq_id!r} must copy shared block {table[-1]}, none free")
            src = table[-1]
            dst = pool.get_new_block()
            count = pool.ref_counts[src]
            pool.release(src)
            pool.fills[dst] = pool.fills[src]
            table[-1] = dst
            self.pending_ops.append(("copy", src, dst))
            self.log.emit(EventKind.COW, seq_id, [src, dst], facts={"count": count}, src=src, dst=dst, position=n)
        else:
            self.log.emit(EventKind.APPEND, seq_id, [table[-1]], position=n,
                          facts={"fill": offset + 1, "block_size": self.block_size})
        b = table[-1]
        assert pool.ref_counts[b] == 1, "a block is only ever written by its sole owner"
        pool.fills[b] = offset + 1
        self.num_tokens[seq_id] = n + 1
        if seq_id in self.token_ids:
            self.token_ids[seq_id].append(token_id)
            if offset + 1 == self.block_size:
                self.full.cache_blocks(seq_id, self.token_ids[seq_id], [len(table) - 1])
        return b * self.block_size + offset

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Make ``child_id`` share every block of ``parent_id`` (reference counts rise by one).

        Raises:
            KeyError: unknown parent. ValueError: the child already holds blocks.
        """
        self._table(parent_id)
        if self._holds(child_id):
            raise ValueError(f"sequence {child_id!r} already holds blocks")
        table = self.full.fork(parent_id, child_id)
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        if parent_id in self.token_ids:
            self.token_ids[child_id] = list(self.token_ids[parent_id])
        self.log.emit(EventKind.FORK, child_id, table, parent=parent_id)
        return list(table)

    def free(self, seq_id: str, final_len: int | None = None) -> list[int]:
        """Release ``seq_id``'s blocks: every count drops by one; blocks reaching 0 return to the free queue
        (a cached block keeps its hash there until it is evicted). ``final_len`` (the contiguous
        allocator's accounting) is not needed here.

        Returns:
            the blocks that became free (shared blocks still in use elsewhere are not among them), sorted.

        Raises:
            KeyError: unknown ``seq_id``.
        """
        self._table(seq_id)
        if self.hybrid:  # group by group, each table tail first (vLLM's ``KVCacheCoordinator.free``)
            table, freed = [], []
            for m in self.managers:
                t, f = m.free(seq_id)
                table += [b for b in t if b != NULL_BLOCK]
                freed += f
        else:
            table, freed = self.full.free(seq_id)
        del self.num_tokens[seq_id]
        self.token_ids.pop(seq_id, None)
        self.shared_prefix_boundary.pop(seq_id, None)
        self.num_prompt_tokens.pop(seq_id, None)
        cached = sum(self.pool.block_hashes[b] is not None for b in freed)
        self.log.emit(EventKind.FREE, seq_id, sorted(freed), facts={"cached": cached}, released=list(table))
        return sorted(freed)

    # ------------------------------------------------------------------------------- vLLM V1 allocation
    def blocks_to_allocate(self, seq_id: str, token_ids: list[int], num_tokens: int) -> int:
        """Free-queue blocks that holding the first ``num_tokens`` tokens of ``seq_id`` would take (vLLM V1's
        ``get_num_blocks_to_allocate``): new blocks beyond those it holds, or for a sequence holding none,
        beyond its prefix-cache hit on ``token_ids``, plus the hit blocks that sit free (ref count 0) and
        would leave the free queue. Changes nothing, except with KV cache groups: there a sequence that
        holds blocks first gives back those its windows left (as vLLM's ``allocate_slots`` does before it
        counts), and a sequence holding none is being admitted (vLLM's ``full_sequence_must_fit`` gate:
        a sliding group counts at most its ``max_admission_blocks``)."""
        if self.hybrid:
            if seq_id in self.num_tokens:
                self.remove_skipped_blocks(seq_id, self.num_tokens[seq_id])
                return sum(m.get_num_blocks_to_allocate(seq_id, num_tokens, []) for m in self.managers)
            hits, computed = self.find_longest_cache_hit(token_ids)
            return sum(m.get_num_blocks_to_allocate(seq_id, num_tokens, hits[g], computed, apply_admission_cap=True)
                       for g, m in enumerate(self.managers))
        hits = [] if seq_id in self.block_tables or token_ids is None else self.match_prefix(token_ids)
        need = 0
        for m in self.managers:
            need += m.get_num_blocks_to_allocate(seq_id, num_tokens, hits)
        return need

    def allocate_slots(self, seq_id: str, token_ids: list[int], num_new_tokens: int,
                       preempted: bool = False, num_prompt_tokens: int | None = None) -> int:
        """vLLM V1's ``KVCacheManager.allocate_slots`` for one sequence: hold slots for ``num_new_tokens``
        more tokens of ``token_ids`` (all the sequence's tokens, prompt + generated). A sequence holding no
        blocks first takes its longest cached prefix (``get_computed_blocks``: never the last token's
        block), recorded in ``stats`` (``preempted``: a re-admission, counted apart), and its
        ``num_new_tokens`` start after the hit. Full blocks among the held tokens enter the prefix cache
        at once (``cache_blocks``), each with a "BlockStored" KV event; a block taken from the free queue
        that carried a hash is evicted first ("BlockRemoved").

        ``num_prompt_tokens``: the sequence's prompt length (a sliding group caches the blocks a resend of
        the prompt can hit; default: ``token_ids``' length at the sequence's first allocation).

        Returns:
            the tokens found in the prefix cache (0 for a sequence that already held blocks).

        Raises:
            ValueError: ``num_new_tokens`` < 1, or the held tokens would exceed ``token_ids``.
            NoFreeBlocksError: fewer free blocks than needed (nothing is changed).
        """
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be a positive integer, got {num_new_tokens!r}")
        if self.hybrid:
            if num_prompt_tokens is not None or seq_id not in self.num_prompt_tokens:
                self.num_prompt_tokens[seq_id] = num_prompt_tokens or len(token_ids)
            return self._allocate_slots_by_group(seq_id, token_ids, num_new_tokens, preempted)
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
        for m in self.managers:
            m.remove_skipped_blocks(seq_id, held)
        need = self.blocks_to_allocate(seq_id, token_ids, total)
        if need > self.pool.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {need} free blocks to hold {total} tokens, "
                                    f"{self.pool.num_free_blocks} free")
        fresh = self.full.allocate_new_blocks(seq_id, total)
        for m in self.managers[1:]:
            m.allocate_new_blocks(seq_id, total)
        table = self.block_tables[seq_id]
        for i in range(held // self.block_size, len(table)):
            self.pool.fills[table[i]] = min(self.block_size, total - i * self.block_size)
        self.num_tokens[seq_id] = total
        self.token_ids[seq_id] = list(token_ids[:total])
        self.full.cache_blocks(seq_id, self.token_ids[seq_id], range(held // self.block_size, total // self.block_size))
        written = table[held // self.block_size:]  # every block the chunk writes into, the partly filled one too
        self.log.emit(EventKind.ALLOCATE, seq_id, written, num_tokens=total, cached_tokens=0,
                      facts={"chunk": num_new_tokens, "start": held, "fresh": fresh})
        return 0

    def _allocate_slots_by_group(self, seq_id: str, token_ids: list[int], num_new_tokens: int,
                                 preempted: bool) -> int:
        """``allocate_slots`` over several KV cache groups (or one that is not full attention), in vLLM
        0.32's order (kv_cache_manager.py:371-618): give back the blocks the windows left, count what every
        group needs (nothing changes if it does not fit), add a new request's hit blocks, take new blocks
        group by group, cache each group's full blocks."""
        B = self.block_size
        new = seq_id not in self.num_tokens
        if new:
            hits, computed = self.find_longest_cache_hit(token_ids)
            # a prefix the full group holds beyond the common hit: the sliding group keeps a hit's blocks
            # there too (vLLM's ``shared_prefix_boundary``, kv_cache_manager.py get_computed_blocks)
            self.shared_prefix_boundary[seq_id] = self._longest_hit if self._longest_hit > computed else 0
        else:
            hits, computed = tuple([] for _ in self.managers), self.num_tokens[seq_id]
        total = computed + num_new_tokens
        if total > len(token_ids):
            raise ValueError(f"{seq_id}: {total} tokens to hold but only {len(token_ids)} token ids")
        if not new:
            self.remove_skipped_blocks(seq_id, computed)
        need = sum(m.get_num_blocks_to_allocate(seq_id, total, hits[g], computed) for g, m in enumerate(self.managers))
        if need > self.pool.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {need} free blocks to hold {total} tokens, "
                                    f"{self.pool.num_free_blocks} free")
        if new:
            if self.enable_prefix_caching:
                prefix = "preempted_" if preempted else ""
                self.stats[prefix + "requests"] += 1
                self.stats[prefix + "queries"] += len(token_ids)
                self.stats[prefix + "hits"] += computed
            for g, m in enumerate(self.managers):
                m.save_new_computed_blocks(seq_id, hits[g], computed)
        fresh = [m.allocate_new_blocks(seq_id, total) for m in self.managers]
        for m in self.managers:
            table = m.req_to_blocks[seq_id]
            for i in range(computed // B, len(table)):
                if table[i] != NULL_BLOCK:
                    self.pool.fills[table[i]] = min(B, total - i * B)
        self.num_tokens[seq_id] = total
        self.token_ids[seq_id] = list(token_ids[:total])
        boundaries = (self.num_prompt_tokens[seq_id] - 1,) + ((self.shared_prefix_boundary[seq_id],)
                                                            if self.shared_prefix_boundary.get(seq_id) else ())
        for g, m in enumerate(self.managers):
            m.cache_blocks(seq_id, self.token_ids[seq_id], range(len(hits[g]) if new else computed // B, total // B),
                           replay_boundaries=boundaries)
        self._log_allocation(seq_id, new, computed, total, hits, fresh)
        return computed if new else 0

    def _log_allocation(self, seq_id, new, computed, total, hits, fresh) -> None:
        """The lab's events of one ``allocate_slots`` over groups, told for the shown group's table
        (``blocks``); ``group_blocks`` adds every group's blocks the event names (the new ones, or for a
        token written into a block with room each group's last block), in group order, so the sentence
        tells every group's blocks (``facts["groups"]``: each group's name)."""
        g = self.managers.index(self.full)
        table, B = self.block_tables[seq_id], self.block_size
        names = {"groups": [f"window {m.sliding_window}" if m.sliding_window else "full" for m in self.managers]}
        if new:
            self.log.emit(EventKind.ALLOCATE, seq_id, [b for b in table if b != NULL_BLOCK],
                          facts={"block_size": B, **names}, num_tokens=total, cached_tokens=computed,
                          group_blocks=[list(f) for f in fresh])
            if computed:
                self.log.emit(EventKind.PREFIX_HIT, seq_id, [b for b in hits[g] if b != NULL_BLOCK],
                              num_tokens=computed, readmission=False)
        elif total - computed == 1 and fresh[g]:
            self.log.emit(EventKind.NEW_BLOCK, seq_id, fresh[g], position=computed, logical_block=len(table) - 1,
                          group_blocks=[list(f) for f in fresh], facts=names)
        elif total - computed == 1:
            self.log.emit(EventKind.APPEND, seq_id, [table[-1]], position=computed,
                          group_blocks=[[m.req_to_blocks[seq_id][-1]] for m in self.managers],
                          facts={"fill": computed % B + 1, "block_size": B, **names})
        else:
            self.log.emit(EventKind.ALLOCATE, seq_id, table[computed // B:], num_tokens=total, cached_tokens=0,
                          group_blocks=[list(f) for f in fresh],
                          facts={"chunk": total - computed, "start": computed, "fresh": fresh[g], **names})

    def remove_skipped_blocks(self, seq_id: str, num_computed_tokens: int) -> list[int]:
        """Every group gives back the blocks no token after ``num_computed_tokens`` attends to (vLLM's
        ``KVCacheCoordinator.remove_skipped_blocks``); a sliding group's table holds ``NULL_BLOCK`` there.
        Each group that gave blocks back logs one LEAVE_WINDOW event. Returns the blocks given back."""
        freed_all = []
        for g, m in enumerate(self.managers):
            freed = m.remove_skipped_blocks(seq_id, num_computed_tokens)
            if freed:
                freed_all += freed
                self.log.emit(EventKind.LEAVE_WINDOW, seq_id, freed, group=g, position=num_computed_tokens,
                              facts={"window": m.sliding_window})
        return freed_all

    # ------------------------------------------------------------------------------------- KV cache groups
    def set_max_in_flight_tokens(self, max_in_flight_tokens: int, max_model_len: int) -> None:
        """Each group caps what an admission counts for it (a sliding group: vLLM's
        ``max_admission_blocks_per_request``, ``SlidingWindowManager.set_max_in_flight_tokens``)."""
        for m in self.managers:
            m.set_max_in_flight_tokens(max_in_flight_tokens, max_model_len)

    def group_block_tables(self, seq_id: str) -> tuple[list[int], ...]:
        """``seq_id``'s block table in every KV cache group, in group order (``NULL_BLOCK`` where a sliding
        group gave its block back)."""
        self._table(seq_id)
        return tuple(list(m.req_to_blocks[seq_id]) for m in self.managers)

    def slot_mappings(self, seq_id: str, start: int, end: int) -> tuple[list[int], ...]:
        """Slot ids of tokens ``start .. end-1`` in every group (token ``t`` of group ``g``: ``table_g[t //
        B] * B + t % B``). Raises ValueError if ``seq_id`` does not hold a token of the range (in a sliding
        group: one that left the window)."""
        if start > end:
            raise ValueError(f"slot_mapping range start {start} is after end {end}")
        if not 0 <= start and end <= self.num_tokens.get(seq_id, 0):
            raise ValueError(f"positions {start}..{end - 1} are not held by sequence {seq_id!r} "
                             f"({self.num_tokens.get(seq_id, 0)} tokens)")
        B, out = self.block_size, []
        for table in self.group_block_tables(seq_id):
            slots = [table[p // B] * B + p % B for p in range(start, end)]
            if any(table[p // B] == NULL_BLOCK for p in range(start, end)):
                raise ValueError(f"sequence {seq_id!r}: a position of {start}..{end - 1} left the window")
            out.append(slots)
        return tuple(out)

    def group_views(self, seq_id: str, start: int, end: int) -> tuple[tuple[list[int], ...], tuple[list[int], ...]]:
        """(block table, slot mapping of tokens ``start .. end-1``) of each KV cache group, in group order:
        what a ``SchedulerOutput`` carries for one sequence."""
        if not self.hybrid:
            return (list(self._table(seq_id)),), (self.slot_mapping(seq_id, start, end),)
        return self.group_block_tables(seq_id), self.slot_mappings(seq_id, start, end)

    def all_block_tables(self):
        """(sequence id, its table in one group without null entries) for every group's tables: each
        block reference the pool counts."""
        for m in self.managers:
            for seq_id, table in m.req_to_blocks.items():
                yield seq_id, [b for b in table if b != NULL_BLOCK]

    # ------------------------------------------------------------------------------------------- drains
    def drain_events(self) -> list:
        return self.log.drain()

    def drain_kv_events(self) -> list[dict]:
        """vLLM-schema KV cache events since the last drain, in order (one engine step's batch). Each
        BlockStored gets its group's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` (None for
        full attention), as vLLM 0.32's ``KVCacheManager.take_events`` annotates the block pool's events
        from each group's spec (vllm/v1/core/kv_cache_manager.py:209-215, 696-721)."""
        events = self.pool.drain_kv_events()
        for e in events:
            if e["type"] == "BlockStored":
                m = self.managers[e["group_idx"]]
                e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"] = m.kind, m.sliding_window
        return events

    def drain_ops(self) -> list[tuple[str, int, int]]:
        """Data movement queued since the last drain, in order: ("copy"|"swap_out"|"swap_in", src, dst)."""
        ops, self.pending_ops = self.pending_ops, []
        return ops

    def drain_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last drain (drains every queued op)."""
        return [(s, d) for kind, s, d in self.drain_ops() if kind == "copy"]
