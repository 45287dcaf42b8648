"""A hypothesis state machine over the BlockManager alone: random interleavings of add request (with
prefix reuse, with or without token ids, under a new or a reused sequence id), append, fork, free, preempt,
swap out and swap in, reset of the prefix cache, with random block and pool sizes. After every operation
the pool's invariants must hold (``BlockManager.invariant_violations``: counts, the free queue, the prefix
cache both ways); the machine also keeps its own copy of what each physical block holds, so a prefix-cache
hit on a block holding other tokens (a poisoned cache) fails at once; at the end every block is free."""

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
        self.gone: list[str] = []  # ids of freed sequences, which a new sequence may take again
        # what each block really holds (the machine's own model of the KV data), GPU and CPU
        self.content: dict[int, list] = {}
        self.swap_content: dict[int, list] = {}
        self.seq_tokens: dict[str, list] = {}  # tokens of live sequences allocated with token ids

    def running(self) -> list[str]:
        return sorted(self.bm.block_tables)

    def _move_data(self):
        """Apply the data movement the manager queued, as the KV tensors would."""
        for kind, src, dst in self.bm.drain_ops():
            if kind == "copy":
                self.content[dst] = list(self.content[src])
            elif kind == "swap_out":
                self.swap_content[dst] = list(self.content[src])
            else:
                self.content[dst] = list(self.swap_content[src])

    @rule(ids=tokens, with_ids=st.booleans(), reuse=st.integers(0, 99))
    def add_request(self, ids, with_ids, reuse):
        if self.gone and reuse < 30:
            seq = self.gone.pop(reuse % len(self.gone))
        else:
            seq = f"s{self.n}"
            self.n += 1
        before = self.bm.num_free_blocks
        try:
            table, cached = self.bm.allocate_with_prefix(seq, len(ids), ids if with_ids else None)
        except NoFreeBlocksError:
            assert self.bm.num_free_blocks == before  # nothing taken
            self.gone.append(seq)
            return
        assert cached % self.bm.block_size == 0 and cached < len(ids)  # the last token is always computed
        assert len(table) == -(-len(ids) // self.bm.block_size)
        B = self.bm.block_size
        # without ids the tokens are unknown to the manager: the model writes markers no prompt can match
        written = list(ids) if with_ids else [("?", seq, i) for i in range(len(ids))]
        if with_ids:
            self.seq_tokens[seq] = list(ids)
        for i, b in enumerate(table):
            if i < cached // B:
                assert self.content[b] == written[i * B:(i + 1) * B], "prefix-cache hit on other tokens"
            else:
                self.content[b] = written[i * B:(i + 1) * B]

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 2))
    def append(self, pick, token):
        seq = self.running()[pick % len(self.running())]
        try:
            self.bm.append_slot(seq, token)
        except NoFreeBlocksError:
            return
        self._move_data()
        written = self.bm.block_tables[seq][-1]
        assert self.bm.ref_counts[written] == 1  # a block is written only by its sole owner
        if seq in self.seq_tokens:
            self.seq_tokens[seq].append(token)
        n = self.bm.num_tokens[seq]
        self.content[written] = self.content.get(written, [])[: (n - 1) % self.bm.block_size] + [token]

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        parent = self.running()[pick % len(self.running())]
        self.bm.fork(parent, f"s{self.n}")
        if parent in self.seq_tokens:
            self.seq_tokens[f"s{self.n}"] = list(self.seq_tokens[parent])
        self.n += 1

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99))
    def free_or_preempt(self, pick):
        seq = self.running()[pick % len(self.running())]
        self.bm.free(seq)
        self.seq_tokens.pop(seq, None)
        self.gone.append(seq)

    @precondition(lambda self: self.bm.block_tables)
    @rule(pick=st.integers(0, 99))
    def swap_out(self, pick):
        seq = self.running()[pick % len(self.running())]
        if self.bm.can_swap_out([seq]):
            self.bm.swap_out([seq])
            self._move_data()
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
            self._move_data()
            self.swapped.remove(seq)

    @precondition(lambda self: self.swapped)
    @rule(pick=st.integers(0, 99))
    def drop_swapped(self, pick):
        seq = self.swapped.pop(pick % len(self.swapped))
        self.bm.free(seq)
        self.seq_tokens.pop(seq, None)
        self.gone.append(seq)

    @rule()
    def reset_prefix_cache(self):
        in_use = self.bm.num_used_blocks
        assert self.bm.reset_prefix_cache() == (in_use == 0)
        if in_use == 0:  # afterwards no free block has a hash, and no old prefix can hit
            assert self.bm.block_hashes == [None] * self.bm.num_blocks and not self.bm.cached_blocks
            assert self.bm.num_free_blocks == self.bm.num_blocks

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
        assert bm.invariant_violations() == []  # includes: the prefix cache is consistent both ways
        # the tokens the manager hashes blocks from are exactly the live sequences' own: none left over from
        # a freed sequence whose id was taken again (that poisons the prefix cache)
        assert bm.token_ids == self.seq_tokens
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
