"""The CPU swap space: where a preempted request's KV blocks wait while its GPU blocks serve others (the
paper's swapping, Kwon et al., SOSP 2023, section 4.5; vLLM V0's ``BlockSpaceManager`` swap pool).

It holds CPU blocks and the swapped sequences' tables over them; the GPU side (``engine.block_manager``)
decides when to swap and moves the tables. Sharing inside a swapped request is kept: one CPU block per
distinct GPU block, counted once per table pointing at it.

State (plain lists and dicts, indexed by CPU block id): ``free`` (free CPU block ids, taken from the
front), ``ref_counts``, ``fills`` (tokens held), ``tables[seq]`` (logical block -> CPU block),
``num_tokens[seq]``.
"""

from __future__ import annotations


class SwapSpace:
    """``num_blocks`` CPU blocks (0: no swapping)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.fills: list[int] = [0] * num_blocks
        self.tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def take(self, fill: int) -> int:
        """A free CPU block that will hold ``fill`` tokens (the caller checks one is free)."""
        c = self.free.pop(0)
        self.fills[c] = fill
        return c

    def hold(self, seq_id: str, table: list[int], num_tokens: int) -> None:
        """``seq_id`` is swapped out: its table over CPU blocks (each counted once more)."""
        self.tables[seq_id] = table
        for c in table:
            self.ref_counts[c] += 1
        self.num_tokens[seq_id] = num_tokens

    def distinct_blocks(self, seq_ids: list[str]) -> list[int]:
        """The CPU blocks these swapped sequences point at, each once, in table order."""
        return list(dict.fromkeys(c for s in seq_ids for c in self.tables[s]))

    def release(self, seq_id: str) -> tuple[list[int], int]:
        """Drop ``seq_id``'s table; CPU blocks no table points at any more are free again. Returns the
        (table, tokens held) it had."""
        table = self.tables.pop(seq_id)
        for c in table:
            self.ref_counts[c] -= 1
            if self.ref_counts[c] == 0:
                self.fills[c] = 0
                self.free.append(c)
        return table, self.num_tokens.pop(seq_id, 0)
