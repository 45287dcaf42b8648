"""Sampling: greedy, top-k/top-p limits, and per-request seeds."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.sampler import sample

LOGITS = torch.tensor([0.1, 2.0, 1.5, -1.0, 0.3])


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0.0), gen()) == 1


def test_top_k_one_and_tiny_top_p_are_argmax():
    for seed in range(20):
        assert sample(LOGITS, SamplingParams(temperature=1.0, top_k=1), gen(seed)) == 1
        assert sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.01), gen(seed)) == 1


def test_top_k_two_only_draws_the_two_best():
    draws = {sample(LOGITS, SamplingParams(temperature=5.0, top_k=2), gen(s)) for s in range(200)}
    assert draws == {1, 2}


def test_top_p_keeps_the_nucleus():
    probs = torch.softmax(LOGITS, 0)  # 1: 0.47, 2: 0.29 -> together 0.76 >= 0.7
    assert probs[1] < 0.7 <= probs[1] + probs[2]
    draws = {sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.7), gen(s)) for s in range(300)}
    assert draws == {1, 2}


def test_temperature_draws_follow_the_softmax():
    n = 4000
    g = gen(1)
    counts = torch.bincount(torch.tensor([sample(LOGITS, SamplingParams(temperature=1.0), g) for _ in range(n)]),
                            minlength=5).float() / n
    assert torch.allclose(counts, torch.softmax(LOGITS, 0), atol=0.03)


def test_seed_reproduces_a_request_in_any_batch(make_engine, text_ids):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = make_engine(block_size=4, num_blocks=64).generate([text_ids[:7]], params)[0]
    other = SamplingParams(max_tokens=5, temperature=1.0, seed=9, ignore_eos=True)
    together = make_engine(block_size=4, num_blocks=64).generate([text_ids[:3], text_ids[:7]], [other, params])[1]
    assert alone.output_token_ids == together.output_token_ids
    different = make_engine(block_size=4, num_blocks=64).generate(
        [text_ids[:7]], SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True))[0]
    assert different.output_token_ids != alone.output_token_ids


def test_greedy_takes_the_first_of_equal_maxima():
    """Greedy ties resolve as ``argmax`` does (the lowest token id), whatever reduction the sampler uses."""
    import torch

    from engine.config import SamplingParams
    from engine.sampler import sample_batch

    logits = torch.zeros(3, 64)
    logits[0, [5, 9]] = 1.0
    logits[1, [0, 63]] = 2.0
    logits[2, 40] = 0.5
    gens = [torch.Generator().manual_seed(0) for _ in range(3)]
    assert sample_batch(logits, [SamplingParams(temperature=0.0)] * 3, gens) == [5, 0, 40]
