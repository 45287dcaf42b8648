"""Paging is exact: the paged engine computes what transformers computes.

Greedy tokens must equal ``model.generate`` token for token, and the logits of every step must match a
full forward pass of transformers at the same position (atol 1e-4, float32, CPU), for several block sizes,
for prompt lengths around block boundaries, for a mixed batch, and for requests preempted and recomputed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import capture_logits

from engine import SamplingParams
MAX_NEW = 20
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def hf_greedy(hf_model, prompt_ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new)
    return out[0, len(prompt_ids):].tolist()


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([token_ids])).logits[0].float()


def prompt_lengths(block_size: int) -> list[int]:
    lengths = {1, block_size - 1, block_size, block_size + 1, 3 * block_size}
    return sorted(n for n in lengths if n >= 1)


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_greedy_tokens_and_logits_match_transformers(block_size, make_engine, hf_model, text_ids):
    engine = make_engine(block_size=block_size, num_blocks=max(64, 1024 // block_size))
    logits = capture_logits(engine)
    for n in prompt_lengths(block_size):
        prompt = text_ids[:n]
        [out] = engine.generate([prompt], GREEDY)
        expected = hf_greedy(hf_model, prompt)
        assert out.output_token_ids == expected, f"block_size {block_size}, prompt length {n}"
        # logits of step j predict output token j, i.e. position n - 1 + j of the full sequence
        full = hf_logits(hf_model, prompt + out.output_token_ids)
        ours = torch.stack(logits[out.request_id])
        assert ours.shape[0] == len(out.output_token_ids)
        torch.testing.assert_close(ours, full[n - 1 : n - 1 + ours.shape[0]], atol=1e-4, rtol=0)
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_mixed_batch_runs_together_and_matches(make_engine, hf_model, text_ids):
    engine = make_engine(block_size=16, num_blocks=64)
    prompts = [text_ids[:n] for n in (1, 15, 16, 17, 48, 5)]
    seen_batch_sizes = []
    outs = engine.generate(prompts, GREEDY, on_step=lambda r: seen_batch_sizes.append(len(r.scheduled)))
    assert max(seen_batch_sizes) == len(prompts)  # they really decoded together
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(hf_model, prompt)


def test_preempted_and_recomputed_requests_match(make_engine, hf_model, text_ids):
    # 10 blocks of 4 = 40 slots: four requests of up to 12 + 20 tokens cannot all grow, so some are
    # preempted (blocks freed) and later prefilled again over prompt + generated tokens.
    engine = make_engine(block_size=4, num_blocks=10, max_model_len=40)
    prompts = [text_ids[:n] for n in (12, 7, 9, 5)]
    preempted = []
    outs = engine.generate(prompts, GREEDY, on_step=lambda r: preempted.extend(
        e.request_id for e in r.events if e.kind == "preempt"))
    assert preempted, "the pool should have been too small for all four requests"
    assert sum(o.num_preemptions for o in outs) == len(preempted)
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(hf_model, prompt), out.request_id
