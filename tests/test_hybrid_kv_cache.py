"""KV cache groups without a model (issue 25, item 2): the layers grouped as vLLM groups them, one shared
block pool, a block table per group, a sliding-window group that frees the blocks its window left (the
null block in its table), vLLM's prefix-cache hit rule for a sliding group and the length every group
agrees on, KV events per group, and the KV tensors shared between groups."""

from __future__ import annotations

import pytest
import torch

from engine.block_pool import NONE_HASH, BlockPool, prefix_hashes
from engine.kv_cache import KVCache, kv_cache_groups, layer_windows
from engine.kv_cache_manager import KVCacheManager
from engine.metrics import blocks_for, blocks_left_window, hybrid_blocks_saved
from engine.model_loader import KVGeometry
from engine.records import EventKind, EventLog
from engine.single_type_kv_cache_manager import (NULL_BLOCK, FullAttentionManager, KVCacheGroupSpec,
                                                 SlidingWindowManager, group_layers)

B, W = 4, 8  # block size, sliding window: a hit needs ceil((8 - 1) / 4) = 2 blocks before its end
HYBRID = (KVCacheGroupSpec((0, 2), W), KVCacheGroupSpec((1, 3)))  # the embedded hybrid model's shape
TWIN = (KVCacheGroupSpec((0, 2)), KVCacheGroupSpec((1, 3)))  # the same groups, every layer full


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# ------------------------------------------------------------------------------------------- groups
def test_layers_are_grouped_as_vllm_groups_them():
    assert group_layers([48, None, 48, None]) == HYBRID[:0] + (KVCacheGroupSpec((0, 2), 48), KVCacheGroupSpec((1, 3)))
    assert group_layers([None] * 4) == (KVCacheGroupSpec((0, 1, 2, 3)),)
    assert group_layers([64] * 3) == (KVCacheGroupSpec((0, 1, 2), 64),)  # Mistral: one sliding group
    # vLLM's own example (kv_cache_utils.py:1455-1458): 2 full + 3 sliding -> (full.0, full.1), (sw.0, sw.2),
    # (sw.1, padding); here the kinds come in the order they first appear
    assert group_layers([None, 8, 8, None, 8]) == (KVCacheGroupSpec((0, 3)), KVCacheGroupSpec((1, 4), 8),
                                                   KVCacheGroupSpec((2,), 8))
    # Gemma 3's 5 local : 1 global -> 6 groups of one layer
    assert len(group_layers([1024] * 5 + [None])) == 6
    with pytest.raises(ValueError, match="layer 1: sliding window must be a positive integer"):
        group_layers([None, 0])


def test_layer_windows_read_from_configs():
    from transformers import MinistralConfig, MistralConfig, Qwen2Config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    hybrid = MinistralConfig(**small, sliding_window=48, layer_types=["sliding_attention", "full_attention"] * 2)
    assert layer_windows(hybrid) == [48, None, 48, None]
    assert kv_cache_groups(hybrid) == (KVCacheGroupSpec((0, 2), 48), KVCacheGroupSpec((1, 3)))
    assert layer_windows(MistralConfig(**small, sliding_window=64)) == [64] * 4
    assert layer_windows(MistralConfig(**small, sliding_window=256)) == [None] * 4  # as long as the model
    assert layer_windows(Qwen2Config(**small, sliding_window=32, use_sliding_window=False)) == [None] * 4
    assert layer_windows(Qwen2Config(**small, sliding_window=32, use_sliding_window=True,
                                     max_window_layers=2)) == [None, None, 32, 32]
    bad = MinistralConfig(**small, sliding_window=48, layer_types=["sliding_attention", "full_attention"] * 2)
    bad.layer_types = ["chunked_attention"] * 4
    with pytest.raises(ValueError, match="layer_types must name 4 layers"):
        layer_windows(bad)


def test_groups_share_the_kv_tensors_as_vllm_lays_them_out():
    geo = KVGeometry(num_layers=4, num_kv_heads=2, num_heads=8, head_dim=32, dtype="float32")
    one = KVCache(geo, 10, B, torch.device("cpu"), torch.float32)
    two = KVCache(geo, 10, B, torch.device("cpu"), torch.float32, groups=HYBRID)
    assert two.layer_group == [0, 1, 0, 1] and two.layer_window == [W, None, W, None]
    assert two.key_cache[0] is two.key_cache[1] and two.key_cache[2] is two.key_cache[3]  # j-th layer of each group
    assert two.key_cache[0] is not two.key_cache[2]
    assert two.nbytes * 2 == one.nbytes == 10 * geo.bytes_per_block(B)  # a block holds 2 layers, not 4
    with pytest.raises(ValueError, match="do not cover the 4 layers once each"):
        KVCache(geo, 10, B, torch.device("cpu"), torch.float32, groups=(KVCacheGroupSpec((0, 1)),))


# ---------------------------------------------------------------------------------- the sliding window
def _decode(km: KVCacheManager, seq: str, tokens: list[int], steps: int) -> None:
    for _ in range(steps):
        tokens.append(len(tokens) + 7)
        km.allocate_slots(seq, tokens, 1)


@pytest.mark.parametrize("window", [W, 5, 9])
def test_a_request_past_the_window_holds_fewer_blocks_than_its_full_attention_twin(window):
    groups = (KVCacheGroupSpec((0, 2), window), KVCacheGroupSpec((1, 3)))
    hybrid, twin = KVCacheManager(64, B, groups=groups), KVCacheManager(64, B, groups=TWIN)
    toks_h, toks_t = ids(10), ids(10)
    hybrid.allocate_slots("a", toks_h, 10)
    twin.allocate_slots("a", toks_t, 10)
    for step in range(30):
        computed = hybrid.num_tokens["a"]  # what the next allocation frees by
        _decode(hybrid, "a", toks_h, 1)
        _decode(twin, "a", toks_t, 1)
        saved = hybrid_blocks_saved(computed, B, [window, None])
        assert twin.pool.num_used_blocks - hybrid.pool.num_used_blocks == saved, step
        sliding, full = hybrid.group_block_tables("a")
        assert sliding[:saved] == [NULL_BLOCK] * saved and NULL_BLOCK not in sliding[saved:]
        assert len(sliding) == len(full) == blocks_for(computed + 1, B)  # a null still holds its place
        assert hybrid.pool.invariant_violations(t for _, t in hybrid.all_block_tables()) == []
    assert saved == (39 - window + 1) // B > 0  # 39 tokens computed before the last step


def test_a_block_leaves_the_window_with_an_event_naming_it():
    log = EventLog()
    km = KVCacheManager(32, B, event_log=log, groups=HYBRID)
    toks = ids(11)
    km.allocate_slots("a", toks, 11)
    log.drain()
    _decode(km, "a", toks, 1)  # 11 computed: the next token (11) attends to 4..11, block 0 (0..3) is out
    [leave] = [e for e in log.drain() if e.kind == EventKind.LEAVE_WINDOW]
    first = km.managers[1].req_to_blocks["a"][0]  # where the full group keeps token 0; the sliding one freed it
    assert leave.request_id == "a" and leave.data == {"group": 0, "position": 11} and len(leave.blocks) == 1
    assert leave.blocks[0] != first and km.group_block_tables("a")[0][0] == NULL_BLOCK
    assert "left the 8-token sliding window of KV cache group 0" in leave.message
    assert km.pool.ref_counts[leave.blocks[0]] == 0 and leave.blocks[0] in km.pool.free_block_queue


def test_blocks_left_window_arithmetic():
    # a query at p reads p - W + 1 .. p: before computing token c, tokens 0 .. c - W are out of every window
    assert [blocks_left_window(c, 4, 8) for c in (0, 7, 8, 11, 12, 15, 16)] == [0, 0, 0, 1, 1, 2, 2]
    assert hybrid_blocks_saved(40, 16, [48, None, 32]) == 0 + 0 + 0 + (40 - 32 + 1) // 16


# ------------------------------------------------------------------------------------------ hit rules
def _cache(pool: BlockPool, tokens: list[int], blocks: dict[int, int], group: int) -> None:
    """Put free block ``b`` in group ``group``'s prefix cache as logical block ``i`` of ``tokens``, for each
    i -> b (a free block that keeps its hash, as a finished request leaves it)."""
    hashes = [NONE_HASH, *prefix_hashes(tokens, B, max(blocks) + 1)]
    for i, b in blocks.items():
        pool.cache_full_block(b, hashes[i], tokens[i * B:(i + 1) * B], (f"x{group}", i), group)


def test_sliding_hit_is_searched_from_the_right_and_needs_only_the_last_blocks():
    pool = BlockPool(16, B, EventLog())
    sw = SlidingWindowManager(pool, True, 0, sliding_window=W)
    toks = ids(25)
    hashes = list(prefix_hashes(toks, B, 6))
    _cache(pool, toks, {3: 3, 4: 4}, group=0)  # only blocks 3 and 4 of the prefix are cached
    # vLLM's docstring example shape: [NULL, NULL, NULL, 3, 4]: the 20-token prefix is usable
    assert sw.find_longest_cache_hit(hashes, 6) == [NULL_BLOCK] * 3 + [3, 4]
    assert sw.find_longest_cache_hit(hashes, 4) == []  # within 4 blocks only block 3: one block, 2 needed
    full = FullAttentionManager(pool, True, 0)
    assert full.find_longest_cache_hit(hashes, 6) == []  # full attention needs block 0 first


def test_sliding_hit_shorter_than_the_run_it_needs_takes_the_blocks_from_the_start():
    pool = BlockPool(16, B, EventLog())
    sw = SlidingWindowManager(pool, True, 0, sliding_window=W)
    toks = ids(25)
    _cache(pool, toks, {0: 0}, group=0)
    assert sw.find_longest_cache_hit(list(prefix_hashes(toks, B, 6)), 6) == [0]


def test_the_hit_every_group_agrees_on():
    km = KVCacheManager(32, B, enable_prefix_caching=True, groups=HYBRID)
    toks = ids(25)  # at most (25 - 1) // 4 = 6 blocks can hit
    _cache(km.pool, toks, {i: i for i in range(6)}, group=1)  # the full group holds the whole prefix
    _cache(km.pool, toks, {0: 6, 1: 7}, group=0)  # the sliding group only logical blocks 0 and 1
    (sliding, full), hit = km.find_longest_cache_hit(toks)
    assert hit == 8 and sliding == [6, 7] and full == [0, 1]  # cut to the sliding group's 2 blocks
    _cache(km.pool, toks, {3: 8, 4: 9}, group=0)  # now logical blocks 3 and 4 too: a window's worth
    (sliding, full), hit = km.find_longest_cache_hit(toks)
    assert hit == 20 and sliding == [NULL_BLOCK] * 3 + [8, 9] and full == [0, 1, 2, 3, 4]
    assert km.match_prefix(toks) == [0, 1, 2, 3, 4]  # the shown (full) group's blocks of the common hit


def test_a_repeated_prompt_hits_and_its_sliding_table_starts_with_nulls():
    km = KVCacheManager(64, B, enable_prefix_caching=True, groups=HYBRID)
    toks = ids(30)
    assert km.allocate_slots("a", toks, 30) == 0
    _decode(km, "a", toks, 3)
    km.free("a")
    again = ids(30)
    cached = km.allocate_slots("b", again, 30 - 28)  # hit = 7 blocks of 4 (never the last token's block)
    assert cached == 28
    sliding, full = km.group_block_tables("b")
    skipped = blocks_left_window(28, B, W)  # (28 - 8 + 1) // 4 = 5 of the hit's blocks need not come back
    assert sliding[:skipped] == [NULL_BLOCK] * skipped and NULL_BLOCK not in sliding[skipped:] + full
    assert km.stats["hits"] == 28 and km.pool.invariant_violations(t for _, t in km.all_block_tables()) == []


def test_kv_events_name_the_group_as_vllm_does():
    km = KVCacheManager(32, B, enable_prefix_caching=True, evict_uncached_first=True, groups=HYBRID)
    km.allocate_slots("a", ids(9), 9)
    stored = km.drain_kv_events()
    assert [e["type"] for e in stored] == ["BlockStored", "BlockStored"]  # one per group per allocation
    # vLLM's BlockPool sets group_idx on every event, 0 included; take_events adds the group's kind and window
    assert [(e["group_idx"], e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]) for e in stored] == [
        (0, "sliding_window", km.managers[0].sliding_window), (1, "full_attention", None)]
    assert stored[0]["block_hashes"] == stored[1]["block_hashes"]  # same tokens, same hash, two entries
    km.free("a")
    for i in range(16):  # 16 one-token requests take a block in each group: the whole pool
        km.allocate_slots(f"f{i}", [i], 1)
    removed = [e for e in km.drain_kv_events() if e["type"] == "BlockRemoved"]
    assert [e["group_idx"] for e in removed] == [0, 0, 1, 1]


def test_admission_counts_a_sliding_group_at_most_its_cap():
    km = KVCacheManager(200, B, groups=HYBRID)
    km.set_max_in_flight_tokens(16, 1000)  # cap = ceil(min(8 - 1 + 16, 1000) / 4) + 1 = 7 blocks
    assert km.managers[0].max_admission_blocks == 7
    assert km.blocks_to_allocate("n", ids(100), 100) == 25 + 7
    km.allocate_slots("n", ids(100), 16)
    assert km.blocks_to_allocate("n", ids(100), 32) == 4 + 4  # a running request: no cap, what it grows by


def test_a_uniform_sliding_window_model_has_one_sliding_group():
    km = KVCacheManager(32, B, enable_prefix_caching=True, groups=group_layers([W, W]))
    assert [type(m) for m in km.managers] == [SlidingWindowManager] and km.full is km.managers[0]
    toks = ids(12)
    km.allocate_slots("a", toks, 12)
    _decode(km, "a", toks, 6)  # 17 computed before the last: (17 - 8 + 1) // 4 = 2 blocks left
    assert km.block_tables["a"][:2] == [NULL_BLOCK] * 2 and km.pool.num_used_blocks == 5 - 2
    assert km.slot_mappings("a", 17, 18) == ([km.block_tables["a"][4] * B + 1],)
    with pytest.raises(ValueError, match="left the window"):
        km.slot_mappings("a", 0, 1)


def test_a_sliding_group_caches_only_the_blocks_a_resend_of_the_prompt_can_hit():
    """vLLM 0.32 (``reachable_block_mask``, default ``prefix_cache_retention_interval`` 0): a sliding group
    keeps in the prefix cache only the ceil((W - 1) / B) blocks before the prompt's last token; the full
    group keeps every full block. The others are freed uncached, to the front of the free queue."""
    km = KVCacheManager(64, B, enable_prefix_caching=True, evict_uncached_first=True, groups=HYBRID)
    toks = ids(30)  # 7 full blocks; a resend stops at token 29: blocks 5 and 6 serve its sliding hit
    km.allocate_slots("a", toks, 30, num_prompt_tokens=30)
    sliding_ev, full_ev = km.drain_kv_events()
    hashes = list(prefix_hashes(toks, B, 7))
    assert full_ev["block_hashes"] == hashes and full_ev["group_idx"] == 1
    assert sliding_ev["block_hashes"] == hashes[5:7] and sliding_ev["token_ids"] == toks[:28]  # the call's range
    sliding = km.group_block_tables("a")[0]
    assert [km.pool.block_hashes[b] is not None for b in sliding] == [False] * 5 + [True, True, False]
    _decode(km, "a", toks, 2)  # token 30, 31: block 7 fills; past the prompt nothing more is kept
    assert [ev for ev in km.drain_kv_events() if ev.get("group_idx", 0) == 0 and ev["block_hashes"]] == []
    km.free("a")
    assert km.allocate_slots("b", ids(30), 2) == 28  # the resend hits all 7 blocks in both groups
