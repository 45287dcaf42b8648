"""vLLM V1's scheduler: one token budget per step, chunked prefill, mixed steps, recompute-only preemption.

Mirrors ``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``, vLLM 0.32) for what this lab models
(one sequence per request: V1 splits ``n`` samples into child requests before they reach the scheduler).
There is no prefill or decode phase: each request has ``num_computed_tokens`` and ``num_tokens`` (prompt
+ generated), and every step the scheduler gives tokens to requests so their computed tokens catch up:

1. **Running requests first**, in order, while the step's token budget (``max_num_batched_tokens``) lasts:
   each gets ``min(num_tokens - num_computed_tokens, budget, max_model_len - 1 - num_computed_tokens)``
   tokens (a decode token, or the next chunk of a prefill that did not fit before). If its blocks do not
   fit, the scheduler preempts (``_preempt``) the last running request under FCFS, or the running
   request with the highest ``(priority, arrival)`` under the priority policy, until they fit or the
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

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator

from .allocator import KVAllocator
from .block_manager import refusal
from .records import EventKind, EventLog
from .scheduler import Batch, Scheduler
from .sequence import RUNNING, WAITING, Request


class WaitingQueue:
    """V1's waiting queue: requests in queue order (arrival; a preempted request goes back to the front),
    with the operations of the ``deque`` the paper's scheduler uses (``append``, ``appendleft``,
    ``popleft``, ``[0]``, iteration, ``len``) plus ``remove`` of any request in O(1), and, given a ``key``
    (the priority policy), ``first()``: the request of the lowest key in O(log n) (a heap with lazy deletion;
    vLLM's ``PriorityRequestQueue`` is a heap too). So admitting a request costs the same with 40,000
    waiting as with 4 (a ``min`` over the queue and a ``deque.remove`` each cost one visit per waiting
    request, every step)."""

    def __init__(self, key: Callable[[Request], tuple] | None = None) -> None:
        self._items: OrderedDict[int, Request] = OrderedDict()  # id(request) -> request, in queue order
        self._key = key
        self._heap: list[tuple] = []  # (key, push number, request); stale once removed or pushed again
        self._live: dict[int, int] = {}  # id(request) -> its current heap entry's push number
        self._pushes = 0

    def _push(self, req: Request) -> None:
        if self._key is None:
            return
        self._pushes += 1
        self._live[id(req)] = self._pushes
        heapq.heappush(self._heap, (self._key(req), self._pushes, req))
        if len(self._heap) > 2 * len(self._items) + 64:  # mostly stale entries: rebuild from the queue
            self._heap = [entry for entry in self._heap if self._is_live(entry)]
            heapq.heapify(self._heap)

    def _is_live(self, entry: tuple) -> bool:
        _, number, req = entry
        return self._items.get(id(req)) is req and self._live.get(id(req)) == number

    def append(self, req: Request) -> None:
        self._items[id(req)] = req
        self._push(req)

    def appendleft(self, req: Request) -> None:
        self._items[id(req)] = req
        self._items.move_to_end(id(req), last=False)
        self._push(req)

    def popleft(self) -> Request:
        if not self._items:
            raise IndexError("pop from an empty waiting queue")
        return self._items.popitem(last=False)[1]

    def remove(self, req: Request) -> None:
        if self._items.get(id(req)) is not req:
            raise ValueError(f"{req.request_id} is not in the waiting queue")
        del self._items[id(req)]

    def first(self) -> Request:
        """The waiting request of the lowest key (the queue's head without a key)."""
        if self._key is None:
            return self[0]
        while not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def __getitem__(self, index: int) -> Request:
        if index == 0 and self._items:
            return next(iter(self._items.values()))
        return list(self._items.values())[index]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


def _priority_key(req: Request) -> tuple:
    """vLLM's ``Request.__lt__`` in its priority heap: (priority, arrival), then the request id (the child
    requests of one ``n > 1`` request share its arrival; as strings: "R1.10" before "R1.2")."""
    return req.priority, req.arrival, req.request_id


class SchedulerV1(Scheduler):
    """vLLM V1's scheduling policy over a ``BlockManager`` (the paged allocator; no swap pool).

    Args:
        block_manager: the engine's paged allocator.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: the step's token budget, shared by decode tokens and prefill chunks.
        max_model_len: longest sequence (tokens).
        policy: "fcfs" or "priority" (vLLM's ``SchedulerConfig.policy``).
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
        self.waiting = WaitingQueue(_priority_key if policy == "priority" else None)

    # ------------------------------------------------------------------------------------------ queues
    def _next_waiting(self) -> Request:
        """The waiting request to admit next: the queue's head (FCFS), or the lowest (priority, arrival,
        request id) (``_priority_key``), found in O(log n) by ``WaitingQueue.first``."""
        return self.waiting.first()

    def _victim(self) -> Request:
        """The running request to preempt: the last admitted (FCFS), or the highest (priority, arrival),
        the first in running order among ties (vLLM: ``max(self.running, key=...)``)."""
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

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
        """" (priority 3)" under the priority policy, so each admission and preemption says why."""
        return f" (priority {req.priority})" if self.policy == "priority" else ""

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
