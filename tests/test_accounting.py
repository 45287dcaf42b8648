"""Accounting that a newcomer trial found misleading, pinned down: shared blocks count once at final
lengths, external fragmentation is measured against the request at the door, Pow2 is capped by the
maximum length (not the Max reservation), a prefix-cache reset restarts the hit rate as vLLM's does."""

from __future__ import annotations

import pytest

from engine import BlockManager, metrics
from engine.cli import main as cli_main
from engine.contiguous import ContiguousAllocator


def test_samples_share_their_prompts_full_blocks_at_final_lengths():
    # prompt 20 tokens, B=16, 4 samples of 10: block 0 (16 prompt tokens) once, then each sample's own block
    # holding 4 prompt tokens (copied on write) + 10 of its own; 5 blocks, not 4 x ceil(30/16) = 8
    prompt, same = list(range(20)), [7] * 10  # greedy samples may write the same tokens: still their own blocks
    assert metrics.request_blocks(prompt, [same, same, same, same], 16) == (5, 60)
    assert metrics.request_blocks(prompt, [same], 16) == (2, 30)  # one completion: nothing shared
    # 16 of its 20 prompt tokens found in the prefix cache: that block existed already
    assert metrics.request_blocks(prompt, [same], 16, hit_tokens=16) == (1, 14)


def test_beams_share_every_full_block_of_their_common_prefix():
    # B=4, prompt 4 tokens; beams agree on 5 generated tokens then split: blocks [p][g0..g3] shared, then
    # each beam's own partly filled block (5th generated token on)
    prompt, common = [1, 2, 3, 4], [5, 6, 7, 8, 9]
    beams = [common + [10, 11], common + [12], common + [13, 14]]
    assert metrics.request_blocks(prompt, beams, 4, beams=True) == (2 + 3, 9 + 5)
    assert metrics.request_blocks(prompt, beams, 4) == (1 + 3 * 2, 4 + 3 * 5 + 5)  # as samples: prompt only


def test_shared_prefix_scenario_counts_the_system_prompt_once(capsys):
    import json

    assert cli_main(["run", "--scenario", "shared-prefix", "--allocator", "both", "--contiguous-policy", "oracle",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    paged, oracle = out["paged"], out["contiguous"]
    hit = paged["prefix_cache"]["hit_tokens"]
    assert hit == 560  # 7 requests x 80 tokens of the system prompt
    per_completion = sum(-(-(len(r["prompt_token_ids"]) + len(r["output_token_ids"])) // 16)
                         for r in out["requests"])
    assert paged["blocks_allocated"] == per_completion - hit // 16  # 5 blocks x 7 not held twice
    # even a contiguous oracle, which knows every length, stores the system prompt 8 times
    assert paged["slots_allocated"] < oracle["reserved_slots"]  # 464 < 995 (per completion it read 1,024)


def test_external_fragmentation_is_measured_against_the_request_at_the_door():
    region = ContiguousAllocator(100, 50, policy="oracle")
    region.allocate("A", 5, reservation=30)   # 0..29
    region.allocate("B", 5, reservation=30)   # 30..59
    region.allocate("C", 5, reservation=20)   # 60..79, leaving 80..99
    region.free("A")                          # gaps: 0..29 and 80..99, 50 free
    assert region.external_frag_slots == 0    # nobody waits, and no request's size is known
    assert region.admission_refusal([[0] * 5], reservation=40) is not None  # 40 would fit the 50 free slots
    assert region.external_frag_slots == 50 and region.layout()["external_frag_need"] == 40
    region.allocate("D", 5, reservation=20)   # the next request gets in: nothing is measured until a refusal
    assert region.external_frag_slots == 0
    same = ContiguousAllocator(100, 50, policy="max")  # every request reserves 50: measured against that
    for rid in "AB":
        same.allocate(rid, 5)
    same.free("A")
    assert same.external_frag_slots == 0      # one gap of 50 holds a reservation: not fragmented


def test_pow2_is_capped_by_the_maximum_length_not_the_max_reservation():
    region = ContiguousAllocator(1000, 16, policy="pow2", max_model_len=512)
    assert [region.reservation_for(3, 600, n) for n in (3, 17, 100, 300, 600)] == [4, 32, 128, 512, 600]


def test_reset_prefix_cache_restarts_the_hit_rate():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    bm.allocate("A", 5, [1, 2, 3, 4, 5])
    bm.free("A")
    bm.allocate("B", 5, [1, 2, 3, 4, 6])
    bm.free("B")
    assert metrics.prefix_cache_stats(bm.stats)["hit_tokens"] == 4
    evictions = bm.stats["evictions"]
    assert bm.reset_prefix_cache()
    stats = metrics.prefix_cache_stats(bm.stats)
    assert stats["hit_tokens"] == stats["query_tokens"] == stats["requests"] == 0
    assert stats["evictions"] == evictions


def test_reset_without_passes_is_a_clear_error(capsys):
    assert cli_main(["run", "--scenario", "single", "--reset-prefix-cache"]) == 2
    assert "give --passes 2 or more" in capsys.readouterr().err


def test_a_reply_with_stop_tokens_has_no_length_known_in_advance(make_engine, text_ids):
    """ignore_eos alone fixes the final length (prompt + max_tokens); stop tokens can still end it early, so
    the oracle must be told the length rather than assume the longest."""
    from engine import SamplingParams
    assert SamplingParams(ignore_eos=True).length_known
    assert not SamplingParams(ignore_eos=True, stop_token_ids=[5]).length_known
    engine = make_engine(block_size=4, num_blocks=32, max_model_len=64, allocator="contiguous",
                         contiguous_policy="oracle")
    engine.add_request(text_ids[:5], SamplingParams(max_tokens=6, ignore_eos=True))  # 11, derived
    with pytest.raises(ValueError, match="needs each request's final length"):
        engine.add_request(text_ids[:5], SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[5]))
