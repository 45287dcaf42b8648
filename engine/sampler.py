"""Choose the next token from logits: greedy, temperature, top-k, top-p, each request with its own seed."""

from __future__ import annotations

import torch

from .config import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token id from float32 ``logits [vocab]``.

    Greedy (temperature 0) is argmax. Otherwise: divide by temperature, keep the top-k logits (k > 0),
    keep the smallest set of most likely tokens whose probabilities sum to >= top_p (the most likely token
    always stays), renormalise and draw with the request's own ``generator`` (on the CPU, so a seed gives
    the same tokens on every device).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float().cpu() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of the tokens ranked above each
        sorted_probs[before >= params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
