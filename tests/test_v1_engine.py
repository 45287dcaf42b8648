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
                     max_num_batched_tokens=budget, max_num_seqs=16)
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
    eng = make_engine(block_size=32, num_blocks=6, max_model_len=192, semantics="v1", max_num_batched_tokens=64,
                      max_num_seqs=16)
    records = []
    other = list(reversed(text_ids))[:100]  # shares no block with the first two prompts
    eng.generate([text_ids[:70], text_ids[:70] + text_ids[150:180], other], GREEDY, on_step=records.append)
    kinds = [e["type"] for r in records for e in r.kv_events]
    assert "BlockStored" in kinds and "BlockRemoved" in kinds
    stored = [e for r in records for e in r.kv_events if e["type"] == "BlockStored"]
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == text_ids[:64]  # 2 blocks, 1 event
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


# --------------------------------------------------------------- found by trying to break the V1 mode
def test_a_recompute_step_is_prefill_and_a_chunked_prefill_counts_whole(make_engine, text_ids):
    from engine import metrics
    eng = make_engine(block_size=4, num_blocks=10, max_model_len=40, semantics="v1", max_num_batched_tokens=16,
                      max_num_seqs=16)
    records = []
    eng.generate([text_ids[:8], text_ids[10:18], text_ids[20:28]], SamplingParams(max_tokens=12, temperature=0,
                                                                                      ignore_eos=True),
                 on_step=records.append)
    for rec in records:
        decode = [s.num_tokens == 1 and s.start_pos >= 8 and s.seq_id in rec.new_tokens for s in rec.scheduled]
        expected = "decode" if all(decode) else "prefill" if not any(decode) else "mixed"
        assert rec.kind == expected, (rec.step, rec.kind, rec.scheduled)
    counts = metrics.preemption_counts(records)
    assert counts["preemptions"] > 0
    computed = sum(s.num_tokens for r in records for s in r.scheduled)
    decoded = sum(1 for r in records for s in r.scheduled if s.num_tokens == 1 and s.start_pos >= 8
                  and s.seq_id in r.new_tokens)
    assert counts["prefill_tokens"] == computed - decoded  # every prefill and recompute chunk, not the first only


def test_children_share_the_parent_arrival_and_auto_ids_skip_child_ids(make_engine, text_ids):
    eng = make_engine(block_size=32, num_blocks=20, max_model_len=256, semantics="v1", scheduling_policy="priority")
    eng.add_request(text_ids[:10], GREEDY, request_id="R1.0")
    rid = eng.add_request(text_ids[:20], SamplingParams(n=3, max_tokens=4, temperature=0, ignore_eos=True))
    assert rid != "R1"  # "R1.0" is taken: R1's children would collide
    kids = [eng.requests[c] for c in eng.parents[rid]]
    assert len({k.arrival for k in kids}) == 1 and kids[0].arrival > eng.requests["R1.0"].arrival


def test_v1_watermark_counts_vllms_null_block(make_engine):
    eng = make_engine(block_size=32, num_blocks=8, max_model_len=128, semantics="v1", watermark=0.34)
    assert eng.scheduler.watermark_blocks == 3  # int(0.34 x (8 + vLLM's null block)), as vLLM keeps


def test_blocks_stored_in_one_allocation_are_one_event(make_engine, text_ids):
    eng = make_engine(block_size=32, num_blocks=20, max_model_len=256, semantics="v1")
    eng.add_request(text_ids[:70], GREEDY)
    stored = [e for e in eng.step().kv_events if e["type"] == "BlockStored"]
    assert len(stored) == 1 and len(stored[0]["block_hashes"]) == 2 and stored[0]["token_ids"] == text_ids[:64]
    assert stored[0]["medium"] == "GPU" and stored[0]["parent_block_hash"] is None


def test_v1_budget_below_max_num_seqs_is_refused_as_vllm_does():
    with pytest.raises(ValueError, match="max_num_batched_tokens 8 must be at least max_num_seqs 256"):
        EngineConfig(semantics="v1", max_num_batched_tokens=8)


def test_read_trace_checks_kv_events(make_engine, text_ids, tmp_path):
    import json
    eng = make_engine(block_size=32, num_blocks=20, max_model_len=256, semantics="v1")
    eng.add_request(text_ids[:70], GREEDY)
    good = eng.step().to_dict()
    bad_cases = [
        ({**good, "kv_events": [{"type": "BlockRemovedX"}]}, "BlockRemovedX"),
        ({**good, "kv_events": [{"type": "BlockRemoved", "block_hashes": []}]}, "block_hashes"),
        ({**good, "kv_events": [{**good["kv_events"][0], "token_ids": [1]}]}, "token ids"),
        ({**good, "kind": "idle"}, "idle"),
    ]
    for bad, message in bad_cases:
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=message):
            list(read_trace(path))
    second = {**good, "step": 2, "semantics": "paper"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(second) + "\n")
    with pytest.raises(ValueError, match="semantics 'paper', but the trace began in 'v1'"):
        list(read_trace(path))


def test_a_one_token_readmission_is_prefill_and_priorities_are_named(make_engine, text_ids):
    """A re-admitted request whose tokens but the last are in the prefix cache computes one token: still a
    (recompute) prefill, not a decode. Under the priority policy admissions and preemptions name priorities."""
    from viz.steps import step_parts
    eng = make_engine(block_size=4, num_blocks=7, max_model_len=28, semantics="v1", scheduling_policy="priority",
                      max_num_seqs=16, max_num_batched_tokens=16)
    for i, priority in enumerate((5, 0, 1)):
        eng.add_request(text_ids[20 * i: 20 * i + 5], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        priority=priority)
    records = []
    while eng.has_unfinished():
        records.append(eng.step())
    admitted_one = [(r, s) for r in records for s in r.scheduled if s.num_tokens == 1
                    and any(e.kind == "admit" and e.request_id == s.request_id for e in r.events)]
    assert admitted_one  # this run has one: a re-admission with all but its last token cached
    for rec, s in admitted_one:
        assert next(p for p in step_parts(rec) if p["seq_id"] == s.seq_id)["kind"] == "prefill"
    for rec in records:  # the engine's kind and the figures' parts agree on every step
        kinds = {p["kind"] for p in step_parts(rec)}
        assert rec.kind == ("mixed" if len(kinds) == 2 else kinds.pop() if kinds else "idle"), rec.step
    messages = [e.message for r in records for e in r.events if e.kind in ("admit", "preempt")]
    assert messages and all("(priority " in m for m in messages)
    assert any("(priority 5)" in m and "preempted" in m for m in messages)
