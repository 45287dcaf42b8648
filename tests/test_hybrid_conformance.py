"""The lab's KV cache groups held against vLLM's hybrid allocator (issue 25, item 3).

The hybrid cases (``peer.cases.build_hybrid_cases``, on ``assets/tiny_hybrid_model``: layers 0 and 2 a
48-token sliding window, 1 and 3 full attention, block size 32) run through vLLM and through the lab's V1
engine, and every check of ``tests/test_conformance.py`` must pass: tokens, ``num_cached_tokens``,
preemptions, finishes, tokens scheduled per step, KV cache usage per step, and the KV events batch by batch
with their groups (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``). vLLM's results
are cached in ``.peer-cache/`` per case, so a fresh clone runs vLLM on them once.

Then what vLLM did in each case is asserted, so a case that stops showing its behaviour (another model,
another vLLM) cannot pass while checking nothing. The plain-data tests at the end (no vLLM, no model) show
that the comparison of KV events sees the group fields and names a sliding group's hashes.
"""

from __future__ import annotations

import copy

import pytest

from peer import conformance
from peer.cases import HYBRID_WINDOW, build_hybrid_cases, min_num_gpu_blocks
from peer.compare import compare, prefix_events
from test_conformance import run_peer

B = 32
peer = [pytest.mark.peer, pytest.mark.slow]


@pytest.fixture(scope="module")
def run():
    return run_peer(hybrid=True)


@pytest.fixture(scope="module")
def results(run):
    return {r.case.name: r for r in run[1]}


@pytest.fixture(scope="module")
def vllm_cases(run):
    return run[0]["cases"]


@pytest.mark.parametrize("name", conformance.case_names(hybrid=True))
@pytest.mark.peer
@pytest.mark.slow
def test_hybrid_case_matches_vllm(results, name):
    result = results[name]
    failed = [f"{c.name}: {c.detail}" for c in result.checks if not c.ok]
    assert not failed, f"{name} ({result.case.what}) differs from vLLM:\n" + "\n".join(failed)


@pytest.mark.peer
@pytest.mark.slow
def test_vllm_runs_the_hybrid_model_as_two_kv_cache_groups(vllm_cases):
    for name, case in vllm_cases.items():
        settings = case["settings"]
        assert settings["coordinator"] == "HybridKVCacheCoordinator", name
        assert [(g["manager"], g["kind"], g["sliding_window"], [n.split(".")[2] for n in g["layer_names"]])
                for g in settings["kv_cache_groups"]] == [
            ("SlidingWindowManager", "sliding_window", HYBRID_WINDOW, ["0", "2"]),
            ("FullAttentionManager", "full_attention", None, ["1", "3"])], name


def _stored(case: dict, step: int) -> list[tuple[int, int, int]]:
    """(group, hashes, blocks of tokens) of each BlockStored in ``step`` (1-based)."""
    return [(e["group_idx"], len(e["block_hashes"]), len(e["token_ids"]) // e["block_size"])
            for e in case["steps"][step - 1]["kv_events"] if e["type"] == "BlockStored"]


@pytest.mark.peer
@pytest.mark.slow
def test_long_prompts_case_frees_sliding_blocks_while_running(vllm_cases):
    case = vllm_cases[f"hybrid-long-prompts-B{B}"]
    steps = case["steps"]
    # prefill: 6 + 7 blocks per group; the sliding group caches only the 2 before each prompt's end
    assert _stored(case, 1) == [(0, 2, 6), (1, 6, 6), (0, 2, 7), (1, 7, 7)]
    # the next step, both still decoding, the sliding group gives back what left the window
    assert steps[1]["scheduled"] == {"four": 1, "five": 1}
    assert steps[1]["num_free_blocks"] - steps[0]["num_free_blocks"] >= 6


@pytest.mark.peer
@pytest.mark.slow
def test_repeated_prompt_case_hits_only_where_the_sliding_group_allows(vllm_cases):
    case = vllm_cases[f"hybrid-repeated-prompt-B{B}"]
    cached = {r: v["num_cached_tokens"] for r, v in case["requests"].items()}
    assert cached == {"first": 0, "again": 128, "fork": 0}
    # "fork" shares 100 tokens (3 full blocks) with "first", whose full group stored them; no removal since
    first_full = next(e for e in case["steps"][0]["kv_events"] if e["group_idx"] == 1)
    assert len(first_full["block_hashes"]) == 4
    assert not any(e["type"] == "BlockRemoved" for s in case["steps"] for e in s["kv_events"])


@pytest.mark.peer
@pytest.mark.slow
def test_evict_case_loses_the_sliding_blocks_the_repeat_needs(vllm_cases):
    case = vllm_cases[f"hybrid-evict-sliding-B{B}"]
    again = next(s["step"] for s in case["steps"] if "again" in s["scheduled"])
    removed = [e["group_idx"] for s in case["steps"][:again - 1] for e in s["kv_events"] if e["type"] == "BlockRemoved"]
    assert removed == [0, 0]  # the filler evicted the sliding group's 2 cached blocks, no full-attention block
    assert case["requests"]["again"]["num_cached_tokens"] == 0  # 4 full blocks still cached, but no hit
    assert case["steps"][again - 1]["scheduled"]["again"] == 150


@pytest.mark.peer
@pytest.mark.slow
def test_chunked_case_crosses_the_window_edge_inside_a_block(vllm_cases):
    case = vllm_cases[f"hybrid-chunked-window-edge-B{B}"]
    chunks = [s["scheduled"]["long"] for s in case["steps"] if s["scheduled"].get("long", 0) > 1]
    ends = [sum(chunks[:i + 1]) for i in range(len(chunks))]
    assert len(chunks) >= 3 and sum(chunks) == 150, chunks
    assert any(a < HYBRID_WINDOW < b for a, b in zip(ends, ends[1:])) and any(e % B for e in ends), ends
    assert case["requests"]["long2"]["num_cached_tokens"] == 128


@pytest.mark.peer
@pytest.mark.slow
def test_conformance_doc_lists_every_hybrid_case_green():
    text = conformance.DOC.read_text()
    section = text.split("## The hybrid model", 1)
    assert len(section) == 2, "docs/conformance.md has no hybrid section (python -m peer.conformance --write-docs)"
    for name in conformance.case_names(hybrid=True):
        row = next((line for line in section[1].splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/conformance.md's hybrid section has no row for {name}"
        assert "| pass |" in row, f"docs/conformance.md: {name} is not green: {row}"


# ---- plain data: no vLLM, no model -------------------------------------------------------------------

def test_every_hybrid_case_has_the_pool_vllm_accepts():
    cases = build_hybrid_cases(lambda text: list(range(len(text.split()) * 2)))
    assert {c.name for c in cases} == set(conformance.case_names(hybrid=True)) and len(cases) == 4
    for c in cases:
        need = min_num_gpu_blocks(c.block_size, c.max_model_len, c.max_num_batched_tokens, HYBRID_WINDOW)
        assert c.num_gpu_blocks >= need and c.lab_num_blocks == c.num_gpu_blocks - 1, c.name
    # vLLM's arithmetic (see min_num_gpu_blocks): 6 full + ceil(min(47 + 40, 192) / 32) + 1 = 4 sliding + null
    assert min_num_gpu_blocks(32, 192, 40, 48) == 6 + 4 + 1
    assert min_num_gpu_blocks(32, 192, 2048, 48) == 6 + 7 + 1 and min_num_gpu_blocks(32, 192, 2048) == 7


def _side(group_idx=(0, 1), kinds=("sliding_window", "full_attention"), window=48) -> dict:
    """One step's KV events as either side writes them: a full group's BlockStored of 2 blocks of 4 tokens
    and a sliding group's BlockStored naming only the second block's hash, then a sliding BlockRemoved."""
    full = {"type": "BlockStored", "block_hashes": ["f1", "f2"], "parent_block_hash": None,
            "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4, "group_idx": group_idx[1],
            "kv_cache_spec_kind": kinds[1], "kv_cache_spec_sliding_window": None}
    sliding = {**full, "block_hashes": ["f2"], "group_idx": group_idx[0], "kv_cache_spec_kind": kinds[0],
               "kv_cache_spec_sliding_window": window}
    removed = {"type": "BlockRemoved", "block_hashes": ["f2"], "group_idx": group_idx[0]}
    return {"settings": {}, "requests": {}, "num_preemptions": 0, "prefix_cache_stats": {"queries": 0, "hits": 0},
            "steps": [{"scheduled": {}, "preempted": [], "finished": [], "finish_reasons": {},
                       "kv_events": [sliding, full, removed], "kv_cache_usage": 0.0}]}


def test_a_sliding_groups_hashes_are_named_by_the_full_groups_event():
    (events,) = prefix_events(_side()["steps"])
    assert events[0] == ("stored", (0, "sliding_window", 48), ((1, 2, 3, 4, 5, 6, 7, 8),), (0, 8))
    assert events[2] == ("removed", (0,), ((1, 2, 3, 4, 5, 6, 7, 8),))


EVENTS = "same KV events in the same order (blocks by prefix content), batch by batch"


@pytest.mark.parametrize("lab", [_side(group_idx=(1, 0)), _side(kinds=("full_attention", "full_attention")),
                                 _side(window=64)], ids=["group_idx", "kind", "window"])
def test_a_group_field_that_differs_fails_the_events_check(lab):
    failed = {c.name: c.detail for c in compare(_side(), lab) if not c.ok}
    assert set(failed) == {EVENTS} and "step 1" in failed[EVENTS]


def test_a_sliding_group_caching_another_block_fails_the_events_check():
    lab = _side()
    other = copy.deepcopy(lab["steps"][0]["kv_events"][0])
    other["block_hashes"] = ["f1"]
    lab["steps"][0]["kv_events"][0] = other
    assert {c.name for c in compare(_side(), lab) if not c.ok} == {EVENTS}
    assert not [c for c in compare(_side(), _side()) if not c.ok]
