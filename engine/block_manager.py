"""The block manager: the paged allocator the engine and the lessons hold (PagedAttention, Kwon et al.,
SOSP 2023), assembled from vLLM V1's parts, each in its own module:

- ``engine.block_pool.BlockPool``: the physical blocks, their reference counts and fills, the free block
  queue, the cached-block map (hash -> blocks) and vLLM's KV cache events;
- ``engine.kv_cache_manager.KVCacheManager`` (this class's base): per-sequence block tables through one
  ``SingleTypeKVCacheManager`` per KV cache group, prefix matching, fork and copy-on-write, vLLM V1's
  ``allocate_slots``;
- ``engine.swap_space.SwapSpace``: the CPU swap pool of swapped-out sequences;
- ``engine.pool_recorder.PoolRecorder``: what each step changed, for the step's snapshot;
- ``engine.narration``: the sentences, written from the typed events.

This class adds what belongs to the paper's engine (vLLM V0) and to the allocator protocol
(``engine.allocator.KVAllocator``, which the contiguous baseline also implements): admission with a
watermark, swapping, the snapshot fields, and the pool's state under the names the lessons read
(``ref_counts``, ``fills``, ``free_block_queue``, ``block_hashes``, ``cached_blocks``, ``swap_tables``, ...).

Token ``t`` of a sequence lives in logical block ``t // B`` at offset ``t % B``; its slot id is
``block_table[t // B] * B + t % B``, which indexes the flattened pool ``[num_blocks * B, ...]``.

Watermark (vLLM v0's ``BlockSpaceManager``): admission and swap-in keep ``watermark_blocks`` free
(``watermark`` x ``num_blocks``, rounded down), so a request just admitted is not preempted at its first
decode steps. It is waived when no sequence holds blocks, so a lone request that fits the pool always
runs. A swap-in also needs one free block per sequence for its next token.

Swapping: ``swap_out`` moves a set of sequences' blocks to the CPU swap pool (their GPU blocks are
released) and ``swap_in`` brings them back into fresh GPU blocks, preserving sharing inside the set; the
copies are queued in ``pending_ops`` ("swap_out": GPU->CPU, "swap_in": CPU->GPU) with the copy-on-write
copies ("copy"), to be executed in order before the next forward pass.
"""

from __future__ import annotations

from .block_pool import NONE_HASH, BlockPool, NoFreeBlocksError, block_hash  # noqa: F401  (the engine's names)
from .kv_cache_manager import KVCacheManager
from .narration import _n
from .pool_recorder import PoolRecorder, TrackedList  # noqa: F401
from .records import EventKind, EventLog
from .swap_space import SwapSpace


def _pool_attr(name: str, owner: str = "pool", doc: str = "") -> property:
    return property(lambda self: getattr(getattr(self, owner), name), doc=doc or f"``{owner}.{name}``")


class BlockManager(KVCacheManager):
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
        groups: the model's KV cache groups (``KVCacheManager``); None: one full-attention group.

    Raises:
        ValueError: a size is not a positive integer (``num_swap_blocks`` may be 0), or a bad watermark.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 num_swap_blocks: int = 0, watermark: float = 0.0, event_log: EventLog | None = None,
                 evict_uncached_first: bool = False, groups=None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(num_swap_blocks, bool) or not isinstance(num_swap_blocks, int) or num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be an integer >= 0, got {num_swap_blocks!r}")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a number in [0, 1), got {watermark!r}")
        super().__init__(num_blocks, block_size, enable_prefix_caching, event_log, evict_uncached_first,
                         groups=groups)
        self.num_blocks = num_blocks
        self.evict_uncached_first = evict_uncached_first
        self.watermark_blocks = int(watermark * num_blocks)
        self.num_swap_blocks = num_swap_blocks
        self.swap = SwapSpace(num_swap_blocks)
        self.recorder = PoolRecorder(self)

    # the pool's and the swap space's state, under the names the engine has always shown
    ref_counts = _pool_attr("ref_counts")
    fills = _pool_attr("fills")
    block_hashes = _pool_attr("block_hashes")
    cached_blocks = _pool_attr("cached_blocks")
    free_block_queue = _pool_attr("free_block_queue")
    kv_events = _pool_attr("kv_events")
    peak_used_blocks = _pool_attr("peak_used_blocks", doc="most blocks in use at any moment, also within a step")
    num_free_blocks = _pool_attr("num_free_blocks")
    num_used_blocks = _pool_attr("num_used_blocks")
    swap_free = _pool_attr("free", "swap")
    swap_ref_counts = _pool_attr("ref_counts", "swap")
    swap_fills = _pool_attr("fills", "swap")
    swap_tables = _pool_attr("tables", "swap")
    swap_num_tokens = _pool_attr("num_tokens", "swap")
    num_free_swap_blocks = _pool_attr("num_free_blocks", "swap")

    max_seqs_per_request = None  # any number of samples / beams share blocks

    @property
    def events(self) -> list:
        """Events logged and not yet drained."""
        return self.log.events

    def _holds(self, seq_id: str) -> bool:
        return seq_id in self.block_tables or seq_id in self.swap.tables

    # ----------------------------------------------------------------------------------------- queries
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

    def table_of(self, seq_id: str) -> tuple[list[int], int] | None:
        """(block table, tokens held) of ``seq_id``: its GPU table, or its CPU swap-pool table while swapped
        out; None if it holds nothing."""
        if seq_id in self.block_tables:
            return self.block_tables[seq_id], self.num_tokens[seq_id]
        if seq_id in self.swap.tables:
            return self.swap.tables[seq_id], self.swap.num_tokens[seq_id]
        return None

    def attention_view(self, seq_id: str) -> tuple[list[int], int]:
        """What attention needs to read ``seq_id``'s K/V: (block table, 0)."""
        return self._table(seq_id), 0

    def reservation_for(self, prompt_len: int, max_len: int, final_len: int | None = None) -> None:
        """Paging reserves nothing ahead: blocks are taken as tokens arrive."""
        return None

    def owners(self) -> list[list[str]]:
        """For each physical block, the sequences whose tables point at it."""
        owners: list[list[str]] = [[] for _ in range(self.num_blocks)]
        for seq_id, table in self.all_block_tables():
            for b in table:
                owners[b].append(seq_id)
        return owners

    def invariant_violations(self) -> list[str]:
        """Broken invariants (empty when consistent): counts equal table references, free exactly at count
        0, and the prefix cache both ways (``BlockPool.invariant_violations``)."""
        return self.pool.invariant_violations(table for _, table in self.all_block_tables())

    # ---------------------------------------------------------------------------------------- snapshots
    def snapshot_fields(self) -> dict:
        """The allocator's part of a ``records.Snapshot``: full lists first, then only what each step
        changed (``PoolRecorder.snapshot_fields``)."""
        return self.recorder.snapshot_fields()

    def snapshot_taken(self, snapshot) -> None:
        """Called with the snapshot built from the last ``snapshot_fields``: the next one is relative to it."""
        self.recorder.snapshot_taken(snapshot)

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
    def free(self, seq_id: str, final_len: int | None = None) -> list[int]:
        """Release ``seq_id``'s blocks (``KVCacheManager.free``); a swapped-out sequence releases its swap
        blocks instead (and returns [])."""
        if seq_id in self.swap.tables:
            self._release_swap(seq_id)
            self.token_ids.pop(seq_id, None)
            return []
        return super().free(seq_id, final_len)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (``BlockPool.reset_prefix_cache``): refused, returning False and changing
        nothing, while any block is in use."""
        return self.pool.reset_prefix_cache()

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
            mapping[b] = c = self.swap.take(self.fills[b])
            self.pending_ops.append(("swap_out", b, c))
        for s in seq_ids:
            table = self.block_tables.pop(s)
            self.swap.hold(s, [mapping[b] for b in table], self.num_tokens.pop(s))
            for b in reversed(table):
                self.pool.release(b)
        pairs = list(mapping.items())
        self._swap_event(EventKind.SWAP_OUT, request_id or seq_ids[0], seq_ids, pairs, [g for g, _ in pairs])
        return pairs

    def can_swap_in(self, seq_ids: list[str]) -> bool:
        """Room to swap these sequences back in and let each write its next token, keeping the watermark
        free (vLLM v0's ``can_swap_in``: the held blocks + one per sequence + the watermark)."""
        distinct = self.swap.distinct_blocks(seq_ids)
        # into an empty pool a request always fits: it fits the pool on its own at its longest
        headroom = len(seq_ids) + self._watermark() if self.num_used_blocks else 0
        return len(distinct) + headroom <= self.num_free_blocks

    def swap_in(self, seq_ids: list[str], request_id: str | None = None) -> list[tuple[int, int]]:
        """Bring swapped sequences back into fresh GPU blocks. Returns the (cpu, gpu) pairs, also queued as
        "swap_in" ops. Raises NoFreeBlocksError if the GPU pool is too small (nothing is changed)."""
        distinct = self.swap.distinct_blocks(seq_ids)
        if len(distinct) > self.num_free_blocks:
            raise NoFreeBlocksError(f"swap-in of {seq_ids} needs {len(distinct)} blocks, {self.num_free_blocks} free")
        mapping = {}
        for c in distinct:
            b = self.pool.get_new_block()
            self.ref_counts[b] = 0  # counted below, once per table entry (sharing inside the set is kept)
            mapping[c] = b
            self.fills[b] = self.swap_fills[c]
            self.pending_ops.append(("swap_in", c, b))
        for s in seq_ids:
            self.block_tables[s] = [mapping[c] for c in self.swap.tables[s]]
            for b in self.block_tables[s]:
                self.ref_counts[b] += 1
            self.num_tokens[s] = self.swap.num_tokens[s]
            self.swap.release(s)
        pairs = list(mapping.items())
        self._swap_event(EventKind.SWAP_IN, request_id or seq_ids[0], seq_ids, pairs, [g for _, g in pairs])
        return pairs

    def _swap_event(self, kind: EventKind, request_id: str, seq_ids: list[str], pairs, gpu_blocks: list[int]) -> None:
        self.log.emit(kind, request_id, gpu_blocks, pairs=[list(p) for p in pairs], seqs=list(seq_ids))

    def _distinct_blocks(self, seq_ids: list[str]) -> list[int]:
        return list(dict.fromkeys(b for s in seq_ids for b in self._table(s)))

    def _release_swap(self, seq_id: str) -> None:
        self.swap.release(seq_id)
        self.log.emit(EventKind.FREE, seq_id, [])


def refusal(need: int, keep: int, free: int) -> str:
    """Why a request waits at the door: "needs 3 free blocks + 1 kept free (watermark), 2 free"."""
    also = f" + {keep} kept free (watermark)" if keep else ""
    return f"needs {_n(need, 'free block')}{also}, {free} free"
