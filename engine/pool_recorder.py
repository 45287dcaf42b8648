"""The per-step pool recorder: what a step changed in the block pool, for the step's snapshot.

A step touches a handful of blocks, so a step's snapshot records only those (a ``records.PoolDelta``)
and its cost follows what the step changed, not the pool's size (a full snapshot of a 65,536-block pool
took ~8 ms a step). The recorder wraps the pool from outside: it swaps the pool's per-block lists
(``ref_counts``, ``fills``, ``block_hashes``, and the swap space's ``fills``) for ``TrackedList``s that
note every index written, so neither the pool nor the managers know they are recorded.
"""

from __future__ import annotations

from .records import PoolDelta


class TrackedList(list):
    """A list of fixed length that adds the index of every item write to ``dirty`` (a set shared by the
    lists it tracks), so the recorder knows which blocks a step changed without scanning the pool.
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


class PoolRecorder:
    """Records ``manager``'s pool (a ``block_manager.BlockManager``: its ``pool``, ``swap``,
    ``block_tables`` and ``pool_fields``) step by step."""

    def __init__(self, manager) -> None:
        self.manager = manager
        self.dirty: set[int] = set()
        self.swap_dirty: set[int] = set()
        pool, swap = manager.pool, manager.swap
        for name in ("ref_counts", "fills", "block_hashes"):
            setattr(pool, name, TrackedList(getattr(pool, name), self.dirty))
        swap.fills = TrackedList(swap.fills, self.swap_dirty)
        self.last = None  # the snapshot built from the last fields (None: the next fields are full)
        self.resets = pool.resets

    def snapshot_fields(self) -> dict:
        """The allocator's part of a ``records.Snapshot`` for ``records.make_snapshot``: the full per-block
        lists the first time (and after a prefix-cache reset changed every block), afterwards only the
        blocks written since the previous call (a ``PoolDelta``)."""
        m, pool = self.manager, self.manager.pool
        if self.last is None or pool.resets != self.resets:
            fields = m.pool_fields()
            self.resets = pool.resets
        else:
            owners: dict[int, list[str]] = {b: [] for b in self.dirty}
            for seq_id, table in m.all_block_tables():
                for b in table:
                    if b in owners:
                        owners[b].append(seq_id)
            blocks = {b: (pool.ref_counts[b], pool.fills[b], owners[b], pool.block_hashes[b]) for b in self.dirty}
            swap = {c: m.swap.fills[c] for c in self.swap_dirty}
            fields = m.pool_fields(lists=False)
            fields["pool_delta"] = PoolDelta(self.last, blocks, swap)
        self.dirty.clear()
        self.swap_dirty.clear()
        return fields

    def snapshot_taken(self, snapshot) -> None:
        """Called with the snapshot built from the last ``snapshot_fields``: the next one is relative to it."""
        self.last = snapshot
