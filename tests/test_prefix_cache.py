"""The block manager's prefix cache and pool policy, alone (no model): the eviction order, blocks filled
during decode, duplicate cached blocks, a cache poisoned by a reused sequence id, append without a token
id, reset_prefix_cache, first-admission vs re-admission counters, and the watermark."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.metrics import prefix_cache_stats
from engine.records import EventKind


def test_free_puts_the_last_block_first_in_the_eviction_queue():
    """Tail first (vLLM): a freed sequence's last block is evicted first, its first block last, so the cached
    prefix stays cached longest."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(12))
    assert bm.allocate("A", 12, prompt) == [0, 1, 2]
    bm.free("A")
    assert list(bm.free_block_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    query = prompt + [99]
    assert bm.match_prefix(query) == [0, 1, 2]
    bm.allocate("X", 20, [50 + i for i in range(20)])  # the 5 never-used blocks
    assert bm.match_prefix(query) == [0, 1, 2]
    bm.allocate("Y", 4, [70, 71, 72, 73])  # evicts the tail: the first two blocks still hit
    assert bm.block_tables["Y"] == [2]
    assert bm.match_prefix(query) == [0, 1]


def test_a_block_filled_during_decode_is_cached_and_hit_later():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    bm.allocate("A", 6, [1, 2, 3, 4, 5, 6])
    block = bm.block_tables["A"][1]
    assert bm.block_hashes[block] is None  # half full
    bm.append_slot("A", 7)
    assert bm.block_hashes[block] is None
    bm.append_slot("A", 8)  # now full: registered
    assert bm.block_hashes[block] is not None
    table, cached = bm.allocate_with_prefix("B", 9, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cached == 8 and table[:2] == bm.block_tables["A"][:2]
    assert bm.invariant_violations() == []


def test_duplicate_cached_blocks_stay_findable_when_one_is_evicted():
    """A and B compute the same 8 tokens: B hits block 0 but writes its second block afresh (block 2), so
    blocks 1 and 2 carry the same hash. Evicting block 1 must leave block 2 findable."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    assert bm.allocate("A", 8, tokens) == [0, 1]
    assert bm.allocate("B", 8, tokens) == [0, 2]
    assert bm.block_hashes[1] == bm.block_hashes[2] is not None
    assert bm.invariant_violations() == []
    bm.free("A")
    bm.free("B")
    bm.drain_events()
    bm.allocate("X", 8, [0] * 8)  # takes block 3, then evicts block 1
    assert bm.block_tables["X"] == [3, 1]
    assert bm.block_hashes[2] is not None
    assert bm.match_prefix(tokens + [13]) == [0, 2]
    assert bm.invariant_violations() == []
    evicts = [e for e in bm.drain_events() if e.kind == EventKind.EVICT]
    assert [e.blocks for e in evicts] == [[1]]
    assert evicts[0].data["still_cached"] == 1  # it does not claim the prefix is gone
    assert "1 other block with the same prefix stay" in evicts[0].message
    bm.free("X")
    table, cached = bm.allocate_with_prefix("C", 9, tokens + [13])
    assert cached == 8 and table[:2] == [0, 2]


def test_a_reused_sequence_id_does_not_poison_the_cache():
    """s1 is allocated with token ids [0, 1], swapped out and freed; a new s1 allocated without token ids must
    not hash its block from the old s1's tokens."""
    bm = BlockManager(num_blocks=1, block_size=2, enable_prefix_caching=True, num_swap_blocks=1)
    bm.allocate("s1", 2, [0, 1])
    bm.swap_out(["s1"])
    bm.free("s1")
    bm.allocate("s1", 1)  # no token ids: the manager does not know what it holds
    bm.append_slot("s1", 7)  # fills the block
    assert bm.block_hashes == [None]
    assert bm.match_prefix([0, 1, 2]) == []
    bm.free("s1")
    assert bm.match_prefix([0, 1, 2]) == []
    assert bm.invariant_violations() == []


def test_a_reused_sequence_id_gets_no_hit_in_a_larger_pool():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True, num_swap_blocks=1)
    bm.allocate("s1", 2, [0, 1])  # block 0, cached as [0, 1]
    bm.swap_out(["s1"])
    bm.free("s1")
    bm.allocate("Y", 1)  # block 1
    assert bm.allocate("s1", 1) == [0]  # evicts the real [0, 1]
    bm.append_slot("s1", 7)
    assert bm.block_hashes == [None, None]
    bm.free("s1")
    bm.free("Y")
    assert bm.allocate_with_prefix("s2", 3, [0, 1, 2])[1] == 0


@pytest.mark.parametrize("prompt_len", [4, 6])  # the next token starts a new block / goes into the last one
def test_append_without_token_id_is_refused_before_anything_changes(prompt_len):
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    bm.allocate("A", prompt_len, list(range(prompt_len)))
    before = (dict(bm.num_tokens), list(bm.fills), list(bm.free_block_queue), {k: list(v) for k, v in
              bm.block_tables.items()}, list(bm.ref_counts), list(bm.token_ids["A"]))
    with pytest.raises(ValueError, match="needs token_id"):
        bm.append_slot("A")
    after = (dict(bm.num_tokens), list(bm.fills), list(bm.free_block_queue), {k: list(v) for k, v in
             bm.block_tables.items()}, list(bm.ref_counts), list(bm.token_ids["A"]))
    assert after == before
    bm.append_slot("A", 9)  # still usable
    assert bm.num_tokens["A"] == prompt_len + 1


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    bm.allocate("A", 5, [1, 2, 3, 4, 5])
    bm.allocate("B", 3, [7, 8, 9])
    bm.free("A")
    hashes, cached = list(bm.block_hashes), {h: dict(b) for h, b in bm.cached_blocks.items()}
    bm.drain_events()
    assert bm.reset_prefix_cache() is False
    assert bm.block_hashes == hashes and bm.cached_blocks == cached
    assert bm.drain_events() == []
    assert bm.match_prefix([1, 2, 3, 4, 0]) == [0, 1]
    bm.free("B")
    bm.drain_events()
    assert bm.reset_prefix_cache() is True
    assert all(bm.block_hashes[b] is None and bm.fills[b] == 0 for b in bm.free_block_queue)
    assert bm.cached_blocks == {}
    assert bm.match_prefix([1, 2, 3, 4, 0]) == [] and bm.match_prefix([7, 8, 9]) == []
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks == 6
    [event] = bm.drain_events()
    assert event.kind == EventKind.RESET_PREFIX_CACHE and event.data == {"num_blocks": 3}
    assert bm.allocate_with_prefix("C", 5, [1, 2, 3, 4, 5])[1] == 0
    assert bm.invariant_violations() == []


def test_readmission_hits_are_counted_apart_from_first_admissions():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.allocate_with_prefix("A", 5, [1, 2, 3, 4, 5])
    bm.allocate_with_prefix("B", 5, [1, 2, 3, 4, 6])  # a first admission sharing A's prefix: a real hit
    bm.free("A")  # A is preempted (recompute) ...
    bm.allocate_with_prefix("A", 6, [1, 2, 3, 4, 5, 6], preempted=True)  # ... and hits its own blocks again
    assert bm.stats == {"requests": 2, "queries": 10, "hits": 4, "preempted_requests": 1, "preempted_queries": 6,
                        "preempted_hits": 4, "evictions": 0}
    stats = prefix_cache_stats(bm.stats)
    assert stats["hit_rate_pct"] == 40.0 and stats["readmission_hit_tokens"] == 4
    assert stats["query_tokens"] == 10 and stats["readmission_query_tokens"] == 6
    hits = [e for e in bm.drain_events() if e.kind == EventKind.PREFIX_HIT]
    assert [e.data["readmission"] for e in hits] == [False, True]


def test_watermark_is_kept_at_admission_and_swap_in_unless_the_pool_is_empty():
    bm = BlockManager(num_blocks=10, block_size=1, num_swap_blocks=10, watermark=0.2)
    assert bm.watermark_blocks == 2
    assert bm.admission_refusal([[0] * 10]) is None  # empty pool: waived, a lone request always fits
    bm.allocate("A", 1)
    assert bm.admission_refusal([[0] * 7]) is None  # 7 + 2 kept free <= 9
    assert "+ 2 kept free (watermark)" in bm.admission_refusal([[0] * 8])
    bm.allocate("B", 3)
    bm.swap_out(["B"])
    # swap-in: the 3 held blocks + 1 for its next token + the watermark 2 <= 9 free
    assert bm.can_swap_in(["B"])
    bm.allocate("C", 4)  # 5 free now: 3 + 1 + 2 > 5
    assert not bm.can_swap_in(["B"])
    bm.free("C")
    bm.free("A")  # the pool is empty: the watermark is waived, the held blocks + 1 must fit
    assert bm.can_swap_in(["B"])
    with pytest.raises(ValueError, match="watermark"):
        BlockManager(num_blocks=4, block_size=1, watermark=1.0)


def test_swap_in_needs_room_for_each_sequence_next_token():
    """vLLM v0's can_swap_in: the held blocks alone are not enough, the next token needs one more."""
    bm = BlockManager(num_blocks=4, block_size=2, num_swap_blocks=4)
    bm.allocate("A", 4)
    bm.swap_out(["A"])
    bm.allocate("X", 3)  # 2 blocks used, 2 free: exactly A's blocks, none for its next token
    assert not bm.can_swap_in(["A"])
    bm.free("X")
    assert bm.can_swap_in(["A"])
