"""The scheduler, driven through the real ``LLMEngine.step`` (schedule -> run -> update -> record) with a fake
model runner and made-up tokens (no model computes): ``Driver`` installs ``Scheduler(BlockManager(...), ...)``
in an engine, whose runner only reads each ``SchedulerOutput`` and whose sampler makes each sequence's next
token up (a prefill samples the first token, a decode step the next one); the engine's own update
(``Scheduler.update_from_output``) appends, forks the samples, and finishes a request at its length.

Properties, over hundreds of random workloads: ``max_num_seqs`` is never exceeded; the preemption victim is
the most recently admitted running request; every request finishes (no deadlock), the pool is consistent
after every step and empty at the end; the admission watermark is kept free; a request swapped in is never
preempted again in the same step; samples sharing a partly filled block are never over-counted.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine
from engine.block_manager import BlockManager
from engine.config import SamplingParams
from engine.records import EventKind
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Request, Sequence


# --------------------------------------------------------------------------------------- the fake runner
def make_request(rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)
    req = Request(rid, None, list(prompt), params, seed=0, max_len=len(prompt) + max_tokens)
    req.seqs.append(Sequence(rid if n == 1 else f"{rid}.0", list(prompt), len(prompt)))
    return req


@functools.cache
def _loaded():
    from engine.model_loader import load_model

    return load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32")


class FakeRunner:
    """The model runner's side of the contract without a model: it reads only the ``SchedulerOutput`` (each
    kept in ``outputs``) and answers each sequence that samples with a row (no logits: ``Driver`` makes the
    tokens up)."""

    def __init__(self) -> None:
        self.outputs: list[SchedulerOutput] = []

    def execute_model(self, output: SchedulerOutput) -> dict:
        self.outputs.append(output)
        return {s.seq_id: None for s in output.scheduled if s.sample}


class Driver:
    """A real ``LLMEngine`` whose allocator is ``allocator`` and whose scheduler is ``scheduler`` (default the
    paper's ``Scheduler`` with these limits), with ``FakeRunner`` and made-up tokens: a counter over a small
    alphabet (default 3), so decode-filled blocks hit the prefix cache too. ``steps``: per step the batch
    kind, the requests that ran, the sequences computed, the events, the running requests afterwards."""

    def __init__(self, allocator, max_num_seqs: int = 8, max_num_batched_tokens: int = 10_000,
                 preemption_mode: str = "recompute", alphabet: int = 3, scheduler=None,
                 semantics: str = "paper") -> None:
        eng = LLMEngine(EngineConfig(device="cpu", dtype="float32", semantics=semantics, num_blocks=64,
                                     block_size=16, max_model_len=1024), loaded=_loaded())
        eng.log = allocator.log  # the allocator's and the scheduler's events become the step's record
        eng.block_manager = eng.processor.allocator = allocator
        eng.scheduler = scheduler or Scheduler(allocator, max_num_seqs, max_num_batched_tokens, preemption_mode,
                                               log=allocator.log)
        eng.runner = FakeRunner()
        eng._sample = self._made_up_tokens
        self.engine, self.bm, self.sched, self.alphabet = eng, allocator, eng.scheduler, alphabet
        self.requests: list[Request] = []
        self.next_token = 0
        self.steps: list[dict] = []

    def _made_up_tokens(self, requests: list[Request], rows: dict) -> dict[str, int]:
        """The engine's sampler, in its order: each live sequence of these requests that has a row."""
        tokens = {}
        for req in requests:
            for seq in req.live_seqs:
                if seq.seq_id in rows:
                    self.next_token += 1
                    tokens[seq.seq_id] = self.next_token % self.alphabet
        return tokens

    def add(self, req: Request) -> None:
        self.requests.append(req)
        self.engine._enqueue(req)  # built by the test, as the engine's input processor would

    def step(self) -> dict:
        rec = self.engine.step()
        record = {"kind": rec.kind, "requests": list(dict.fromkeys(s.request_id for s in rec.scheduled)),
                  "num_seqs": len(rec.scheduled), "events": rec.events, "running": len(self.sched.running),
                  "scheduled": {s.request_id: s.num_tokens for s in rec.scheduled},
                  "preempted": [e.request_id for e in rec.events if e.kind == EventKind.PREEMPT], "record": rec}
        self.steps.append(record)
        return record

    def run(self, max_steps: int = 5_000, check=None) -> None:
        while self.sched.has_unfinished():
            record = self.step()
            assert len(self.steps) < max_steps, "the scheduler deadlocked"
            if isinstance(self.bm, BlockManager):
                assert self.bm.invariant_violations() == [], (len(self.steps), self.bm.invariant_violations())
            if check is not None:
                check(self, record)


def running_order(steps) -> list[tuple[str, list[str]]]:
    """Replay the events: after each preemption event, whom it chose and the running requests just before,
    oldest admission first (admit and swap-in append, preemption and finish remove)."""
    order: list[str] = []
    seen = []
    for rec in steps:
        for e in rec["events"]:
            if e.kind in (EventKind.ADMIT, EventKind.SWAP_IN):
                order.append(e.request_id)
            elif e.kind == EventKind.PREEMPT:
                seen.append((e.request_id, list(order)))
                order.remove(e.request_id)
            elif e.kind == EventKind.FINISH:
                order.remove(e.request_id)
    return seen


def _assert(cond, what):
    assert cond, what


# ------------------------------------------------------------------------------------------- max_num_seqs
def test_max_num_seqs_caps_every_step_even_when_the_pool_has_room():
    """The defect: max_num_seqs=2, five 8-token requests in a 64-block pool all ran at once."""
    bm = BlockManager(num_blocks=64, block_size=4)
    eng = Driver(bm, max_num_seqs=2)
    for i in range(5):
        eng.add(make_request(f"R{i}", [i] * 8, max_tokens=4))
    eng.run(check=lambda e, rec: _assert(rec["num_seqs"] <= 2 and len(e.sched.running) <= 2, rec))
    assert max(rec["num_seqs"] for rec in eng.steps) == 2
    first = eng.steps[0]
    assert first["kind"] == "prefill" and first["requests"] == ["R0", "R1"]
    assert all(r.status == "finished" for r in eng.requests)


def test_parallel_samples_count_toward_max_num_seqs_before_they_are_forked():
    """A request with n=3 holds one sequence until its prefill forks the others: admission counts 3."""
    bm = BlockManager(num_blocks=64, block_size=4)
    eng = Driver(bm, max_num_seqs=4)
    eng.add(make_request("R0", [1] * 5, max_tokens=3, n=3))
    eng.add(make_request("R1", [2] * 5, max_tokens=3, n=3))
    eng.add(make_request("R2", [0] * 5, max_tokens=3))
    first = eng.step()
    assert first["requests"] == ["R0"]  # R1's 3 samples would make 6 > 4; R2 waits behind R1 (FCFS)
    eng.run(check=lambda e, rec: _assert(rec["num_seqs"] <= 4, rec))
    assert all(r.status == "finished" for r in eng.requests)


# ----------------------------------------------------------------------------------------- the victim
def preemptions(eng) -> list[tuple[str, str]]:
    """(victim, requester) of every preemption, in order."""
    return [(e.request_id, e.data["reason"].split()[0]) for rec in eng.steps for e in rec["events"]
            if e.kind == EventKind.PREEMPT]


def test_the_victim_is_the_newest_request_not_the_requester_nor_the_oldest():
    """8 blocks of 2: R1, R2, R3 hold 2 blocks each, R4 (admitted last) 1; one block is free. At the first
    decode step R1 takes the free block; R2 needs one: the victim is R4, the most recently admitted, not
    R2 (the requester) nor R1 (the oldest). R4's block goes to R2; R3 then needs one and is itself the
    newest running request: it preempts itself."""
    bm = BlockManager(num_blocks=8, block_size=2)
    eng = Driver(bm, max_num_seqs=8)
    for i, prompt_len in enumerate([4, 4, 4, 2], 1):
        eng.add(make_request(f"R{i}", [i] * prompt_len, max_tokens=4))
    eng.run()
    assert preemptions(eng) == [("R4", "R2"), ("R3", "R3")]
    assert eng.steps[4]["requests"] == ["R3", "R4"]  # re-admitted at the front, in their order
    assert all(r.status == "finished" for r in eng.requests)


def test_the_victim_is_the_last_admitted_not_the_last_arrived():
    """Swap mode, 4 blocks of 2. R1 (4 tokens) needs a block at the first decode step: R3 (newest) is
    swapped out, then R2 preempts itself. When R1 finishes, the swapped queue brings back R3 first, then R2:
    R2 is now the most recently admitted although R3 arrived later. When R3 next needs a block the victim
    is R2, not R3 (the requester, the latest arrival and the earlier swap-in)."""
    bm = BlockManager(num_blocks=4, block_size=2, num_swap_blocks=8)
    eng = Driver(bm, max_num_seqs=8, preemption_mode="swap")
    for i, prompt_len in enumerate([4, 2, 2], 1):
        eng.add(make_request(f"R{i}", [i] * prompt_len, max_tokens=4))
    eng.run()
    assert preemptions(eng) == [("R3", "R1"), ("R2", "R2"), ("R2", "R3")]
    swap_ins = [e.request_id for rec in eng.steps for e in rec["events"] if e.kind == EventKind.SWAP_IN]
    assert swap_ins[:2] == ["R3", "R2"]
    assert all(r.status == "finished" for r in eng.requests)
    for victim, before in running_order(eng.steps):
        assert victim == before[-1], (victim, before)


# --------------------------------------------------------------------------------------- the properties
request_specs = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10), st.integers(0, 2), st.integers(1, 3)),
                         min_size=1, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(num_blocks=6, block_size=2, max_num_seqs=6, mode="recompute", swap_blocks=0, prefix=False, watermark=0.25,
         specs=[(1, 2, 0, 3), (2, 2, 0, 3)], budget=1)  # 3 samples re-admitted into an empty pool: waived
@given(num_blocks=st.integers(2, 16), block_size=st.integers(1, 4), max_num_seqs=st.integers(1, 6),
       mode=st.sampled_from(["recompute", "swap"]), swap_blocks=st.integers(0, 16),
       prefix=st.booleans(), watermark=st.sampled_from([0.0, 0.1, 0.25]), specs=request_specs,
       budget=st.integers(1, 40))
def test_scheduler_properties_under_random_workloads(num_blocks, block_size, max_num_seqs, mode, swap_blocks,
                                                     prefix, watermark, specs, budget):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, num_swap_blocks=swap_blocks,
                      watermark=watermark)
    eng = Driver(bm, max_num_seqs, max_num_batched_tokens=budget, preemption_mode=mode)
    for i, (prompt_len, max_tokens, fill, n) in enumerate(specs):
        n = min(n, max_num_seqs)
        max_len = prompt_len + max_tokens
        # what LLMEngine.add_request accepts: each sequence fits the pool alone at its longest
        if n * -(-max_len // block_size) > num_blocks:
            continue
        eng.add(make_request(f"R{i}", [fill] * prompt_len, max_tokens, n=n))
    keep = int(watermark * num_blocks)
    admissions = []  # (blocks in use before, free blocks after) of every admission (all of a request's sequences)

    admit = eng.sched._admit

    def watched(req, batch):
        used = bm.num_used_blocks
        out = admit(req, batch)
        admissions.append((used, bm.num_free_blocks))
        return out

    eng.sched._admit = watched

    def check(e, rec):
        # (a) never more than max_num_seqs sequences in a step or in the running set
        assert rec["num_seqs"] <= max_num_seqs, rec
        assert sum(len(r.live_seqs) for r in e.sched.running) <= max_num_seqs

    eng.run(check=check)
    # (b) every victim was the most recently admitted running request
    for victim, before in running_order(eng.steps):
        assert victim == before[-1], (victim, before)
    # (c) everyone finished at full length, nothing leaked
    for r in eng.requests:
        assert r.status == "finished" and all(s.num_tokens == r.max_len for s in r.seqs), r.request_id
    assert bm.num_free_blocks == num_blocks and bm.num_free_swap_blocks == swap_blocks
    assert not bm.block_tables and not bm.swap_tables
    # (e) admission keeps the watermark free, unless the pool was empty
    for used_before, free_after in admissions:
        assert used_before == 0 or free_after >= keep, (used_before, free_after, keep)


# ------------------------------------------------------------------------ swapped in, then out at once
def assert_no_swap_in_then_preempt(eng, rec):
    """No request is preempted in the step that swapped it in (its blocks would travel twice for nothing)."""
    swapped_in = set()
    for ev in rec["events"]:
        if ev.kind == EventKind.SWAP_IN:
            swapped_in.add(ev.request_id)
        elif ev.kind == EventKind.PREEMPT:
            assert ev.request_id not in swapped_in, f"step {len(eng.steps)}: {ev.request_id} swapped in and out"


def test_a_request_swapped_in_is_not_swapped_out_in_the_same_step():
    """3 blocks of 2. R3 (2 tokens) preempts itself at the first decode step (swap). When R1 finishes, 2 blocks
    are free: R3's one block + one for its next token. Before the fix it was swapped in first, then R2,
    running before it, took the free block and R3 was swapped straight back out; now the running requests
    take their slots first and R3 takes its own as it comes back (vLLM v0's order)."""
    bm = BlockManager(num_blocks=3, block_size=2, num_swap_blocks=8)
    eng = Driver(bm, max_num_seqs=8, preemption_mode="swap")
    for i, (prompt_len, max_tokens) in enumerate([(1, 2), (1, 3), (2, 2)], 1):
        eng.add(make_request(f"R{i}", [i] * prompt_len, max_tokens))
    eng.run(check=assert_no_swap_in_then_preempt)


@settings(max_examples=300, deadline=None)
@example(num_blocks=4, block_size=2, specs=[(2, 4), (2, 4), (2, 4)])  # two swap-ins in one step
@given(num_blocks=st.integers(2, 16), block_size=st.integers(1, 4),
       specs=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10)), min_size=1, max_size=8))
def test_swapped_in_requests_are_never_preempted_in_the_same_step(num_blocks, block_size, specs):
    bm = BlockManager(num_blocks, block_size, num_swap_blocks=64)
    eng = Driver(bm, max_num_seqs=8, preemption_mode="swap")
    for i, (prompt_len, max_tokens) in enumerate(specs):
        if -(-(prompt_len + max_tokens) // block_size) <= num_blocks:
            eng.add(make_request(f"R{i}", [i % 3] * prompt_len, max_tokens))
    eng.run(check=assert_no_swap_in_then_preempt)


def test_samples_swapped_out_come_back():
    """2 blocks of 3, one request with n=2 samples of 1 prompt token + 2 (fits: 2 x 1 block <= 2). After the
    prefill both samples share block 0 (1/3 full). Before the fix the first decode step counted 2 blocks
    needed (1 free), preempted the request by swap, and can_swap_in then wanted 1 + 2 > 2 blocks forever.
    One copy-on-write block suffices: the second sample then writes in place (``append_blocks_needed``)."""
    bm = BlockManager(num_blocks=2, block_size=3, num_swap_blocks=1)
    eng = Driver(bm, max_num_seqs=2, preemption_mode="swap")
    eng.add(make_request("R0", [0], max_tokens=2, n=2))
    eng.run(max_steps=50)
