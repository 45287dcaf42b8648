"""Requests and their sequences, as the engine tracks them.

A ``Request`` is what a user submitted (one prompt, one ``SamplingParams``). It owns one or more
``Sequence``s (vLLM's "sequence group"): one for plain generation, ``n`` for parallel sampling, up to
``beam_width`` live beams for beam search. Block tables belong to sequences; scheduling (admission,
preemption, swapping) works on whole requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .records import SeqStatus

WAITING, RUNNING, SWAPPED, FINISHED = SeqStatus.WAITING, SeqStatus.RUNNING, SeqStatus.SWAPPED, SeqStatus.FINISHED


def generator_for(seed: int, index: int) -> torch.Generator:
    """The random stream of a request's sample ``index`` (on the CPU: a seed gives the same tokens on every
    device): seeded ``seed + index``, as vLLM seeds a request's ``n`` samples."""
    return torch.Generator(device="cpu").manual_seed(seed + index)


@dataclass
class Sequence:
    """One token stream with its own block table.

    ``num_computed_tokens`` (vLLM's name) counts tokens whose K/V are in the pool. After each step the
    newest sampled token is not computed yet: the next decode step computes it (writes its K/V) and samples
    the one after.
    """

    seq_id: str
    token_ids: list[int]
    prompt_len: int
    generator: torch.Generator | None = None
    num_computed_tokens: int = 0
    status: SeqStatus = WAITING
    finish_reason: str | None = None
    score: float = 0.0  # beam search: accumulated log-probability
    last_block_table: list[int] = field(default_factory=list)
    last_group_block_tables: list[list[int]] = field(default_factory=list)  # KV cache groups: each one's last

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class BeamState:
    """Beam search bookkeeping, mirroring transformers' ``_beam_search`` (v5) so results match it.

    ``finished`` holds up to ``beam_width`` hypotheses as (length-penalised score, token ids, reason),
    best first; ``improvable`` is transformers' early-stop heuristic (early_stopping=False).
    """

    finished: list[tuple[float, list[int], str]] = field(default_factory=list)
    improvable: bool = True
    next_beam: int = 1


@dataclass
class Request:
    """One submitted prompt and its sequences.

    ``max_len``: the most tokens (prompt + generated) a sequence may reach: prompt + max_tokens, capped at
    the maximum model length and at ``reservation``, the slots the contiguous allocator reserves for it:
    an int (one sequence), a tuple of ints (one row per sample or beam, each the same size, all reserved at
    admission), or None (the paged allocator). ``final_len``: its true final length when known in advance (the
    contiguous "pow2" and "oracle" policies need it).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    seqs: list[Sequence] = field(default_factory=list)
    status: SeqStatus = WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    beam: BeamState | None = None
    finish_step: int = -1
    max_len: int = 0
    reservation: int | tuple[int, ...] | None = None  # slots; a tuple: one row per sample or beam
    priority: int = 0  # V1's priority policy: lower runs first (vLLM's SamplingParams-level priority)
    arrival: int = 0  # order of arrival (vLLM's arrival_time): the tie-break of the priority policy
    parent_id: str | None = None  # V1: the request whose n samples this child request is one of
    num_cached_tokens: int = -1  # V1: prefix-cache hit of its first admission, tokens (vLLM's RequestOutput)

    @property
    def max_num_running_seqs(self) -> int:
        """Sequences this request may run at once: all ``n`` samples / beams until it produced a token
        (they are forked after the prompt's prefill), then its live ones (vLLM v0's
        ``get_max_num_running_seqs``)."""
        if not any(s.output_token_ids for s in self.seqs) and len(self.seqs) == 1:
            return self.params.num_seqs
        return len(self.live_seqs)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status != FINISHED]

    @property
    def is_beam_search(self) -> bool:
        return self.beam is not None


@dataclass
class CompletionOutput:
    """One sample or beam of a request (vLLM's name). ``score``: accumulated log-probability for samples,
    length-penalised beam score for beams."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    score: float = 0.0


@dataclass
class RequestOutput:
    """The result of one request (vLLM's name).

    ``outputs`` has one entry per sample (``n``) or beam (best first). The top-level ``output_token_ids``,
    ``output_text`` and ``finish_reason`` are those of ``outputs[0]``. ``block_table`` is the first
    sequence's last block table before its blocks were freed (physical block ids).
    ``finish_reason``: "stop" (EOS), "length" (max_tokens or max_model_len) or None while running.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str
    finish_reason: str | None
    block_table: list[int]
    num_preemptions: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int | None = None  # V1: prompt tokens its first admission found in the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
