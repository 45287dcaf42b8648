"""A hypothesis state machine over the BlockManager alone: random interleavings of add request (with
prefix reuse), append, fork, free, preempt, swap out and swap in, with random block and pool sizes.
After every operation the pool's invariants must hold; at the end every block is free again."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine import BlockManager, NoFreeBlocksError

# a small alphabet makes identical prefixes (prefix-cache hits) frequent
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), swap=st.integers(0, 8))
    def setup(self, num_blocks, block_size, swap):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True, num_swap_blocks=swap)
        self.n = 0
        self.swapped: list[str] = []

    def running(self) -> list[str]:
        return sorted(self.bm.block_tables)

    @rule(ids=tokens)
    def add_request(self, ids):
        seq = f"s{self.n}"
        self.n += 1
        before = self.bm.num_free_blocks
        try:
            table, cached = self.bm.allocate_with_prefix(seq, len(ids), ids)
        except NoFreeBlocksError:
            assert self.bm.num_free_blocks == before  # nothing taken
            return
        assert cached % self.bm.block_size == 0 and cached < len(ids)  # the last token is always computed
        assert len(table) == -(-len(ids) // self.bm.block_size)

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 2))
    def append(self, pick, token):
        seq = self.running()[pick % len(self.running())]
        try:
            self.bm.append_slot(seq, token)
        except NoFreeBlocksError:
            return
        written = self.bm.block_tables[seq][-1]
        assert self.bm.ref_counts[written] == 1  # a block is written only by its sole owner

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        parent = self.running()[pick % len(self.running())]
        self.bm.fork(parent, f"s{self.n}")
        self.n += 1

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99))
    def free_or_preempt(self, pick):
        self.bm.free(self.running()[pick % len(self.running())])

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99))
    def swap_out(self, pick):
        seq = self.running()[pick % len(self.running())]
        if self.bm.can_swap_out([seq]):
            self.bm.swap_out([seq])
            self.swapped.append(seq)
        else:
            free_swap = self.bm.num_free_swap_blocks
            try:
                self.bm.swap_out([seq])
            except NoFreeBlocksError:
                assert self.bm.num_free_swap_blocks == free_swap
            else:
                raise AssertionError("swap_out must refuse when the swap pool is too small")

    @precondition(lambda self: self.swapped)
    @rule(pick=st.integers(0, 99))
    def swap_in(self, pick):
        seq = self.swapped[pick % len(self.swapped)]
        if self.bm.can_swap_in([seq]):
            self.bm.swap_in([seq])
            self.swapped.remove(seq)

    @precondition(lambda self: self.swapped)
    @rule(pick=st.integers(0, 99))
    def drop_swapped(self, pick):
        seq = self.swapped.pop(pick % len(self.swapped))
        self.bm.free(seq)

    @invariant()
    def pool_is_consistent(self):
        bm = self.bm
        counts = [0] * bm.num_blocks
        for table in bm.block_tables.values():
            for b in table:
                counts[b] += 1
        assert bm.ref_counts == counts
        free = set(bm.free_block_queue)
        in_use = {b for b in range(bm.num_blocks) if counts[b] > 0}
        assert not free & in_use
        assert len(free) + len(in_use) == bm.num_blocks
        for h, b in bm.cached_blocks.items():
            assert bm.block_hashes[b] == h  # a cached hash always finds the block that holds it
        swap_counts = [0] * bm.num_swap_blocks
        for table in bm.swap_tables.values():
            for c in table:
                swap_counts[c] += 1
        assert bm.swap_ref_counts == swap_counts
        assert sorted(bm.swap_free) == [c for c in range(bm.num_swap_blocks) if swap_counts[c] == 0]

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.bm.block_tables) + list(self.bm.swap_tables):
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks  # no leak
        assert self.bm.num_free_swap_blocks == self.bm.num_swap_blocks


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
