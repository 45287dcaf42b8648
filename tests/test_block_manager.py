"""BlockManager alone (no model): the lesson practice of LESSON_BRIEF section 5, errors, and invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import BlockManager, NoFreeBlocksError
def practice(prompt_len: int) -> BlockManager:
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("A", prompt_len)
    bm.fork("A", "B")
    return bm


def test_fork_shares_blocks_and_raises_counts():
    bm = practice(6)
    assert bm.block_tables == {"A": [0, 1], "B": [0, 1]}
    assert bm.ref_counts[:2] == [2, 2]
    assert bm.fills[:2] == [4, 2]


def test_first_writer_copies_shared_partial_block_second_writes_in_place():
    bm = practice(6)
    slot = bm.append_slot("A")
    assert bm.block_tables == {"A": [0, 2], "B": [0, 1]}
    assert bm.ref_counts[:3] == [2, 1, 1]
    assert bm.drain_copies() == [(1, 2)]
    assert slot == 2 * 4 + 2  # block 2, offset 2
    assert bm.fills[2] == 3 and bm.fills[1] == 2

    bm.append_slot("B")  # block 1 now has count 1: written in place
    assert bm.block_tables == {"A": [0, 2], "B": [0, 1]}
    assert bm.ref_counts[:3] == [2, 1, 1]
    assert bm.drain_copies() == []
    assert bm.num_used_blocks == 3  # 3 blocks hold what two copies would store in 4
    kinds = [e.kind for e in bm.drain_events()]
    assert kinds == ["allocate", "fork", "cow", "append"]


def test_full_last_block_is_never_copied():
    bm = practice(8)
    bm.append_slot("A")
    assert bm.block_tables["A"] == [0, 1, 2]
    assert bm.ref_counts[:3] == [2, 2, 1]
    assert bm.drain_copies() == []


def test_three_samples_copy_twice():
    bm = practice(6)
    bm.fork("A", "C")
    for s in ("A", "B", "C"):
        bm.append_slot(s)
    # A copies (count 3), B copies (count 2), C writes in place (count 1).
    assert len(bm.drain_copies()) == 2
    assert bm.ref_counts[:4] == [3, 1, 1, 1]


def test_release_frees_only_blocks_reaching_zero():
    bm = practice(6)
    bm.append_slot("A")
    bm.append_slot("B")
    freed = bm.free("A")
    assert freed == [2]  # block 0 is still B's
    assert bm.ref_counts[:3] == [1, 1, 0]
    assert bm.free("B") == [0, 1]
    assert bm.num_free_blocks == 8


def test_no_free_block_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("A", 8)
    before = (dict(bm.block_tables), list(bm.ref_counts), list(bm.fills), dict(bm.num_tokens))
    with pytest.raises(NoFreeBlocksError):
        bm.append_slot("A")
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("B", 1)
    assert (dict(bm.block_tables), list(bm.ref_counts), list(bm.fills), dict(bm.num_tokens)) == before


@pytest.mark.parametrize("kwargs, named", [({"num_blocks": 0, "block_size": 4}, "num_blocks .* 0"),
                                           ({"num_blocks": 4, "block_size": -1}, "block_size .* -1"),
                                           ({"num_blocks": 2.5, "block_size": 4}, "num_blocks .* 2.5")])
def test_bad_sizes_name_the_value(kwargs, named):
    with pytest.raises(ValueError, match=named):
        BlockManager(**kwargs)


def test_slot_of_unheld_position_is_an_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("A", 5)
    assert bm.slot("A", 4) == 1 * 4 + 0
    with pytest.raises(ValueError, match="position 5"):
        bm.slot("A", 5)


ops = st.lists(
    st.tuples(st.sampled_from(["allocate", "append", "fork", "free"]), st.integers(0, 5), st.integers(1, 20)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.integers(1, 5), ops=ops)
def test_invariants_hold_under_any_operation_sequence(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    n = 0
    for op, pick, size in ops:
        seqs = sorted(bm.block_tables)
        try:
            if op == "allocate":
                bm.allocate(f"s{n}", size)
                n += 1
            elif seqs and op == "append":
                bm.append_slot(seqs[pick % len(seqs)])
            elif seqs and op == "fork":
                bm.fork(seqs[pick % len(seqs)], f"s{n}")
                n += 1
            elif seqs and op == "free":
                bm.free(seqs[pick % len(seqs)])
        except NoFreeBlocksError:
            pass
        # reference counts equal the number of tables pointing at each block
        counts = [0] * num_blocks
        for table in bm.block_tables.values():
            for b in table:
                counts[b] += 1
        assert bm.ref_counts == counts
        # free exactly when the count is zero; the free queue has no duplicates
        assert sorted(bm.free_block_queue) == [b for b in range(num_blocks) if counts[b] == 0]
        for seq, table in bm.block_tables.items():
            tokens = bm.num_tokens[seq]
            assert len(table) == -(-tokens // block_size)
            assert bm.fills[table[-1]] == tokens - (len(table) - 1) * block_size
            assert all(bm.fills[b] == block_size for b in table[:-1])


# ------------------------------------------------------------------------------------ prefix caching
def test_freed_block_reused_for_other_tokens_is_not_found_by_its_old_hash():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    bm.allocate("A", 3, [1, 2, 3])  # block 0 = [1, 2] is full and cached
    assert bm.match_prefix([1, 2, 9]) == [0]
    bm.free("A")
    assert bm.match_prefix([1, 2, 9]) == [0]  # free but still cached
    bm.allocate("B", 3, [5, 6, 7])  # needs both blocks: block 0 is evicted and rewritten
    assert [e.kind for e in bm.drain_events()].count("evict") == 1
    assert bm.match_prefix([1, 2, 9]) == []
    assert bm.stats["evictions"] == 1


def test_prompt_shorter_than_one_block_gets_no_hit():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    assert bm.allocate_with_prefix("A", 3, [1, 2, 3])[1] == 0
    assert bm.allocate_with_prefix("B", 3, [1, 2, 3])[1] == 0
    assert bm.block_tables["A"] != bm.block_tables["B"]


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    bm.allocate("A", 5, [1, 2, 3, 4, 5])
    bm.free("A")
    assert bm.num_free_blocks == 4
    table, cached = bm.allocate_with_prefix("B", 5, [1, 2, 3, 4, 9])
    assert cached == 4 and table[:2] == [0, 1]
    assert bm.num_free_blocks == 1


def test_long_system_prompt_is_stored_once_for_fifty_requests():
    """LESSON_BRIEF section 4: a 1,600-token system prompt (100 blocks of 16) shared by 50 chats."""
    bm = BlockManager(num_blocks=400, block_size=16, enable_prefix_caching=True)
    system = [t % 50 for t in range(1600)]
    for i in range(50):
        bm.allocate(f"chat{i}", 1605, system + [100 + i] * 5)
    assert bm.num_used_blocks == 100 + 50  # the system prompt once, one private block per chat
    shared = bm.block_tables["chat0"][:100]
    assert all(bm.ref_counts[b] == 50 for b in shared)
    private = bm.block_tables["chat7"][100]
    assert bm.free("chat7") == [private]
    assert all(bm.ref_counts[b] == 49 for b in shared)  # ending one chat frees none of the shared blocks
    assert bm.num_used_blocks == 100 + 49
