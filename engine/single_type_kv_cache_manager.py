"""One manager per KV cache group: the block tables of one kind of attention layer (vLLM V1's
``vllm/v1/core/single_type_kv_cache_manager.py``, vLLM 0.32).

A model whose layers all attend to every earlier token has one group, managed by ``FullAttentionManager``.
A hybrid model (some layers attend over a sliding window, some to everything) has one group per kind of
KV (``KVCacheGroupSpec``, below), all drawing from one shared ``BlockPool``, and each kind differs
only in the operations below, so a new kind of group is a new subclass:

- ``find_longest_cache_hit(block_hashes, max_num_blocks)``: the blocks of the longest cached prefix this
  kind can use (full attention: every block of the prefix, searched from the left; a sliding window: only
  the last ``ceil((window - 1) / B)`` blocks before the hit point, searched from the right, the blocks
  before them standing in as the null block);
- ``get_num_skipped_tokens(num_computed_tokens)``: tokens no later token attends to (full attention: none;
  a sliding window: those before the window);
- ``remove_skipped_blocks(request_id, num_computed_tokens)``: give back the blocks wholly made of skipped
  tokens; they become ``NULL_BLOCK`` in the request's table (vLLM's ``BlockPool.null_block``);
- ``allocate_new_blocks`` / ``free``: grow the table to hold ``num_tokens`` / give back the whole table.

The manager holds ``req_to_blocks`` (request or sequence id -> physical block ids, logical block ``i``
holding tokens ``i*B .. i*B+B-1``, ``NULL_BLOCK`` where a block left the window) and asks the shared
``BlockPool`` for blocks; it never writes a sentence or a snapshot.

A sliding window of ``W`` tokens: the token at position ``p`` attends to positions ``p - W + 1 .. p``
(``W`` tokens, itself included: transformers' ``sliding_window_overlay`` keeps ``kv_idx > q_idx - W``).
Before the step that computes position ``c``, positions ``0 .. c - W`` are attended by nobody any more
(``get_num_skipped_tokens(c) = c - W + 1``), so the first ``(c - W + 1) // B`` blocks can go.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Sequence

from .block_pool import NONE_HASH, BlockPool, prefix_hashes
from .metrics import blocks_for, blocks_left_window

NULL_BLOCK = -1  # vLLM's null block: what a table holds where a sliding window's block was given back


class SingleTypeKVCacheManager(ABC):
    """The block tables of one KV cache group over ``pool``; ``enable_caching``: full blocks enter the
    prefix cache (under this group's id, ``group_id``: the same hash in two groups is two entries).

    ``max_admission_blocks``: the most blocks an admission counts for one request in this group (vLLM's
    ``max_admission_blocks_per_request``; None: no cap, full attention holds every block to the end).
    ``sliding_window``: the tokens a layer of this group attends to (None: every earlier token).
    ``kind``: the group's ``KVCacheSpecKind`` value as vLLM's KV events carry it (``kv_cache_spec_kind``,
    vllm/v1/kv_cache_interface.py:146-156)."""

    sliding_window: int | None = None
    kind: str = "full_attention"

    def __init__(self, pool: BlockPool, enable_caching: bool = False, group_id: int = 0) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_caching = enable_caching
        self.group_id = group_id
        self.max_admission_blocks: int | None = None
        self.req_to_blocks: dict[str, list[int]] = {}

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Iterable[str], max_num_blocks: int | None = None) -> list[int]:
        """The cached blocks this group reuses for a prefix whose full blocks hash to ``block_hashes``
        (at most ``max_num_blocks`` of them; ``NULL_BLOCK`` where the group needs no block). Changes nothing."""

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Give back the blocks no token after ``num_computed_tokens`` attends to; returns them."""

    def set_max_in_flight_tokens(self, max_in_flight_tokens: int, max_model_len: int) -> None:
        """Cap what an admission counts for this group given the step's token budget; no cap by default
        (full attention holds every block to the end)."""

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token to compute (vLLM's default: none)."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[int],
                                   num_computed_tokens: int | None = None, apply_admission_cap: bool = False) -> int:
        """Free-queue blocks that holding ``num_tokens`` tokens would take (vLLM 0.32,
        single_type_kv_cache_manager.py:175-265): new blocks beyond those held (or, for a request holding
        none, beyond its cache hit ``new_computed_blocks`` and the blocks its window already skips at
        ``num_computed_tokens``, default the hit's tokens), plus the hit blocks that sit free (count 0) and
        would leave the free queue. ``apply_admission_cap``: count at most ``max_admission_blocks``."""
        need = blocks_for(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks is not None:
            need = min(need, self.max_admission_blocks)
        if request_id in self.req_to_blocks:
            return max(need - len(self.req_to_blocks[request_id]), 0)
        computed = len(new_computed_blocks) * self.block_size if num_computed_tokens is None else num_computed_tokens
        skipped = self.get_num_skipped_tokens(computed) // self.block_size
        new = max(need - max(skipped, len(new_computed_blocks)), 0)
        refs = self.pool.ref_counts
        return new + sum(b != NULL_BLOCK and refs[b] == 0 for b in new_computed_blocks[skipped:])

    def save_new_computed_blocks(self, request_id: str, blocks: list[int],
                                 num_computed_tokens: int | None = None) -> None:
        """A new request starts its table with its cache hit (vLLM's ``add_local_computed_blocks``): the hit
        blocks its window already skips at ``num_computed_tokens`` (default the hit's tokens) are the null
        block, the others are counted once more."""
        computed = len(blocks) * self.block_size if num_computed_tokens is None else num_computed_tokens
        skipped = self.get_num_skipped_tokens(computed) // self.block_size
        kept = list(blocks[skipped:])
        self.pool.touch([b for b in kept if b != NULL_BLOCK])
        self.req_to_blocks[request_id] = [NULL_BLOCK] * min(skipped, len(blocks)) + kept

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Fresh blocks from the pool's free queue so the table holds ``num_tokens`` tokens; returns them."""
        table = self.req_to_blocks.setdefault(request_id, [])
        new = [self.pool.get_new_block() for _ in range(blocks_for(num_tokens, self.block_size) - len(table))]
        table.extend(new)
        return new

    def cache_blocks(self, request_id: str, token_ids: list[int], indices: Iterable[int],
                     replay_boundaries: tuple[int, ...] = ()) -> None:
        """Register the full logical blocks ``indices`` of the request (holding ``token_ids``) in the prefix
        cache, each hash chained from the previous block's; a block already cached, or whose parent is not
        (e.g. after a swap-in), is left as it is. ``replay_boundaries``: see ``SlidingWindowManager``."""
        if not self.enable_caching:
            return
        table, B = self.req_to_blocks[request_id], self.block_size
        hashes = self.pool.block_hashes
        for i in indices:
            b = table[i]
            if hashes[b] is not None:
                continue
            parent = hashes[table[i - 1]] if i > 0 else NONE_HASH
            if parent is None:
                continue
            self.pool.cache_full_block(b, parent, token_ids[i * B:(i + 1) * B], (request_id, i), self.group_id)

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """``child_id``'s table points at every block of ``parent_id``'s (each counted once more)."""
        table = self.req_to_blocks[parent_id]
        self.pool.touch(table)
        self.req_to_blocks[child_id] = list(table)
        return list(table)

    def free(self, request_id: str) -> tuple[list[int], list[int]]:
        """Drop the request's table, tail first (vLLM: the tail blocks are evicted first). Returns (the
        table, the blocks that became free); null entries are nobody's block and are skipped."""
        table = self.req_to_blocks.pop(request_id)
        return table, self.pool.free_blocks([b for b in table[::-1] if b != NULL_BLOCK])

    def held_blocks(self, request_id: str) -> list[int]:
        """The request's blocks in this group, null entries left out."""
        return [b for b in self.req_to_blocks.get(request_id, ()) if b != NULL_BLOCK]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every layer attends to every earlier token: the whole prefix is needed and reusable, nothing is
    ever skipped (vLLM's ``FullAttentionManager.find_longest_cache_hit``: the longest run of cached blocks
    from the start; a miss ends it, as the hashes are chained)."""

    def find_longest_cache_hit(self, block_hashes: Iterable[str], max_num_blocks: int | None = None) -> list[int]:
        hits = []
        for h in block_hashes:
            if max_num_blocks is not None and len(hits) >= max_num_blocks:
                break
            b = self.pool.get_cached_block(h, self.group_id)
            if b is None:
                break
            hits.append(b)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
        return []


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Layers that attend to the last ``sliding_window`` tokens only (vLLM 0.32's ``SlidingWindowManager``,
    single_type_kv_cache_manager.py:933-1170).

    - Frees as the window passes: before each allocation the blocks wholly before the window of the next
      token go back to the pool and the table holds ``NULL_BLOCK`` there (``remove_skipped_blocks``,
      vLLM's ``_remove_blocks_in_range``: walked from the window's edge backwards, stopping at the first
      null entry, freed in that order).
    - Its prefix-cache hit rule: a prefix of ``k`` blocks is usable when its last
      ``ceil((sliding_window - 1) / B)`` blocks are cached, whatever happened to the ones before them
      (``_contiguous_blocks_for_hit``); searched from the right, the first such run wins. Without such a
      run, the cached blocks from the start are the hit (a prefix shorter than the window needs them all).
    """

    kind = "sliding_window"  # KVCacheSpecKind.SLIDING_WINDOW

    def __init__(self, pool: BlockPool, enable_caching: bool = False, group_id: int = 0,
                 sliding_window: int = 1) -> None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer, got {sliding_window!r}")
        super().__init__(pool, enable_caching, group_id)
        self.sliding_window = sliding_window

    def set_max_in_flight_tokens(self, max_in_flight_tokens: int, max_model_len: int) -> None:
        """Cap what an admission counts for this group (vLLM 0.32's
        ``SlidingWindowSpec.max_admission_blocks_per_request``, kv_cache_interface.py:859-884):
        ``ceil(min(window - 1 + max_in_flight_tokens, max_model_len) / B) + 1`` blocks, where
        ``max_in_flight_tokens`` is the step's token budget (``max_num_batched_tokens``, one batch in
        flight without async scheduling): a request never holds more in this group, as its window frees
        blocks before each chunk takes new ones."""
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        self.max_admission_blocks = blocks_for(tokens, self.block_size) + 1

    @property
    def contiguous_blocks_for_hit(self) -> int:
        """Blocks a hit needs right before its end: ``ceil((sliding_window - 1) / B)``."""
        return blocks_for(self.sliding_window - 1, self.block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[str], max_num_blocks: int | None = None) -> list[int]:
        hashes = list(block_hashes)
        n = len(hashes) if max_num_blocks is None else min(max_num_blocks, len(hashes))
        need = self.contiguous_blocks_for_hit
        computed = [NULL_BLOCK] * n
        run = 0
        for i in range(n - 1, -1, -1):  # from the right: the longest usable prefix first
            b = self.pool.get_cached_block(hashes[i], self.group_id)
            if b is None:
                run = 0
                continue
            computed[i] = b
            run += 1
            if run >= need:
                return computed[:i + run]
        return computed[:run]  # no full run: the cached blocks from the start (a prefix shorter than needed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
        table = self.req_to_blocks.get(request_id)
        if not table:
            return []
        last = min(blocks_left_window(num_computed_tokens, self.block_size, self.sliding_window), len(table))
        freed = []
        for i in range(last - 1, -1, -1):
            if table[i] == NULL_BLOCK:
                break
            freed.append(table[i])
            table[i] = NULL_BLOCK
        if freed:
            self.pool.free_blocks(freed)
        return freed

    def cache_blocks(self, request_id: str, token_ids: list[int], indices: Iterable[int],
                     replay_boundaries: tuple[int, ...] = ()) -> None:
        """Cache only the blocks a later hit can use (vLLM 0.32's ``reachable_block_mask`` under its default
        ``prefix_cache_retention_interval`` 0, single_type_kv_cache_manager.py:1054-1133): a sliding group's
        hit ending at a boundary needs just the ``contiguous_blocks_for_hit`` blocks before it, and the only
        boundaries a later request can stop at are ``replay_boundaries`` (the prompt's last token, where a
        resend of it stops: ``replay_boundaries`` in kv_cache_coordinator.py:65-86; and a prefix other
        requests share that this group had not cached, vLLM's ``shared_prefix_boundary``). Every other full
        block stays out of the cache, so it is freed as an uncached block (reused first). One "BlockStored"
        per call as vLLM's ``cache_full_blocks``: the kept blocks' hashes (possibly none), the tokens of the
        whole range, the parent the hash of the block before it (null or not)."""
        if not self.enable_caching:
            return
        table, B = self.req_to_blocks[request_id], self.block_size
        indices = list(indices)
        if not indices:
            return
        need = self.contiguous_blocks_for_hit
        keep = {i for b in replay_boundaries for i in range(max(0, b // B - need), b // B)}
        chain = [NONE_HASH, *prefix_hashes(token_ids, B, indices[-1] + 1)]
        entries = [(table[i], chain[i + 1]) for i in indices
                   if i in keep and table[i] != NULL_BLOCK and self.pool.block_hashes[table[i]] is None]
        self.pool.cache_blocks(entries, chain[indices[0]] if indices[0] > 0 else None,
                               token_ids[indices[0] * B:(indices[-1] + 1) * B], self.group_id)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group: the layers (indices into the model's decoder layers) that share one block table
    per request because they keep the same kind of KV (vLLM's ``KVCacheGroupSpec`` with a
    ``FullAttentionSpec`` or ``SlidingWindowSpec``). ``sliding_window``: None for full attention."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full_attention" if self.sliding_window is None else "sliding_window"


def group_layers(layer_windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """The KV cache groups of a model whose layer ``i`` attends over ``layer_windows[i]`` tokens (None: every
    token), as vLLM 0.32 forms them (``_get_kv_cache_groups_uniform_page_size``,
    vllm/v1/core/kv_cache_utils.py:1362-1502): layers of one kind together, in the order the kinds first
    appear; when there are several kinds, each kind is cut into groups of ``group_size`` layers (the fewest
    layers of any kind, or the most when no kind has 1.5 times the fewest), layer ``j`` of a kind going to
    its group ``j % num_groups``, so every group has the same number of layers and the same bytes per
    block (the last group of a kind may be short: vLLM pads it with layers that hold nothing).

    E.g. (48, None, 48, None) -> ((0, 2) window 48, (1, 3) full); all None -> one group of every layer.

    Raises:
        ValueError: no layers, or a window that is not a positive integer.
    """
    if not layer_windows:
        raise ValueError("a model needs at least one layer to have KV cache groups")
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"layer {i}: sliding window must be a positive integer or None, got {w!r}")
        kinds.setdefault(w, []).append(i)
    sizes = [len(layers) for layers in kinds.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for window, layers in kinds.items():
        num_groups = -(-len(layers) // group_size)
        groups += [KVCacheGroupSpec(tuple(layers[i::num_groups]), window) for i in range(num_groups)]
    return tuple(groups)


def manager_for(spec: KVCacheGroupSpec, pool: BlockPool, enable_caching: bool, group_id: int
                ) -> SingleTypeKVCacheManager:
    """The manager of a group of this kind (vLLM's ``get_manager_for_kv_cache_spec``)."""
    if spec.sliding_window is None:
        return FullAttentionManager(pool, enable_caching, group_id)
    return SlidingWindowManager(pool, enable_caching, group_id, sliding_window=spec.sliding_window)
