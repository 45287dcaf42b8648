"""A request as the engine tracks it: its tokens, its sampling stream and its status."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    """One prompt being served.

    ``num_cached`` counts tokens whose K/V are in the pool. After each step the newest sampled token is
    not cached yet: the next decode step computes it (writes its K/V) and samples the one after.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    status: str = WAITING
    finish_reason: str | None = None
    num_cached: int = 0
    num_preemptions: int = 0
    last_block_table: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class RequestOutput:
    """The result of one request (vLLM's name).

    ``block_table`` is the request's last block table before its blocks were freed (physical block ids).
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
