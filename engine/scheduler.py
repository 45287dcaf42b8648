"""Continuous batching with preemption by recompute or swap (vLLM v0's scheduling policy, simplified).

Each step is either a prefill step or a decode step:
- while requests are swapped out, no new request is admitted: each step is a decode step, and once the
  running requests have taken their slots without preempting anyone, the head of the swapped queue comes
  back if its blocks fit in the free pool with room for each sequence's next token and the watermark
  (vLLM v0's ``_schedule_swapped`` and ``can_swap_in``); it takes its next slots at once and decodes in
  the same step, so nothing can take those blocks and swap it straight back out;
- prefill: admit waiting requests in arrival order (first come, first served) while their blocks fit in
  the free pool above the watermark, the running sequences stay within ``max_num_seqs`` (always) and the
  step's token budget (``max_num_batched_tokens``) allows; only the budget is waived for the first request
  of an empty batch, so a long prompt is never refused forever. Admission stops at the first request that
  does not fit, so a long request is never starved by shorter ones behind it. With prefix caching a
  request's cached prefix is not computed again.
- decode: when nobody can be admitted, every live sequence of every running request computes one token.
  Before a request's sequences append, the scheduler makes sure enough blocks are free for all of them
  (``append_blocks_needed``: a new block when the last is full, a copy for each writer of a shared last
  block but its last writer); if not, it preempts the most recently
  admitted running request (the victim may be the requester itself), by swap (copy its blocks to the CPU
  swap pool, resume later without recomputing) when the swap pool has room, else by recompute (free its
  blocks, requeue it at the *front* of the waiting queue, prefill prompt + generated tokens again later;
  Kwon et al., SOSP 2023, section 4.5).

No deadlock: the engine only accepts a request whose sequences fit the pool on their own at their longest
(``num_seqs x ceil(max_len / B) <= num_blocks``), so a lone request can always finish; preemption empties
the pool down to that one request if needed.

The step contract (both semantics; vLLM V1's shape): ``schedule()`` runs the policy (``_schedule``, over live
``Request`` objects) and writes the step down as plain data, a ``SchedulerOutput`` (``engine.scheduler_output``),
the only thing the model runner reads; ``update_from_output(output, sampled, beams)`` takes the sampled tokens
back: appends them, finishes and frees what ended, applies each beam-search decision (``engine.beam_search``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import beam_search
from .allocator import KVAllocator
from .records import EventKind, EventLog
from .scheduler_output import ScheduledSeqData, SchedulerOutput
from .sequence import FINISHED, RUNNING, SWAPPED, WAITING, Request, Sequence, generator_for


@dataclass
class Batch:
    """What a scheduling policy chose for one step, over live objects (``schedule`` writes it down as a
    ``SchedulerOutput``): ``kind`` and, per sequence, how many tokens to compute."""

    kind: str  # "prefill" | "decode" | "idle"
    seqs: list[Sequence] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    admitted: list[Request] = field(default_factory=list)  # V1: requests admitted from the waiting queue


@dataclass
class StepUpdate:
    """What ``update_from_output`` did: each sequence's new token (seq id -> token id, in order) and the
    sequences that finished."""

    new_tokens: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)


FINISH_WORDS = {"stop": "it produced the end-of-sequence token",
                "length": "it reached its max_tokens (or the maximum model length)"}


class Scheduler:
    """Chooses each step's batch; logs admissions, waits, preemptions and finishes to ``log`` (the engine's)."""

    def __init__(self, block_manager: KVAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", log: EventLog | None = None,
                 eos_token_id: int | None = None) -> None:
        self.block_manager = block_manager
        self.eos_token_id = eos_token_id  # ends a reply unless its SamplingParams ignore_eos
        self.step_count = 0
        self._preempted: list[str] = []  # request ids preempted while scheduling this step
        self._finished: list[str] = []  # request ids finished since the last schedule
        self.log = log if log is not None else block_manager.log
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the preemption victim
        self.swapped: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------------------- the step contract
    def schedule(self) -> SchedulerOutput:
        """Decide this step (the policy: ``_schedule``) and write it down as plain data for the model runner.
        Right after a request's prompt is prefilled its ``n`` samples are forked off the first sequence
        (they share its blocks and sample from its logits: ``sample_from``); a fork's data movement (the
        contiguous baseline copies the parent's slots) waits for the next step, after this one's compute."""
        self.step_count += 1
        self._preempted = []
        batch = self._schedule()
        bm = self.block_manager
        kv_ops = bm.drain_ops()  # swaps and copy-on-write copies, in order
        owner = {s.seq_id: r.request_id for r in batch.requests for s in r.seqs}
        scheduled = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens - n, seq.num_computed_tokens
            region_start = bm.attention_view(seq.seq_id)[1]
            tables, slots = bm.group_views(seq.seq_id, start, end)  # one of each per KV cache group
            scheduled.append(ScheduledSeqData(owner[seq.seq_id], seq.seq_id, seq.token_ids[start:end], start,
                                              tables, slots, region_start, sample=end == seq.num_tokens))
        finished, self._finished = self._finished, []
        return SchedulerOutput(self.step_count, batch.kind, scheduled, kv_ops, self._fork_samples(batch),
                               list(self._preempted), finished)

    def _fork_samples(self, batch: Batch) -> dict[str, str]:
        """Parallel sampling: fork the ``n - 1`` other samples off the first sequence of each request whose
        prompt was just prefilled; each has its own random stream. Returns child -> parent."""
        sample_from = {}
        for req in batch.requests:
            p, parent = req.params, req.seqs[0]
            if (p.n > 1 and len(req.seqs) == 1 and not parent.output_token_ids and not req.is_beam_search
                    and parent.num_computed_tokens == parent.num_tokens):
                for i in range(1, p.n):
                    child = Sequence(f"{req.request_id}.{i}", list(parent.token_ids), parent.prompt_len,
                                     generator_for(req.seed, i), num_computed_tokens=parent.num_computed_tokens,
                                     status=RUNNING)
                    self.block_manager.fork(parent.seq_id, child.seq_id)
                    req.seqs.append(child)
                    sample_from[child.seq_id] = parent.seq_id
        return sample_from

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           beams: dict[str, beam_search.BeamDecision] | None = None) -> StepUpdate:
        """Take the step's results: ``sampled`` (seq id -> its next token, in batch order) is appended and
        ends a sequence that stopped or reached its length (its blocks freed at once), a request ends with
        its last sequence; ``beams`` (request id -> ``beam_search.BeamDecision``) continues, forks and
        prunes each beam search, or ends it."""
        by_id = {r.request_id: r for r in self.running}
        seqs = {s.seq_id: (by_id[rid], s) for rid in output.req_ids for s in by_id[rid].seqs}
        update = StepUpdate()
        for seq_id, token in sampled.items():
            req, seq = seqs[seq_id]
            seq.token_ids.append(token)
            update.new_tokens[seq_id] = token
            reason = self._finish_reason(req, seq, token)
            if reason:
                self.finish_seq(req, seq, reason)
                update.finished.append(seq_id)
        for req in map(by_id.__getitem__, output.req_ids):
            if not req.is_beam_search and not req.live_seqs and req.status != FINISHED:
                self._finish(req, req.seqs[0].finish_reason, output.step)
        for req in map(by_id.__getitem__, output.req_ids):
            if req.is_beam_search:
                self._continue_beams(req, beams[req.request_id], update, output.step)
        return update

    def is_stop(self, params, token: int) -> bool:
        """Whether ``token`` ends the reply: the end-of-sequence token (unless ``ignore_eos``) or a stop token."""
        eos = None if params.ignore_eos else self.eos_token_id
        return (eos is not None and token == eos) or token in params.stop_token_ids

    def _finish_reason(self, req: Request, seq: Sequence, token: int) -> str | None:
        if self.is_stop(req.params, token):
            return "stop"
        if seq.num_tokens >= req.max_len:  # max_tokens, max_model_len or a contiguous reservation
            return "length"
        return None

    def _finish(self, req: Request, reason: str, step: int) -> None:
        length = (beam_search.best_length(req) if req.is_beam_search
                  else max(len(s.output_token_ids) for s in req.seqs))
        self.finish(req, reason, length)
        req.finish_step = step

    def _continue_beams(self, req: Request, decision: beam_search.BeamDecision, update: StepUpdate, step: int) -> None:
        """Apply a beam-search step: the first beam continuing a parent reuses its sequence, the others fork
        it (sharing its blocks); parents nobody continues are freed ("pruned"); a finished search ends."""
        live = req.live_seqs
        if decision.done:
            update.finished.extend(s.seq_id for s in live)
            self._finish(req, decision.reason, step)
            return
        self._beam_continue(req, live, decision, update)

    def _beam_continue(self, req: Request, live: list[Sequence], decision: beam_search.BeamDecision,
                       update: StepUpdate) -> None:
        """The w running beams for the next step (the beam-selection phase of a step on stage)."""
        claimed: set[int] = set()
        plan = []
        for parent_index, token, score in decision.continuing:
            parent = live[parent_index]
            if parent_index in claimed:
                child = Sequence(f"{req.request_id}.b{req.beam.next_beam}", list(parent.token_ids), parent.prompt_len,
                                 num_computed_tokens=parent.num_computed_tokens, status=RUNNING)
                req.beam.next_beam += 1
                self.block_manager.fork(parent.seq_id, child.seq_id)
                plan.append((child, token, score))
            else:
                claimed.add(parent_index)
                plan.append((parent, token, score))
        for i, s in enumerate(live):
            if i not in claimed:
                self.finish_seq(req, s, "pruned")
        for seq, token, score in plan:
            seq.token_ids.append(token)
            seq.score = score
            update.new_tokens[seq.seq_id] = token
        req.seqs = [seq for seq, _, _ in plan]  # beam order = score order, as transformers keeps it

    # ------------------------------------------------------------------------------------------- policy
    def _schedule(self) -> Batch:
        if not self.swapped:
            batch = self._schedule_prefill()
            if batch.seqs:
                return batch
        batch = self._schedule_decode()
        if self.swapped and not batch.num_preempted:
            self._swap_in(batch)
        batch.kind = "decode" if batch.seqs else "idle"
        return batch

    def _num_running_seqs(self) -> int:
        return sum(r.max_num_running_seqs for r in self.running)

    def _swap_in(self, batch: Batch) -> None:
        """Bring swapped requests back, oldest first, while they fit; each appends its next slots and joins
        this step's decode batch."""
        bm = self.block_manager
        while self.swapped:
            req = self.swapped[0]
            ids = [s.seq_id for s in req.live_seqs]
            if not bm.can_swap_in(ids) or self._num_running_seqs() + req.max_num_running_seqs > self.max_num_seqs:
                return
            self.swapped.popleft()
            bm.swap_in(ids, request_id=req.request_id)
            for s in req.live_seqs:
                s.status = RUNNING
            req.status = RUNNING
            self.running.append(req)
            self._append(req, batch)

    def _schedule_prefill(self) -> Batch:
        batch = Batch("prefill")
        tokens = 0
        bm = self.block_manager
        while self.waiting:
            req = self.waiting[0]
            seqs = req.live_seqs
            n = sum(s.num_tokens for s in seqs)  # prompt, plus generated tokens when recomputing
            # tokens to compute: what the prefix cache does not already hold (the step's budget counts these)
            compute = n - bm.block_size * sum(len(bm.match_prefix(s.token_ids)) for s in seqs)
            if self._num_running_seqs() + req.max_num_running_seqs > self.max_num_seqs:
                break  # the batch is full; add_request refuses a request that could never fit it alone
            if batch.seqs and tokens + compute > self.max_num_batched_tokens:
                break  # the budget never keeps a request out of an empty batch (else it could wait forever)
            refusal = bm.admission_refusal([s.token_ids for s in seqs], req.reservation)
            if refusal is not None:
                self.log.emit(EventKind.WAIT, req.request_id, [], f"{req.request_id} waits at the door: {refusal}",
                              reason=refusal)
                break
            self.waiting.popleft()
            computed = self._admit(req, batch)
            tokens += computed
            again = req.num_preemptions > 0
            verb = "re-admitted (recompute)" if again else "admitted"
            self.log.emit(EventKind.ADMIT, req.request_id, [],
                          f"{req.request_id} {verb}: prefill computes {computed} of {n} tokens",
                          num_tokens=n, computed=computed, readmission=again)
        return batch

    def _admit(self, req: Request, batch: Batch) -> int:
        """Allocate the request's sequences and put them in the batch; returns the tokens to compute."""
        computed = 0
        for s in req.live_seqs:
            _, cached = self.block_manager.allocate_with_prefix(s.seq_id, s.num_tokens, s.token_ids,
                                                                reservation=req.reservation,
                                                                preempted=req.num_preemptions > 0)
            s.status = RUNNING
            s.num_computed_tokens = s.num_tokens
            batch.seqs.append(s)
            batch.num_new_tokens.append(s.num_tokens - cached)
            computed += s.num_tokens - cached
        req.status = RUNNING
        self.running.append(req)
        batch.requests.append(req)
        return computed

    def _schedule_decode(self) -> Batch:
        batch = Batch("decode" if self.running else "idle")
        bm = self.block_manager
        for req in list(self.running):
            if req.status != RUNNING:  # preempted earlier in this loop
                continue
            # blocks the sequences' next tokens take (new ones, copies of a shared last block)
            need = bm.append_blocks_needed([s.seq_id for s in req.live_seqs])  # 0 for contiguous reservations
            while need and bm.num_free_blocks < need and req.status == RUNNING:
                batch.num_preempted += 1
                self.preempt(self.running[-1], reason=f"{req.request_id} needs {need} free "
                                                      f"block{'s' * (need != 1)}, {bm.num_free_blocks} "
                                                      f"{'is' if bm.num_free_blocks == 1 else 'are'} free")
            if req.status == RUNNING:
                self._append(req, batch)
        return batch

    def _append(self, req: Request, batch: Batch) -> None:
        """Each live sequence of ``req`` takes the slot of its next token and joins the decode batch."""
        for s in req.live_seqs:
            self.block_manager.append_slot(s.seq_id, s.token_ids[s.num_computed_tokens])
            s.num_computed_tokens += 1
            batch.seqs.append(s)
            batch.num_new_tokens.append(1)
        batch.requests.append(req)

    def preempt(self, req: Request, reason: str) -> None:
        """Evict ``req`` from the batch: swap when enabled and the swap pool has room, else recompute."""
        bm = self.block_manager
        ids = [s.seq_id for s in req.live_seqs]
        blocks = sorted({b for i in ids for b in bm.table_of(i)[0]})
        self.running.remove(req)
        mode = "swap" if self.preemption_mode == "swap" and bm.can_swap_out(ids) else "recompute"
        note = ""
        if self.preemption_mode == "swap" and mode == "recompute":
            note = " (swap pool full, falling back to recompute)"
        if mode == "swap":
            what = f"its {len(blocks)} blocks go to the CPU swap pool and it resumes later without recomputing"
        else:
            what = (f"its {len(blocks)} blocks are freed and its {sum(s.num_tokens for s in req.live_seqs)} "
                    f"tokens will be recomputed")
        self.log.emit(EventKind.PREEMPT, req.request_id, blocks,
                      f"{req.request_id} preempted by {mode}{note} ({reason}): {what}", mode=mode, reason=reason)
        req.num_preemptions += 1
        self._preempted.append(req.request_id)
        if mode == "swap":
            bm.swap_out(ids, request_id=req.request_id)
            for s in req.live_seqs:
                s.status = SWAPPED
            req.status = SWAPPED
            self.swapped.append(req)
            return
        for s in req.live_seqs:
            bm.free(s.seq_id)
            s.status = WAITING
            s.num_computed_tokens = 0
        req.status = WAITING
        self.waiting.appendleft(req)

    def finish_seq(self, req: Request, seq: Sequence, reason: str) -> None:
        """One sequence is done: free its blocks at once."""
        held = self.block_manager.table_of(seq.seq_id)
        seq.last_block_table = list(held[0]) if held else []
        if held and getattr(self.block_manager, "hybrid", False):  # each KV cache group's table (the record's)
            seq.last_group_block_tables = [list(t) for t in self.block_manager.group_block_tables(seq.seq_id)]
        seq.status = FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq.seq_id, final_len=seq.num_tokens)

    def finish(self, req: Request, reason: str, num_tokens: int) -> None:
        """Remove a finished request from the batch; free whatever its sequences still hold.
        ``num_tokens``: generated tokens of its (best) output, for the event's sentence."""
        for s in req.live_seqs:
            self.finish_seq(req, s, reason)
        if req in self.running:
            self.running.remove(req)
        req.status = FINISHED
        req.finish_reason = reason
        self._finished.append(req.request_id)
        self.log.emit(EventKind.FINISH, req.request_id, [],
                      f"{req.request_id} finished after {num_tokens} token{'s' * (num_tokens != 1)}: "
                      f"{FINISH_WORDS.get(reason, reason)}",
                      reason=reason, final_len=max(len(s.token_ids) for s in req.seqs))
