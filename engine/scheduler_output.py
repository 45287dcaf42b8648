"""The contract between the scheduler and the model runner: what one step computes, as plain data
(vLLM V1's ``vllm/v1/core/sched/output.py``: ``SchedulerOutput``).

The scheduler decides (``Scheduler.schedule``) and writes it down here; the model runner reads only this
(``ModelRunner.execute_model``): it applies ``kv_ops`` to the KV tensors, then computes each scheduled
sequence's ``token_ids`` at positions ``num_computed_tokens ..`` with its K/V written to
``slot_mappings[g]`` and read through ``block_tables[g]``, one per KV cache group ``g`` (vLLM's
``NewRequestData.block_ids``, a tuple with one list per group): a model whose layers all attend to every
token has one group; a hybrid model one per kind of layer (``engine.single_type_kv_cache_manager``), and a
sliding-window group's table holds -1, the null block, where its blocks left the window (no token computed
now reads or writes there).
The engine samples from the logits and hands the tokens back (``Scheduler.update_from_output``), which
appends, finishes, frees and forks. Nothing here is a live object: lists of ints and strings only.

Units: tokens; slot ids ``block_id * block_size + offset`` (the contiguous baseline: a slot of its flat
region, ``block_size`` 1, with ``region_start`` the first slot of the sequence's row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class ScheduledSeqData:
    """One sequence's share of a step (vLLM: a request's ``NewRequestData`` / ``CachedRequestData``; here a
    request of the paper's semantics may hold several sequences: samples, beams).

    ``token_ids``: the tokens computed now, at positions ``num_computed_tokens .. + len(token_ids) - 1``.
    ``sample``: after this step every token of the sequence is computed, so its last token's logits are
    sampled (a V1 prefill chunk short of the prompt's end is computed but not sampled)."""

    req_id: str
    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_tables: tuple[list[int], ...]
    slot_mappings: tuple[list[int], ...]
    region_start: int = 0
    sample: bool = True

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """What the scheduler decided for step ``step``.

    ``kind``: "prefill" | "decode" | "mixed" | "idle". ``scheduled``: the sequences computed, in batch order.
    ``kv_ops``: data movement the KV tensors do first, in order: ("copy", src, dst) copy-on-write,
    ("swap_out", gpu, cpu), ("swap_in", cpu, gpu). ``sample_from``: sequences that sample this step from
    another's logits, child -> parent (the paper's ``n`` samples, forked right after their prompt's
    prefill). ``preempted_req_ids``: requests preempted while scheduling this step; ``finished_req_ids``:
    requests that finished since the previous step's schedule (vLLM's ``finished_req_ids``)."""

    step: int
    kind: str
    scheduled: list[ScheduledSeqData] = field(default_factory=list)
    kv_ops: list[tuple[str, int, int]] = field(default_factory=list)
    sample_from: dict[str, str] = field(default_factory=dict)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @cached_property
    def req_ids(self) -> list[str]:
        """The requests that ran, each once, in batch order."""
        return list(dict.fromkeys(s.req_id for s in self.scheduled))
