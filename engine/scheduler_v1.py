"""vLLM V1's scheduler: one token budget per step, chunked prefill, mixed steps, recompute-only preemption.

Mirrors ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``, vLLM 0.32) for what this lab models
(one sequence per request: V1 splits ``n`` samples into child requests before they reach the scheduler).
There is no prefill or decode phase: each request has ``num_computed_tokens`` and ``num_tokens`` (prompt
+ generated), and every step the scheduler gives tokens to requests so their computed tokens catch up:

1. **Running requests first**, in order, while the step's token budget (``max_num_batched_tokens``) lasts:
   each gets ``min(num_tokens - num_computed_tokens, budget, max_model_len - 1 - num_computed_tokens)``
   tokens (a decode token, or the next chunk of a prefill that did not fit before). If its blocks do not
   fit, the scheduler preempts (``_preempt``) the victim its waiting queue's policy picks
   (``engine.request_queue``): the last running request under FCFS, or the running request with the highest ``(priority, arrival)`` under the priority policy, until they fit or the
   victim is the request itself. Preemption is by recompute only: the victim's blocks are freed, its
   computed tokens reset to 0, and it goes back to the front of the waiting queue.
2. **Then waiting requests**, only if nobody was preempted this step, while budget and ``max_num_seqs``
   allow: the head of the waiting queue (arrival order, or (priority, arrival) under the priority
   policy) takes its longest cached prefix, then ``min(remaining tokens, budget)`` tokens: a prompt
   longer than what is left of the budget is prefilled in chunks over several steps. It is admitted only
   if blocks for its whole sequence fit (``scheduler_reserve_full_isl``, on by default in vLLM 0.32) above
   the watermark (V1's default 0); the first that does not fit stops admission (no skipping ahead).

A request whose prefill is not complete after a step samples nothing (its chunk's logits are discarded);
the step that computes its last prompt token samples its first output token. Prefix-cache queries and
hits are recorded when a request is admitted (re-admissions after a preemption apart), and each request's
first hit is its ``num_cached_tokens`` (vLLM's ``RequestOutput.num_cached_tokens``).
"""

from __future__ import annotations

from .allocator import KVAllocator
from .block_manager import refusal
from .records import EventKind, EventLog
from .request_queue import RequestQueue, create_request_queue
from .scheduler import Batch, Scheduler
from .sequence import RUNNING, WAITING, Request


class SchedulerV1(Scheduler):
    """vLLM V1's scheduling policy over a ``BlockManager`` (the paged allocator; no swap pool).

    Args:
        block_manager: the engine's paged allocator.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: the step's token budget, shared by decode tokens and prefill chunks.
        max_model_len: longest sequence (tokens).
        policy: a name in ``engine.request_queue.REQUEST_QUEUES`` ("fcfs", "priority"; vLLM's
            ``SchedulerConfig.policy``): the waiting queue's class, which orders admission and picks the
            preemption victim.
        watermark_blocks: blocks an admission keeps free while others run (vLLM V1's watermark).
        log: the engine's event log.
    """

    def __init__(self, block_manager: KVAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", watermark_blocks: int = 0,
                 log: EventLog | None = None, eos_token_id: int | None = None) -> None:
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens, "recompute", log=log,
                         eos_token_id=eos_token_id)
        self.max_model_len = max_model_len
        self.policy = policy
        self.watermark_blocks = watermark_blocks
        self.waiting: RequestQueue = create_request_queue(policy)

    # ------------------------------------------------------------------------------------------ queues
    def _next_waiting(self) -> Request:
        """The waiting request to admit next: the policy's (``RequestQueue.first``)."""
        return self.waiting.first()

    def _victim(self) -> Request:
        """The running request to preempt: the policy's (``RequestQueue.victim``)."""
        return self.waiting.victim(self.running)

    # -------------------------------------------------------------------------------------------- step
    def _schedule(self) -> Batch:
        batch = Batch("idle")
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        budget -= sum(batch.num_new_tokens)
        if not preempted:
            self._schedule_waiting(batch, budget)
        batch.num_preempted = preempted
        batch.kind = self._kind(batch)
        return batch

    @staticmethod
    def _kind(batch: Batch) -> str:
        """"decode" (every sequence computes just its newest generated token), "prefill" (none does:
        prompt chunks, or a recompute of prompt + generated tokens after a preemption), "mixed" (both) or
        "idle"."""
        if not batch.seqs:
            return "idle"
        # a request admitted this step prefills, even one token (a re-admission whose rest was cached)
        admitted = {id(r) for r in batch.admitted}
        decode = [n == 1 and s.num_computed_tokens == s.num_tokens and s.num_tokens - 1 >= s.prompt_len
                  and id(r) not in admitted for s, n, r in zip(batch.seqs, batch.num_new_tokens, batch.requests)]
        return "decode" if all(decode) else "prefill" if not any(decode) else "mixed"

    def _schedule_running(self, batch: Batch, budget: int) -> int:
        """Give each running request its next tokens (step 1); returns how many requests were preempted."""
        bm = self.block_manager
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            seq = req.seqs[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget,
                    self.max_model_len - 1 - seq.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            need = bm.blocks_to_allocate(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)
            while need > bm.num_free_blocks:
                victim = self._victim()
                index = self.running.index(victim)
                if index < i:  # priority policy: a request already given tokens this step gives them back
                    i -= 1
                    budget += self._unschedule(victim, batch)
                self.preempt(victim, reason=f"{req.request_id} needs {need} free block{'s' * (need != 1)}, "
                                             f"{bm.num_free_blocks} free")
                preempted += 1
                if victim is req:
                    break
                need = bm.blocks_to_allocate(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)
            if req.status != RUNNING:
                break  # vLLM: the request itself was the victim; nothing after it runs this step
            bm.allocate_slots(seq.seq_id, seq.token_ids, n, num_prompt_tokens=seq.prompt_len)
            self._add(req, n, batch)
            budget -= n
            i += 1
        return preempted

    def _schedule_waiting(self, batch: Batch, budget: int) -> None:
        """Admit waiting requests while budget, ``max_num_seqs`` and free blocks allow (step 2)."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._next_waiting()
            seq = req.seqs[0]
            hits = len(bm.match_prefix(seq.token_ids)) * bm.block_size
            n = min(seq.num_tokens - hits, budget)
            keep = self.watermark_blocks if self.running else 0
            need = bm.blocks_to_allocate(seq.seq_id, seq.token_ids, seq.num_tokens)  # the whole sequence fits
            if need + keep > bm.num_free_blocks:
                why = refusal(need, keep, bm.num_free_blocks)
                self.log.emit(EventKind.WAIT, req.request_id, [], f"{req.request_id} waits at the door: {why}",
                              reason=why)
                return
            self.waiting.remove(req)
            again = req.num_preemptions > 0
            cached = bm.allocate_slots(seq.seq_id, seq.token_ids, n, preempted=again, num_prompt_tokens=seq.prompt_len)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            req.status = RUNNING
            self.running.append(req)
            self._add(req, n, batch)
            batch.admitted.append(req)
            budget -= n
            rest = seq.num_tokens - cached - n
            chunk = f"; {rest} more in later steps (chunked prefill)" if rest else ""
            verb = "re-admitted (recompute)" if again else "admitted"
            self.log.emit(EventKind.ADMIT, req.request_id, [],
                          f"{req.request_id}{self._priority(req)} {verb}: computes {n} of {seq.num_tokens} tokens this step"
                          + (f", {cached} found in the prefix cache" if cached else "") + chunk,
                          num_tokens=seq.num_tokens, computed=seq.num_tokens - cached, readmission=again)

    def _priority(self, req: Request) -> str:
        """What the policy says of ``req`` in an admission or preemption line (" (priority 3)" under the
        priority policy), so each says why."""
        return self.waiting.says(req)

    def _add(self, req: Request, n: int, batch: Batch) -> None:
        seq = req.seqs[0]
        seq.status = RUNNING
        seq.num_computed_tokens += n
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.requests.append(req)

    def _unschedule(self, req: Request, batch: Batch) -> int:
        """Take ``req`` out of this step's batch (it is being preempted); returns the tokens it gave back."""
        k = batch.requests.index(req)
        seq = batch.seqs.pop(k)
        n = batch.num_new_tokens.pop(k)
        batch.requests.pop(k)
        seq.num_computed_tokens -= n
        return n

    def preempt(self, req: Request, reason: str) -> None:
        """Recompute preemption (vLLM V1's only kind): free the blocks, reset the computed tokens, requeue
        at the front of the waiting queue."""
        bm = self.block_manager
        seq = req.seqs[0]
        held = bm.table_of(seq.seq_id)
        blocks = sorted(held[0]) if held else []
        self.running.remove(req)
        self.log.emit(EventKind.PREEMPT, req.request_id, blocks,
                      f"{req.request_id}{self._priority(req)} preempted by recompute ({reason}): its {len(blocks)} blocks are freed and "
                      f"its {seq.num_tokens} tokens will be computed again", mode="recompute", reason=reason)
        req.num_preemptions += 1
        self._preempted.append(req.request_id)
        if held:
            bm.free(seq.seq_id)
        seq.status = WAITING
        seq.num_computed_tokens = 0
        req.status = WAITING
        self.waiting.appendleft(req)
