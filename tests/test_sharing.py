"""Sharing on the real model: parallel sampling, beam search, prefix caching, swapping.

Everything is checked against running without sharing (or against transformers), greedy, float32.
"""

from __future__ import annotations

import pytest
import torch
from conftest import capture_logits

from engine import SamplingParams
GREEDY = dict(temperature=0.0)


# ------------------------------------------------------------------------------------ parallel sampling
def test_parallel_samples_equal_independent_requests(make_engine, text_ids):
    """Sample i of n (seed s) equals a lone request with seed s + i run without any sharing."""
    prompt = text_ids[:21]  # ends mid-block at B=8: every sample but the last copies the shared block
    shared = make_engine(block_size=8, num_blocks=64)
    records = []
    [out] = shared.generate([prompt], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7),
                            on_step=records.append)
    assert len(out.outputs) == 4
    alone = make_engine(block_size=8, num_blocks=64, enable_prefix_caching=False)
    for i, sample in enumerate(out.outputs):
        [ref] = alone.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i))
        assert sample.token_ids == ref.output_token_ids, f"sample {i}"
    events = [e for r in records for e in r.events]
    assert sum(e.kind == "fork" for e in events) == 3
    cows = [e for e in events if e.kind == "cow"]
    assert len(cows) == 3  # 4 sharers of a partly filled block: 3 copy, the last writes in place
    assert len({e.data["src"] for e in cows}) == 1


def test_parallel_sampling_memory_is_not_n_times(make_engine, text_ids):
    """n=4 of a 100-token prompt at B=16: 7 shared prompt blocks plus 3 copies, not 4 x 7."""
    engine = make_engine(block_size=16, num_blocks=64)
    rid = engine.add_request(text_ids[:100], SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=1))
    prefill = engine.step()
    assert prefill.snapshot.num_used_blocks == 7
    assert max(prefill.snapshot.ref_counts) == 4
    decode = engine.step()
    assert decode.snapshot.num_used_blocks == 7 + 3
    assert sum(e.kind == "cow" for e in decode.events) == 3
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == 64
    assert len(engine.get_output(rid).outputs) == 4


# ---------------------------------------------------------------------------------------- beam search
def hf_beam(hf_model, prompt, width, max_new, length_penalty=1.0):
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
                            max_new_tokens=max_new, length_penalty=length_penalty, early_stopping=False)
    tokens = out[0, len(prompt):].tolist()
    eos = hf_model.generation_config.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("n_prompt, width, max_new, penalty", [(7, 4, 12, 1.0), (16, 3, 16, 1.0), (3, 2, 10, 0.5)])
def test_beam_search_matches_transformers(n_prompt, width, max_new, penalty, make_engine, hf_model, text_ids):
    engine = make_engine(block_size=4, num_blocks=128)
    prompt = text_ids[:n_prompt]
    records = []
    [out] = engine.generate([prompt], SamplingParams(beam_width=width, max_tokens=max_new,
                                                     length_penalty=penalty), on_step=records.append)
    assert out.output_token_ids == hf_beam(hf_model, prompt, width, max_new, penalty)
    assert len(out.outputs) == width
    assert [o.score for o in out.outputs] == sorted((o.score for o in out.outputs), reverse=True)
    events = [e for r in records for e in r.events]
    assert any(e.kind == "fork" for e in events)  # beams really share their prefix blocks
    assert engine.block_manager.num_free_blocks == 128


def test_beam_search_shares_prefix_blocks(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=128, enable_prefix_caching=False)
    engine.add_request(text_ids[:12], SamplingParams(beam_width=4, max_tokens=8))
    max_shared = 0
    while engine.has_unfinished():
        snap = engine.step().snapshot
        live = [s for s in snap.sequences if s.status == "running"]
        if len(live) == 4:
            entries = sum(len(s.block_table) for s in live)
            assert snap.num_used_blocks < entries  # fewer physical blocks than table entries
            max_shared = max(max_shared, max(snap.ref_counts))
    assert max_shared >= 2


# ------------------------------------------------------------------------------------- prefix caching
def run_both(make_engine, prompts, params, block_size=4, **kw):
    """The same prompts with and without prefix caching: outputs, logits per request, records."""
    results = []
    for caching in (True, False):
        engine = make_engine(block_size=block_size, num_blocks=96, enable_prefix_caching=caching, **kw)
        logits = capture_logits(engine)
        records = []
        outs = []
        for group in prompts:  # each group is admitted together, groups one after another
            outs += engine.generate(group, params, on_step=records.append)
        results.append((outs, logits, records, engine))
    return results


def assert_same(cached, plain):
    (outs_c, logits_c, _, _), (outs_p, logits_p, _, _) = cached, plain
    assert [o.output_token_ids for o in outs_c] == [o.output_token_ids for o in outs_p]
    for oc, op in zip(outs_c, outs_p):
        torch.testing.assert_close(torch.stack(logits_c[oc.request_id]), torch.stack(logits_p[op.request_id]),
                                   atol=1e-4, rtol=0)


def hit_tokens(records):
    return sum(e.data["num_tokens"] for r in records for e in r.events if e.kind == "prefix_hit")


def test_second_identical_request_hits_and_matches(make_engine, text_ids):
    params = SamplingParams(max_tokens=8, **GREEDY)
    cached, plain = run_both(make_engine, [[text_ids[:14]], [text_ids[:14]]], params)
    assert_same(cached, plain)
    assert hit_tokens(cached[2]) == 12  # 3 full blocks of 4; the block with the last token is recomputed
    assert hit_tokens(plain[2]) == 0


def test_prompt_of_exactly_k_blocks_fully_cached(make_engine, text_ids):
    params = SamplingParams(max_tokens=6, **GREEDY)
    cached, plain = run_both(make_engine, [[text_ids[:16]], [text_ids[:16]]], params)
    assert_same(cached, plain)
    # 4 full blocks are cached, but the last prompt token must be computed: 3 blocks hit, 1 token recomputed
    assert hit_tokens(cached[2]) == 12
    second = [r for r in cached[2] if r.kind == "prefill"][1]
    assert [s.num_tokens for s in second.scheduled] == [4]


def test_identical_prompts_admitted_in_the_same_step(make_engine, text_ids):
    params = SamplingParams(max_tokens=6, **GREEDY)
    cached, plain = run_both(make_engine, [[text_ids[:13], text_ids[:13]]], params)
    assert_same(cached, plain)
    first = cached[2][0]
    assert first.kind == "prefill" and len(first.scheduled) == 2
    assert [s.num_tokens for s in first.scheduled] == [13, 1]  # the second reuses the first's fresh blocks


def test_batch_where_one_hits_and_one_misses(make_engine, text_ids):
    params = SamplingParams(max_tokens=6, **GREEDY)
    other = text_ids[50:60]
    cached, plain = run_both(make_engine, [[text_ids[:12]], [text_ids[:12] + [7], other]], params)
    assert_same(cached, plain)
    second = [r for r in cached[2] if r.kind == "prefill"][1]
    assert [s.num_tokens for s in second.scheduled] == [1, 10]


def test_short_prompt_gets_no_hit_and_no_error(make_engine, text_ids):
    engine = make_engine(block_size=16, num_blocks=32)
    records = []
    engine.generate([text_ids[:5], text_ids[:5]], SamplingParams(max_tokens=3, **GREEDY), on_step=records.append)
    assert hit_tokens(records) == 0


# -------------------------------------------------------------------------------------------- swapping
def test_swap_out_and_in_matches_a_roomy_pool(make_engine, text_ids):
    prompts = [text_ids[:n] for n in (9, 6, 11, 7)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    tight = make_engine(block_size=4, num_blocks=14, max_model_len=32, preemption_mode="swap",
                        enable_prefix_caching=False)
    records = []
    outs = tight.generate(prompts, params, on_step=records.append)
    kinds = [e.kind for r in records for e in r.events]
    assert "swap_out" in kinds and "swap_in" in kinds
    preempts = [e for r in records for e in r.events if e.kind == "preempt"]
    assert all(e.data["mode"] == "swap" for e in preempts)
    roomy = make_engine(block_size=4, num_blocks=64, enable_prefix_caching=False)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in roomy.generate(prompts, params)]
    assert tight.block_manager.num_free_blocks == 14
    assert tight.block_manager.num_free_swap_blocks == tight.block_manager.num_swap_blocks


def test_full_swap_pool_falls_back_to_recompute(make_engine, text_ids):
    prompts = [text_ids[:n] for n in (9, 6, 11, 7)]
    params = SamplingParams(max_tokens=16, **GREEDY)
    engine = make_engine(block_size=4, num_blocks=14, max_model_len=32, preemption_mode="swap",
                         swap_space_blocks=1, enable_prefix_caching=False)
    records = []
    outs = engine.generate(prompts, params, on_step=records.append)
    modes = {e.data["mode"] for r in records for e in r.events if e.kind == "preempt"}
    assert modes == {"recompute"}
    roomy = make_engine(block_size=4, num_blocks=64, enable_prefix_caching=False)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in roomy.generate(prompts, params)]
