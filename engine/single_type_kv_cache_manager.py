"""One manager per KV cache group: the block tables of one kind of attention layer (vLLM V1's
``vllm/v1/core/single_type_kv_cache_manager.py``).

A model whose layers all attend to every earlier token has one group, managed by ``FullAttentionManager``.
A hybrid model (some layers attend over a sliding window, some are Mamba) has one group per kind, and
each kind differs only in the four operations below, so a new kind of group is a new subclass:

- ``find_longest_cache_hit(block_hashes)``: the blocks of the longest cached prefix this kind can use
  (full attention: every block of the prefix; a sliding window only needs the last window's blocks);
- ``allocate_new_blocks(request_id, num_tokens)``: grow the request's table to hold ``num_tokens``;
- ``remove_skipped_blocks(request_id, num_computed_tokens)``: give back blocks no later token attends
  to (full attention: none; a sliding window: those wholly before the window);
- ``free(request_id)``: give back the request's whole table.

The manager holds ``req_to_blocks`` (request or sequence id -> physical block ids, logical block ``i``
holding tokens ``i*B .. i*B+B-1``) and asks the shared ``BlockPool`` for blocks; it never writes a
sentence or a snapshot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterable

from .block_pool import NONE_HASH, BlockPool
from .metrics import blocks_for


class SingleTypeKVCacheManager(ABC):
    """The block tables of one KV cache group over ``pool``; ``enable_caching``: full blocks enter the
    prefix cache."""

    def __init__(self, pool: BlockPool, enable_caching: bool = False) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[int]] = {}

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Iterable[str]) -> list[int]:
        """The cached blocks this group reuses for a prefix whose full blocks hash to ``block_hashes``
        (read lazily, in order: a lookup stops at the first miss). Changes nothing."""

    @abstractmethod
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Give back the blocks no token after ``num_computed_tokens`` attends to; returns them."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: list[int]) -> int:
        """Free-queue blocks that holding ``num_tokens`` tokens would take: new blocks beyond those held
        (or, for a request holding none, beyond its cache hit ``new_computed_blocks``), plus the hit blocks
        that sit free (count 0) and would leave the free queue."""
        need = blocks_for(num_tokens, self.block_size)
        if request_id in self.req_to_blocks:
            return max(need - len(self.req_to_blocks[request_id]), 0)
        return need - len(new_computed_blocks) + sum(self.pool.ref_counts[b] == 0 for b in new_computed_blocks)

    def save_new_computed_blocks(self, request_id: str, blocks: list[int]) -> None:
        """A new request starts its table with its cache hit (each block counted once more)."""
        self.pool.touch(blocks)
        self.req_to_blocks[request_id] = list(blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Fresh blocks from the pool's free queue so the table holds ``num_tokens`` tokens; returns them."""
        table = self.req_to_blocks.setdefault(request_id, [])
        new = [self.pool.get_new_block() for _ in range(blocks_for(num_tokens, self.block_size) - len(table))]
        table.extend(new)
        return new

    def cache_blocks(self, request_id: str, token_ids: list[int], indices: Iterable[int]) -> None:
        """Register the full logical blocks ``indices`` of the request (holding ``token_ids``) in the prefix
        cache, each hash chained from the previous block's; a block already cached, or whose parent is not
        (e.g. after a swap-in), is left as it is."""
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
            self.pool.cache_full_block(b, parent, token_ids[i * B:(i + 1) * B], (request_id, i))

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """``child_id``'s table points at every block of ``parent_id``'s (each counted once more)."""
        table = self.req_to_blocks[parent_id]
        self.pool.touch(table)
        self.req_to_blocks[child_id] = list(table)
        return list(table)

    def free(self, request_id: str) -> tuple[list[int], list[int]]:
        """Drop the request's table, tail first (vLLM: the tail blocks are evicted first). Returns (the
        table, the blocks that became free)."""
        table = self.req_to_blocks.pop(request_id)
        return table, self.pool.free_blocks(table[::-1])


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every layer attends to every earlier token: the whole prefix is needed and reusable, nothing is
    ever skipped."""

    def find_longest_cache_hit(self, block_hashes: Iterable[str]) -> list[int]:
        hits = []
        for h in block_hashes:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
        return []
