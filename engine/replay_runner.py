"""A model runner that replays the tokens of an earlier run instead of running the model (Compare's contiguous
baselines: the same requests, already run once on the paged engine).

Why: Compare runs one workload on the paged engine and then on the contiguous baseline under four reservation
policies. Every sequence's tokens are decided by its own history only (its prompt, its earlier tokens, its own
seeded random stream: ``engine.sampler``), so on the baseline each sequence samples the tokens it sampled on
the paged engine under the same scheduler; what differs between the runs is the memory: which requests are
admitted when, what each reserves, who is preempted. Rerunning the model for those tokens took 24-43 s of a
first Compare run on a 2-core CPU; replaying them takes the scheduler's and the records' time only.

How: ``ReplayRunner`` has the model runner's interface (``execute_model(SchedulerOutput)`` -> logits ``[vocab]``
per sampling sequence, ``engine.model_runner.ModelRunner``) and reads only the ``SchedulerOutput``. For each
scheduled sequence that samples, the next token is at position ``num_computed_tokens + len(token_ids)``; the
runner looks it up in the earlier run's token ids of the same sequence id and returns a row whose only finite
logit is that token's (0; every other -inf). The engine's own sampler then picks it: greedy takes the argmax;
a seeded or random row divides by the temperature, keeps top-k / top-p (the one token always stays: it holds
all the probability) and inverts the distribution at its own uniform draw, which can only land on it, and each
row draws once from its sequence's generator as in a real run. So the scheduler, the allocator, its events,
the snapshots and the records are exactly what a real run gives (``tests/test_replay_runner.py`` compares them
field by field with a real run on every preset, chat-workload's preemptions included). The n samples of the
paper's semantics are forked after their prompt's prefill and sample from its logits (``sample_from``): the
runner returns each child's own row, which the engine keeps.

What must hold, and is checked: the sequence ids and prompts are those of the earlier run (the same workload
added in the same order: ids "R1", "R2", ..., samples "R1.0", "R1.1", ...), and its tokens are the ones this
scheduler would sample. Each step the runner checks that the tokens it is asked to compute equal the earlier
run's at those positions, and raises ``ReplayMismatch`` (a ``LookupError``) naming the sequence and position
when they do not or when the earlier run has no token there; ``run_spec.run_paged_then_contiguous`` then
reruns that baseline on the real model. The earlier run must have used the baseline's scheduler (the paper's):
a V1 run batches differently and its float32 rounding may move a seeded draw (``engine.sampler``), so a V1
Compare replays a headless paper run of the same requests, the one that also learns the final lengths.

Not replayed: beam search. Which beams continue depends on every candidate's log-probability and on each
beam's length limit (``engine.beam_search``), and the records keep only the chosen tokens; on the baseline
a row shorter than the paged run's limit changes the search. A workload with a beam search runs its baselines
on the real model (``replayable``). No log-probabilities or prompt log-probabilities are recorded anywhere
(samples' ``score`` stays 0), and the text of a token is decoded from its id, so nothing else depends on logits.
"""

from __future__ import annotations

import torch


class ReplayMismatch(LookupError):
    """The run being replayed asked for a token the earlier run does not have, or computed other tokens."""


def replayable(workload) -> bool:
    """Whether a workload's baselines can be replayed: no request runs a beam search (see the module)."""
    return all(r.params.beam_width <= 1 for r in workload.requests)


def tokens_by_sequence(engine) -> dict[str, list[int]]:
    """Every sequence's token ids (prompt + generated) at the end of ``engine``'s run, by sequence id."""
    return {s.seq_id: list(s.token_ids) for req in engine.requests.values() for s in req.seqs}


class ReplayRunner:
    """``ModelRunner``'s interface, answering from ``tokens`` (sequence id -> its token ids, prompt included:
    ``tokens_by_sequence`` of an earlier run) instead of the model. ``vocab_size``: the rows' length."""

    def __init__(self, tokens: dict[str, list[int]], vocab_size: int) -> None:
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.num_replayed = 0  # tokens answered so far

    def execute_model(self, output) -> dict[str, torch.Tensor]:
        """For every sequence of ``output`` (a ``SchedulerOutput``) that samples, and every sample forked from
        one (``sample_from``), a float32 row ``[vocab]`` that only its recorded next token can be sampled from.
        Data movement (``kv_ops``) and K/V need no tensors here. Raises ``ReplayMismatch``."""
        rows: dict[str, torch.Tensor] = {}
        position: dict[str, int] = {}
        for s in output.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            known = self._tokens_of(s.seq_id)
            if known[start:end] != s.token_ids:
                raise ReplayMismatch(f"sequence {s.seq_id!r} computes tokens {start}..{end - 1} that differ from "
                                     f"the run being replayed")
            if s.sample:
                position[s.seq_id] = end
        for child, parent in output.sample_from.items():
            if parent in position:
                position[child] = position[parent]
        for seq_id, pos in position.items():
            known = self._tokens_of(seq_id)
            if pos >= len(known):
                raise ReplayMismatch(f"sequence {seq_id!r} samples position {pos}, but the run being replayed "
                                     f"ended it at {len(known)} tokens")
            row = torch.full((self.vocab_size,), float("-inf"))
            row[known[pos]] = 0.0
            rows[seq_id] = row
        self.num_replayed += len(rows)
        return rows

    def _tokens_of(self, seq_id: str) -> list[int]:
        known = self.tokens.get(seq_id)
        if known is None:
            raise ReplayMismatch(f"sequence {seq_id!r} is not in the run being replayed")
        return known
