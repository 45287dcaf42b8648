"""The block manager: which physical KV blocks each sequence owns (PagedAttention, Kwon et al., SOSP 2023).

It decides *what* to allocate; the bytes live in ``engine.kv_cache.KVCache``. It needs no model, so the
lessons drive it directly.

State, kept in plain lists and dicts (nano-vllm style):
- ``free_block_queue``: free physical block ids. Allocation takes from the front, freed blocks go to the
  back (vLLM's free block queue), so a fresh manager hands out 0, 1, 2, ... in order.
- ``ref_counts[b]``: how many block tables point at block ``b``. A block is free exactly when it is 0.
- ``fills[b]``: tokens held in block ``b`` (0..block_size).
- ``block_tables[seq]``: logical block ``i`` of ``seq`` (tokens ``i*B .. i*B+B-1``) -> physical block id.
- ``num_tokens[seq]``: tokens whose K/V slots ``seq`` holds.

Token ``t`` of a sequence lives in logical block ``t // B`` at offset ``t % B``; its slot id is
``block_table[t // B] * B + t % B``, which indexes the flattened pool ``[num_blocks * B, ...]``.

Sharing: ``fork`` makes a second table point at the same blocks (counts rise). Writing into a shared,
partly filled block first copies it to a fresh block (copy-on-write); the copy is queued in
``pending_copies`` so the owner of the KV tensors can copy the data before the write.

Every decision is appended to ``events`` (``engine.records.Event``); the engine drains them each step.
"""

from __future__ import annotations

from collections import deque

from .records import Event


class NoFreeBlocksError(RuntimeError):
    """Raised when an operation needs a free block and the pool has none; nothing was changed."""


class BlockManager:
    """Paged allocation of ``num_blocks`` blocks of ``block_size`` token slots.

    Args:
        num_blocks: physical blocks in the pool (>= 1).
        block_size: token slots per block (>= 1).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` is not a positive integer.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_queue: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.fills = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.events: list[Event] = []

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def needs_new_block(self, seq_id: str) -> bool:
        """True if appending one token to ``seq_id`` needs a fresh block (last block full, or shared: CoW)."""
        table = self._table(seq_id)
        n = self.num_tokens[seq_id]
        if n % self.block_size == 0:
            return True
        return self.ref_counts[table[-1]] > 1

    def can_append(self, seq_id: str) -> bool:
        return not self.needs_new_block(seq_id) or self.num_free_blocks > 0

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
        """Slot ids of tokens ``start .. end-1`` of ``seq_id``."""
        return [self.slot(seq_id, p) for p in range(start, end)]

    # ----------------------------------------------------------------------------------------- changes
    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens (prefill).

        Takes ceil(num_tokens / B) blocks from the free queue; the last one may be partly filled.

        Returns:
            the sequence's block table.

        Raises:
            ValueError: ``seq_id`` already holds blocks, or ``num_tokens`` < 1.
            NoFreeBlocksError: fewer free blocks than needed (nothing is taken).
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks {self.block_tables[seq_id]}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        need = self.blocks_needed(num_tokens)
        if need > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {need} blocks for {num_tokens} tokens, {self.num_free_blocks} free"
            )
        table = [self._take_block() for _ in range(need)]
        for i, b in enumerate(table):
            self.fills[b] = min(self.block_size, num_tokens - i * self.block_size)
        self.block_tables[seq_id] = table
        self.num_tokens[seq_id] = num_tokens
        self.events.append(Event(
            "allocate", seq_id, list(table),
            f"{seq_id}: {num_tokens} tokens take {need} block{'s' * (need != 1)} {table}"
            f" (last block holds {self.fills[table[-1]]}/{self.block_size})",
            {"num_tokens": num_tokens},
        ))
        return list(table)

    def append_slot(self, seq_id: str) -> int:
        """Reserve the slot for one more token of ``seq_id`` (decode) and return its slot id.

        - last block has room and reference count 1: write in place;
        - last block full (or no block yet): take a fresh block;
        - last block has room but is shared (count > 1): copy-on-write, i.e. take a fresh block, queue the
          copy (source, destination) in ``pending_copies``, point this table at the copy, decrement the
          source's count. Full blocks are never copied.

        Raises:
            KeyError: unknown ``seq_id``.
            NoFreeBlocksError: a fresh block is needed and none is free (nothing is changed).
        """
        table = self._table(seq_id)
        n = self.num_tokens[seq_id]
        offset = n % self.block_size
        if offset == 0:
            if not self.free_block_queue:
                raise NoFreeBlocksError(f"sequence {seq_id!r} needs a new block for token {n}, none free")
            b = self._take_block()
            table.append(b)
            self.events.append(Event(
                "new_block", seq_id, [b],
                f"{seq_id}: token {n} starts logical block {len(table) - 1}, takes block {b}",
                {"position": n, "logical_block": len(table) - 1},
            ))
        elif self.ref_counts[table[-1]] > 1:
            if not self.free_block_queue:
                raise NoFreeBlocksError(f"sequence {seq_id!r} must copy shared block {table[-1]}, none free")
            src = table[-1]
            dst = self._take_block()
            self.ref_counts[src] -= 1
            self.fills[dst] = self.fills[src]
            table[-1] = dst
            self.pending_copies.append((src, dst))
            self.events.append(Event(
                "cow", seq_id, [src, dst],
                f"{seq_id}: block {src} is shared (count {self.ref_counts[src] + 1}) and partly filled, "
                f"so it is copied to block {dst} before writing",
                {"src": src, "dst": dst},
            ))
        else:
            self.events.append(Event(
                "append", seq_id, [table[-1]],
                f"{seq_id}: token {n} written into block {table[-1]} ({offset + 1}/{self.block_size})",
                {"position": n},
            ))
        b = table[-1]
        self.fills[b] = offset + 1
        self.num_tokens[seq_id] = n + 1
        return b * self.block_size + offset

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Make ``child_id`` share every block of ``parent_id`` (reference counts rise by one).

        Raises:
            KeyError: unknown parent. ValueError: the child already holds blocks.
        """
        table = self._table(parent_id)
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already holds blocks {self.block_tables[child_id]}")
        for b in table:
            self.ref_counts[b] += 1
        self.block_tables[child_id] = list(table)
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        self.events.append(Event("fork", child_id, list(table),
                                 f"{child_id} forked from {parent_id}: shares blocks {table}",
                                 {"parent": parent_id}))
        return list(table)

    def free(self, seq_id: str) -> list[int]:
        """Release ``seq_id``'s blocks: every count drops by one; blocks reaching 0 return to the free queue.

        Returns:
            the blocks that became free (shared blocks still in use elsewhere are not among them).

        Raises:
            KeyError: unknown ``seq_id``.
        """
        table = self._table(seq_id)
        freed = []
        for b in reversed(table):  # tail first, as vLLM does, so the prefix stays cached longest
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.fills[b] = 0
                self.free_block_queue.append(b)
                freed.append(b)
        del self.block_tables[seq_id]
        del self.num_tokens[seq_id]
        kept = [b for b in table if b not in freed]
        msg = f"{seq_id}: released {len(table)} blocks, {len(freed)} free again {sorted(freed)}"
        if kept:
            msg += f", {len(kept)} still shared {kept}"
        self.events.append(Event("free", seq_id, sorted(freed), msg, {"released": list(table)}))
        return sorted(freed)

    def drain_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def drain_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

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
        b = self.free_block_queue.popleft()
        self.ref_counts[b] = 1
        self.fills[b] = 0
        return b
