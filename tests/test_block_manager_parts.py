"""The block manager in vLLM V1's parts (issue 24, item 2): a ``BlockPool`` that knows blocks, not requests;
one ``SingleTypeKVCacheManager`` per KV cache group under the ``KVCacheManager``; the swap space its own
object; sentences written from typed events (``engine.narration``); the snapshot recorder wrapping the
pool from outside. ``BlockManager`` keeps its public behaviour (the other block-manager tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import narration
from engine.block_manager import BlockManager
from engine.block_pool import NONE_HASH, BlockPool, block_hash
from engine.kv_cache_manager import KVCacheManager
from engine.pool_recorder import TrackedList
from engine.records import EventKind, EventLog
from engine.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager
from engine.swap_space import SwapSpace

ENGINE = Path(__file__).resolve().parent.parent / "engine"


@pytest.mark.parametrize("module", ["block_pool.py", "block_manager.py"])
def test_the_pool_and_the_block_manager_each_fit_450_lines(module):
    lines = (ENGINE / module).read_text().count("\n")
    assert lines <= 450, f"engine/{module} has {lines} lines"


def test_a_bare_pool_hands_out_blocks_in_order_and_frees_by_its_policy():
    pool = BlockPool(4, 2, EventLog(), evict_uncached_first=True)
    assert [pool.get_new_block() for _ in range(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.peak_used_blocks == 3
    pool.cache_full_block(0, NONE_HASH, [5, 6], ("r", 0))
    # freed tail first: the uncached blocks go to the front (reused first), the cached one to the back
    assert pool.free_blocks([2, 1, 0]) == [2, 1, 0]
    assert list(pool.free_block_queue) == [2, 1, 3, 0]
    assert pool.get_cached_block(block_hash(NONE_HASH, [5, 6])) == 0
    assert pool.invariant_violations([]) == []


def test_the_pool_evicts_a_cached_block_it_hands_out_again():
    log = EventLog()
    pool = BlockPool(1, 2, log)
    b = pool.get_new_block()
    pool.cache_full_block(b, NONE_HASH, [1, 2], ("r", 0))
    pool.free_blocks([b])
    assert pool.get_new_block() == b
    h = block_hash(NONE_HASH, [1, 2])
    assert pool.get_cached_block(h) is None and pool.stats["evictions"] == 1
    assert [e["type"] for e in pool.drain_kv_events()] == ["BlockStored", "BlockRemoved"]
    [evict] = log.drain()
    assert evict.kind == EventKind.EVICT and evict.data == {"hash": h, "still_cached": 0}
    assert evict.message == f"block {b} evicted from the prefix cache (hash {h}) to be reused"


class _SkipSpy(FullAttentionManager):
    """Full attention that records the ``remove_skipped_blocks`` calls it gets (a sliding-window group
    would free blocks there)."""

    def __init__(self, pool, enable_caching):
        super().__init__(pool, enable_caching)
        self.skipped: list[tuple[str, int]] = []

    def remove_skipped_blocks(self, request_id, num_computed_tokens):
        self.skipped.append((request_id, num_computed_tokens))
        return []


def test_a_kind_of_kv_cache_group_is_a_class_with_the_four_operations():
    with pytest.raises(TypeError):
        SingleTypeKVCacheManager(BlockPool(2, 2, EventLog()))  # abstract: a kind must say how it hits and skips
    km = KVCacheManager(8, 2, enable_prefix_caching=True, group_kinds=(_SkipSpy,))
    ids = list(range(7))
    assert km.allocate_slots("a", ids, 3) == 0
    assert km.allocate_slots("a", ids, 3) == 0
    assert km.full.skipped == [("a", 3)]  # asked before the chunk's blocks are allocated
    assert km.block_tables == {"a": [0, 1, 2]} and km.num_tokens == {"a": 6}
    hits = km.full.find_longest_cache_hit(iter([block_hash(NONE_HASH, [0, 1]), "no such hash"]))
    assert hits == [0]
    assert km.full.free("a") == ([0, 1, 2], [2, 1, 0])


def test_the_swap_space_keeps_sharing_inside_a_request():
    swap = SwapSpace(3)
    c0, c1 = swap.take(2), swap.take(1)
    swap.hold("a", [c0, c1], 3)
    swap.hold("b", [c0], 2)
    assert swap.distinct_blocks(["a", "b"]) == [0, 1] and swap.num_free_blocks == 1
    assert swap.release("a") == ([0, 1], 3)
    assert swap.free == [2, 1] and swap.fills == [2, 0, 0]  # c0 still held by b
    swap.release("b")
    assert swap.num_free_blocks == 3


def test_every_block_manager_sentence_is_written_from_its_typed_event(monkeypatch):
    written = []

    def fake(kind, request_id, blocks, data, facts):
        written.append(kind)
        return f"<{kind}>"

    monkeypatch.setattr(narration, "sentence", fake)
    bm = BlockManager(5, 2, enable_prefix_caching=True, num_swap_blocks=4)
    bm.allocate_with_prefix("a", 3, [1, 2, 3])
    bm.fork("a", "b")
    bm.append_slot("b", 4)
    bm.append_slot("a", 5)
    bm.swap_out(["a"], "A")
    bm.swap_in(["a"], "A")
    bm.append_slot("a", 6)  # its last block is full: a new one
    bm.free("a"), bm.free("b")
    bm.allocate_with_prefix("c", 3, [1, 2, 3])
    bm.allocate_with_prefix("d", 1, [9])
    bm.allocate_with_prefix("e", 1, [9])
    bm.free("c"), bm.free("d"), bm.free("e")
    bm.reset_prefix_cache()
    events = bm.drain_events()
    assert [e.message for e in events] == [f"<{e.kind}>" for e in events]
    assert written == [e.kind for e in events]
    assert {"allocate", "fork", "cow", "append", "swap_out", "swap_in", "free", "prefix_hit", "evict",
            "new_block", "reset_prefix_cache"} <= set(written)


def test_the_recorder_wraps_the_pool_from_outside():
    pool = BlockPool(4, 2, EventLog())
    assert type(pool.ref_counts) is list and type(pool.fills) is list  # a pool knows nothing of snapshots
    bm = BlockManager(4, 2, num_swap_blocks=2)
    assert all(isinstance(x, TrackedList) for x in (bm.pool.ref_counts, bm.pool.fills, bm.pool.block_hashes,
                                                     bm.swap.fills))
    full = bm.snapshot_fields()
    assert "pool_delta" not in full and full["ref_counts"] == [0] * 4
    bm.snapshot_taken(sentinel := object())
    bm.allocate("a", 3)
    delta = bm.snapshot_fields()["pool_delta"]
    assert delta.prev is sentinel and delta.blocks == {0: (1, 2, ["a"], None), 1: (1, 1, ["a"], None)}
