"""The engine in vLLM V1 semantics (``EngineConfig(semantics="v1")``) on the embedded model.

Paging and scheduling change where K/V live and when tokens are computed, never what the model computes:
greedy outputs in V1 (chunked prefill, mixed steps, preemption by recompute, child requests) equal the
paper mode's. The rest pins what V1 means here: mixed steps, child requests over the prefix cache with
vLLM's ``num_cached_tokens``, vLLM-schema KV events, what V1 refuses, and records that round-trip.
"""

from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.records import StepRecord, read_trace, write_trace

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prompts(text_ids):
    system = text_ids[:70]
    return [system + text_ids[100 + 7 * i: 100 + 7 * i + 5 + 9 * i] for i in range(5)] + [text_ids[:150]]


@pytest.mark.parametrize("budget,num_blocks", [(2048, 40), (48, 40), (48, 9)])
def test_v1_greedy_outputs_equal_the_paper_mode(make_engine, text_ids, budget, num_blocks):
    ps = prompts(text_ids)
    paper = make_engine(block_size=32, num_blocks=40, max_model_len=256).generate(ps, GREEDY)
    v1 = make_engine(block_size=32, num_blocks=num_blocks, max_model_len=256, semantics="v1",
                     max_num_batched_tokens=budget)
    records = []
    outs = v1.generate(ps, GREEDY, on_step=records.append)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in paper]
    assert all(r.num_tokens <= budget for r in records)
    if budget == 48:
        assert "mixed" in {r.kind for r in records}  # decode tokens and a prefill chunk in one step
    if num_blocks == 9:
        assert sum(o.num_preemptions for o in outs) > 0


def test_n_samples_are_child_requests_that_hit_the_prompt_blocks(make_engine, text_ids):
    eng = make_engine(block_size=32, num_blocks=40, max_model_len=256, semantics="v1")
    rid = eng.add_request(text_ids[:101], SamplingParams(n=4, max_tokens=6, temperature=0.0, ignore_eos=True))
    first = eng.step()
    children = eng.parents[rid]
    assert children == [f"{rid}.{i}" for i in range(4)]
    assert {s.request_id for s in first.scheduled} == set(children)
    # child 0 computes the prompt; children 1-3 find its 3 full blocks (96 tokens) cached in the same step
    assert [eng.get_output(c).num_cached_tokens for c in children] == [0, 96, 96, 96]
    assert [s.num_tokens for s in first.scheduled] == [101, 5, 5, 5]
    assert not any(e.kind == "cow" or e.kind == "fork" for e in first.events)
    while eng.has_unfinished():
        eng.step()
    out = eng.get_output(rid)
    assert out.finished and len(out.outputs) == 4 and out.num_cached_tokens == 96  # the last child's, as vLLM
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1  # greedy: four equal samples


def test_v1_records_carry_vllm_kv_events_and_round_trip(make_engine, text_ids, tmp_path):
    eng = make_engine(block_size=32, num_blocks=6, max_model_len=192, semantics="v1", max_num_batched_tokens=64)
    records = []
    other = list(reversed(text_ids))[:100]  # shares no block with the first two prompts
    eng.generate([text_ids[:70], text_ids[:70] + text_ids[150:180], other], GREEDY, on_step=records.append)
    kinds = [e["type"] for r in records for e in r.kv_events]
    assert "BlockStored" in kinds and "BlockRemoved" in kinds
    stored = [e for r in records for e in r.kv_events if e["type"] == "BlockStored"]
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == text_ids[:32]
    assert all(r.semantics == "v1" for r in records)
    path = tmp_path / "v1.jsonl"
    write_trace(records, path)
    back = list(read_trace(path))
    assert [r.kind for r in back] == [r.kind for r in records]
    assert back[0].kv_events == records[0].kv_events


@pytest.mark.parametrize("fields,message", [
    (dict(preemption_mode="swap"), "recompute only"),
    (dict(allocator="contiguous"), "paper's scheduler"),
    (dict(swap_space_blocks=4), "no swap pool"),
])
def test_v1_refuses_what_vllm_v1_does_not_have(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(semantics="v1", **fields)


def test_v1_refuses_beam_search_and_bad_priorities(make_engine, text_ids):
    eng = make_engine(block_size=32, num_blocks=20, max_model_len=256, semantics="v1")
    with pytest.raises(ValueError, match="beam"):
        eng.add_request(text_ids[:10], SamplingParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="priority"):
        eng.add_request(text_ids[:10], GREEDY, priority="high")
    assert not eng.requests  # nothing was added
    with pytest.raises(ValueError, match="semantics"):
        EngineConfig(semantics="v2")
    with pytest.raises(ValueError, match="needs semantics='v1'"):
        EngineConfig(scheduling_policy="priority")


def test_priority_policy_runs_lower_values_first(make_engine, text_ids):
    eng = make_engine(block_size=32, num_blocks=20, max_model_len=256, semantics="v1", scheduling_policy="priority",
                      max_num_seqs=1)
    low = eng.add_request(text_ids[:20], GREEDY, priority=5)
    high = eng.add_request(text_ids[40:60], GREEDY, priority=0)
    first = eng.step()
    assert [s.request_id for s in first.scheduled] == [high]
    while eng.has_unfinished():
        eng.step()
    assert eng.requests[high].finish_step < eng.requests[low].finish_step


def test_v1_watermark_default_is_zero_and_paper_keeps_one_percent():
    assert EngineConfig(semantics="v1").watermark == 0.0
    assert EngineConfig().watermark == 0.01


def test_step_record_rejects_an_unknown_kind_or_semantics(make_engine, text_ids):
    eng = make_engine(block_size=32, num_blocks=20, max_model_len=256, semantics="v1")
    eng.add_request(text_ids[:20], GREEDY)
    d = eng.step().to_dict()
    assert StepRecord.from_dict(d).semantics == "v1"
    with pytest.raises(ValueError, match="kind"):
        StepRecord.from_dict({**d, "kind": "chunk"})
    with pytest.raises(ValueError, match="semantics"):
        StepRecord.from_dict({**d, "semantics": "v0"})
