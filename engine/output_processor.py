"""Requests out: what a request's state reads as for its caller and for a step's snapshot (vLLM V1's
``vllm/v1/engine/output_processor.py``: ``RequestOutput`` from the engine's requests).

Pure functions of a ``Request``, the allocator's tables (``table_of``) and a decode function: nothing here
changes the engine.
"""

from __future__ import annotations

import dataclasses

from .records import SequenceState, kv_cache_group_dicts
from .sequence import FINISHED, CompletionOutput, Request, RequestOutput


def sequence_states(req: Request, allocator) -> tuple[SequenceState, ...]:
    """The snapshot's view of each sequence of ``req`` now (a finished one with its last block table)."""
    states = []
    num_groups = len(kv_cache_group_dicts(getattr(allocator, "groups", None)))
    for seq in req.seqs:
        held = allocator.table_of(seq.seq_id)
        table, n = held if held else (seq.last_block_table if seq.status == FINISHED else [], 0)
        groups = []  # every KV cache group's table (a hybrid model's; SequenceState.group_block_tables)
        if num_groups:
            groups = (allocator.group_block_tables(seq.seq_id) if held
                      else seq.last_group_block_tables if seq.status == FINISHED and seq.last_group_block_tables
                      else [list(table)] * num_groups)  # holds nothing: every group's table is as empty
        states.append(SequenceState(
            seq_id=seq.seq_id, request_id=req.request_id, status=seq.status, prompt_len=seq.prompt_len,
            num_generated=len(seq.output_token_ids), num_tokens=n, block_table=list(table),
            token_ids=list(seq.token_ids), finish_reason=seq.finish_reason,
            group_block_tables=[list(t) for t in groups],
        ))
    return tuple(states)


def request_output(req: Request, decode, allocator, v1: bool) -> RequestOutput:
    """``req``'s output so far: one entry per sample in sample order, or per beam hypothesis best first
    (while a beam search runs: its live beams); ``decode(token ids) -> text``; ``v1``: report
    ``num_cached_tokens`` (V1 semantics)."""
    prompt_len = len(req.prompt_token_ids)
    if req.is_beam_search and req.status == FINISHED:
        hyps = [h for h in req.beam.finished if h[1] is not None]
        outputs = [CompletionOutput(i, ids[prompt_len:], decode(ids[prompt_len:]), reason, score)
                   for i, (score, ids, reason) in enumerate(hyps)]
    else:
        outputs = [CompletionOutput(i, s.output_token_ids, decode(s.output_token_ids), s.finish_reason, s.score)
                   for i, s in enumerate(req.seqs)]
    first = req.seqs[0] if req.seqs else None
    table = []
    if first is not None:
        held = allocator.table_of(first.seq_id)
        table = held[0] if held else first.last_block_table
    best = outputs[0]
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
        output_token_ids=list(best.token_ids), output_text=best.text,
        finish_reason=req.finish_reason if req.status == FINISHED else None, block_table=list(table),
        num_preemptions=req.num_preemptions, outputs=outputs,
        num_cached_tokens=req.num_cached_tokens if v1 and req.num_cached_tokens >= 0 else None,
    )


def parent_output(request_id: str, kids: list[RequestOutput], kid_requests: list[Request]) -> RequestOutput:
    """V1: the output of a request with n > 1, gathered from its child requests' outputs ``kids`` (sample i =
    child i). Finished when every child is. ``num_cached_tokens`` is that of the child that finished last
    (the later one of a step), as vLLM's ``ParentRequest`` reports it; each child's own is on its output."""
    last = max(range(len(kids)), key=lambda i: (kid_requests[i].finish_step, i))
    outputs = [dataclasses.replace(k.outputs[0], index=i, finish_reason=k.finish_reason)
               for i, k in enumerate(kids)]
    first = kids[0]
    done = all(k.finished for k in kids)
    return RequestOutput(
        request_id=request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
        output_token_ids=list(first.output_token_ids), output_text=first.output_text,
        finish_reason=first.finish_reason if done else None, block_table=first.block_table,
        num_preemptions=sum(k.num_preemptions for k in kids), outputs=outputs,
        num_cached_tokens=kids[last].num_cached_tokens,
    )
