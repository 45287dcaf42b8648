"""Beam search over the paged pool (the paper's semantics: Kwon et al., SOSP 2023, section 4.4), scored
exactly as transformers' ``_beam_search`` (v5), so the lab's beams equal ``model.generate``'s.

One step, given the logits of every live beam's last token: the top 2w continuations over all beams by
accumulated log-probability; the best w that did not stop keep running; stopped ones among the top w enter
the finished list with score / generated_length ** length_penalty; the search ends when no running beam can
beat the worst finished one (early_stopping=False) or every continuation stops.

This module decides; it changes no block table. ``decide`` returns a ``BeamDecision`` (which beam continues
with which token) and the scheduler applies it (``Scheduler.update_from_output``): the first beam that
continues a parent reuses the parent's sequence, the others fork it (sharing its blocks; the next write
copies the shared last block), and parents nobody continues are freed ("pruned"), as vLLM V0's output
processor forks the sequences its sampler chose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .sequence import Request, Sequence

BEAM_NEG = -1.0e9  # transformers' "impossible" beam score


@dataclass
class BeamDecision:
    """What one beam-search step decided for a request.

    ``done``: the search ended (``reason``: why the best hypothesis ended, "stop" or "length"); otherwise
    ``continuing`` lists the w running beams for the next step, best first, as (index of the live beam it
    continues, token, running score)."""

    done: bool
    reason: str | None = None
    continuing: tuple[tuple[int, int, float], ...] = ()


@dataclass
class _Candidates:
    """One step's 2w candidates (best first): accumulated ``scores``, the live beam each continues
    (``parents``), its ``tokens``, whether it ``stops``, ``running_scores`` (stopped ones pushed down), the
    indices of the w that ``keep`` running and the beams' new ``length``."""

    scores: torch.Tensor
    parents: list[int]
    tokens: list[int]
    stops: torch.Tensor
    running_scores: torch.Tensor
    keep: list[int]
    length: int


def decide(req: Request, rows: dict, is_stop: Callable[[object, int], bool]) -> BeamDecision:
    """One step of ``req``'s beam search on its live beams' logits ``rows`` (seq id -> ``[vocab]``); updates
    ``req.beam`` (the finished hypotheses, the stopping heuristic). ``is_stop(params, token)``: whether a
    token ends a reply."""
    live = req.live_seqs
    c = _candidates(req, live, rows, is_stop)
    req.beam.finished = _hypotheses(req, live, c, is_stop)
    if _done(req, c):
        return BeamDecision(True, req.beam.finished[0][2] or "length")
    keep = tuple((c.parents[j], c.tokens[j], float(c.running_scores[j])) for j in c.keep)
    return BeamDecision(False, continuing=keep)


def best_length(req: Request) -> int:
    """Generated tokens of the best finished hypothesis (0 if none)."""
    best = next((ids for _, ids, _ in req.beam.finished if ids is not None), None)
    return len(best) - len(req.prompt_token_ids) if best else 0


def _candidates(req: Request, live: list[Sequence], rows: dict, is_stop) -> _Candidates:
    """The top 2w continuations over all live beams by accumulated log-probability, which of them stop
    (EOS, a stop token, or the length limit), and the w that keep running (transformers' steps a-e)."""
    w = req.params.beam_width
    log_probs = torch.log_softmax(torch.stack([rows[s.seq_id] for s in live]).float().cpu(), dim=-1)
    vocab = log_probs.shape[-1]
    accumulated = (log_probs + torch.tensor([s.score for s in live])[:, None]).reshape(-1)
    scores, index = torch.topk(accumulated, 2 * w)
    tokens = (index % vocab).tolist()
    length = live[0].num_tokens + 1  # every beam's length after this step
    stops = torch.tensor([is_stop(req.params, t) or length >= req.max_len for t in tokens])
    running_scores = scores + stops.to(torch.float32) * BEAM_NEG
    return _Candidates(scores, (index // vocab).tolist(), tokens, stops, running_scores,
                       torch.topk(running_scores, w)[1].tolist(), length)


def _hypotheses(req: Request, live: list[Sequence], c: _Candidates, is_stop) -> list:
    """The w best finished hypotheses so far: the old ones merged with the candidates among the top w
    that stopped, each scored by score / generated_length ** length_penalty (transformers' step f)."""
    p, beam = req.params, req.beam
    w, prompt_len = p.beam_width, len(req.prompt_token_ids)
    just_finished = c.stops & (torch.arange(2 * w) < w)
    fin = c.scores / ((c.length - prompt_len) ** p.length_penalty)
    fin = fin + float(not beam.improvable) * BEAM_NEG
    fin = fin + (~just_finished).to(torch.float32) * BEAM_NEG
    merged = torch.cat([torch.tensor([f[0] for f in beam.finished], dtype=torch.float32), fin])
    best = []
    for k in torch.topk(merged, w)[1].tolist():
        if k < w:
            best.append(beam.finished[k])
            continue
        j = k - w
        token = c.tokens[j]
        reason = None
        if bool(just_finished[j]):
            reason = "stop" if is_stop(p, token) else "length"
        best.append((float(merged[k]), live[c.parents[j]].token_ids + [token], reason))
    return best


def _done(req: Request, c: _Candidates) -> bool:
    """transformers' stopping heuristic (step g, early_stopping=False): done when the best running beam
    cannot beat the worst finished hypothesis, or when every candidate stopped."""
    p, beam = req.params, req.beam
    best_running = c.running_scores[c.keep[0]] / ((c.length - len(req.prompt_token_ids)) ** p.length_penalty)
    scores = torch.tensor([f[0] for f in beam.finished], dtype=torch.float32)
    done = torch.tensor([f[2] is not None for f in beam.finished])
    worst = torch.where(done, scores.min(), torch.tensor(BEAM_NEG))
    beam.improvable = beam.improvable and bool(torch.any(best_running > worst))
    return not beam.improvable or bool(c.stops.all())
