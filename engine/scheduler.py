"""Continuous batching with preemption by recompute (vLLM v0's scheduling policy, simplified).

Each step is either a prefill step or a decode step:
- prefill: admit waiting requests in arrival order (first come, first served) while their tokens' blocks
  fit in the free pool, the batch has room (``max_num_seqs``) and the step's token budget
  (``max_num_batched_tokens``) allows. Admission stops at the first request that does not fit, so a long
  request is never starved by shorter ones behind it.
- decode: when nobody can be admitted, every running request computes one token. A request whose last
  block is full needs a fresh block; if none is free, the most recently admitted running request is
  preempted by recompute: its blocks are freed and it goes back to the *front* of the waiting queue, to be
  prefilled again later over prompt + generated tokens (Kwon et al., SOSP 2023, section 4.5). The victim
  may be the requester itself.

Finished requests leave the batch at once (``finish``) and new ones join between steps.

No deadlock: the engine guarantees ``max_model_len <= num_blocks * block_size``, so one request alone can
always grow to its end; preemption empties the pool down to that one request if needed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .records import Event
from .sequence import FINISHED, RUNNING, WAITING, Request


@dataclass
class Batch:
    """What the scheduler chose for one step: ``kind`` and the requests with their new-token counts."""

    kind: str  # "prefill" | "decode" | "idle"
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the preemption victim

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = self._schedule_prefill()
        if batch.requests:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> Batch:
        batch = Batch("prefill")
        tokens = 0
        bm = self.block_manager
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens  # prompt, plus generated tokens when recomputing after preemption
            if tokens + n > self.max_num_batched_tokens or not bm.can_allocate(n):
                break
            self.waiting.popleft()
            bm.allocate(req.request_id, n)
            req.status = RUNNING
            req.num_cached = n
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            tokens += n
            verb = "re-admitted (recompute)" if req.num_preemptions else "admitted"
            bm.events.append(Event("admit", req.request_id, [], f"{req.request_id} {verb}: prefill of {n} tokens"))
        return batch

    def _schedule_decode(self) -> Batch:
        batch = Batch("decode" if self.running else "idle")
        bm = self.block_manager
        for req in list(self.running):
            if req.status != RUNNING:  # preempted earlier in this loop
                continue
            while not bm.can_append(req.request_id):
                victim = self.running[-1]
                self.preempt(victim, reason=f"{req.request_id} needs a new block and none is free")
                if victim is req:
                    break
            if req.status != RUNNING:
                continue
            bm.append_slot(req.request_id)
            req.num_cached += 1
            batch.requests.append(req)
            batch.num_new_tokens.append(1)
        return batch

    def preempt(self, req: Request, reason: str) -> None:
        """Preempt ``req`` by recompute: free its blocks, put it at the front of the waiting queue."""
        bm = self.block_manager
        blocks = list(bm.block_tables[req.request_id])
        self.running.remove(req)
        bm.events.append(Event(
            "preempt", req.request_id, blocks,
            f"{req.request_id} preempted ({reason}): its {len(blocks)} blocks are freed and its "
            f"{req.num_tokens} tokens will be recomputed",
            {"mode": "recompute", "reason": reason},
        ))
        bm.free(req.request_id)
        req.status = WAITING
        req.num_cached = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a finished request from the batch and free its blocks at once."""
        bm = self.block_manager
        req.last_block_table = list(bm.block_tables[req.request_id])
        self.running.remove(req)
        req.status = FINISHED
        req.finish_reason = reason
        bm.events.append(Event("finish", req.request_id, [],
                               f"{req.request_id} finished ({reason}) after {len(req.output_token_ids)} tokens"))
        bm.free(req.request_id)
