"""Choose next tokens from logits: greedy, temperature, top-k, top-p, each sequence with its own seed.

All sequences of a step are sampled together (one sort, one softmax over the batch); only the uniform
random number each sequence draws comes from its own ``torch.Generator``, so a seeded sequence draws the
same random numbers whatever else is in the batch. Its tokens are not guaranteed to be the same: the
logits it draws against come from a forward pass over the whole batch, whose float32 rounding can change
with the batch. Two quantities are involved, kept apart as ``lessons/batch_invariance.py``'s ``facts()``
keeps them: the **logits** (the model's raw scores, in log-probability units), which the batch can change
by some difference d; and the **cumulative probabilities** (0 to 1) the draw is compared with, which d
moves by at most e^(2d/T) - 1 at temperature T (``batch_invariance.cdf_shift_bound``). A draw that lies
closer than that shift to the boundary between two tokens' cumulative probabilities can pick the other
token. ``lessons/batch_invariance.py`` measures it (one thread, temperature 1, 116 requests of 64 tokens,
in one batch and each alone; ``lessons/data/batch_invariance.json``): the logits differed by up to 2.8e-05,
which moves a cumulative probability by at most 5.6e-05 (e^(2 x 2.8e-05) - 1); 0 of 116 seeded replies changed, and
greedy replies did not differ. On another machine, thread count or workload a draw can land within that
shift of a boundary, and the seeded reply changes. vLLM on GPUs is not batch-invariant either.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> list[int]:
    """Pick one token id per row of float32 ``logits [num_seqs, vocab]``.

    Greedy rows (temperature 0, or below ``SamplingParams.SAMPLING_EPS`` = 1e-5 as in vLLM, where dividing
    would overflow the logits to inf/nan) take the argmax. Other rows: divide by the temperature, keep the
    top-k logits (k > 0), keep the smallest set of most likely tokens whose probabilities sum to >= top_p (the
    most likely token always stays), renormalise, and invert the cumulative distribution at a uniform
    draw from the row's own generator (on the CPU, so a seed gives the same tokens on every device).
    """
    logits = logits.float().cpu()
    tokens = logits.max(dim=-1).indices  # the argmax (first of equal maxima, as argmax), 3x faster on the CPU
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        vocab = logits.shape[-1]
        temps = torch.tensor([params[i].temperature for i in rows])[:, None]
        ks = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in rows])[:, None]
        ps = torch.tensor([params[i].top_p for i in rows])[:, None]
        sorted_logits, order = torch.sort(logits[rows] / temps, dim=-1, descending=True)
        sorted_logits.masked_fill_(torch.arange(vocab)[None, :] >= ks, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each
        probs.masked_fill_(before >= ps, 0.0)
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.stack([torch.rand((), generator=generators[i]) for i in rows])[:, None] * cdf[:, -1:]
        pick = torch.searchsorted(cdf, u).clamp(max=vocab - 1)
        tokens[rows] = order.gather(-1, pick)[:, 0]
    return tokens.tolist()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One row of ``sample_batch``: a token id from float32 ``logits [vocab]``."""
    return sample_batch(logits[None], [params], [generator])[0]
