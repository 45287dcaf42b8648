"""vLLM V1's scheduler (``engine.scheduler_v1``) driven through the real ``LLMEngine.step`` with a fake model
runner (``test_scheduler.Driver``: no model computes).

Every sequence whose computed tokens reached its length samples one made-up token (a prefill chunk short of
the prompt's end samples nothing), and a request finishes at its length (``Scheduler.update_from_output``).
The real vLLM is checked in tests/test_conformance.py; these tests pin the rules one by one and, over random
workloads, the properties: the token budget and ``max_num_seqs`` hold, no admission in a step that
preempted, the victim is the last running request (FCFS) or the highest (priority, arrival), every request
finishes, and the pool is consistent and empty at the end.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import SamplingParams
from engine.records import EventKind
from engine.scheduler_v1 import SchedulerV1
from engine.sequence import FINISHED, Request, Sequence
from test_scheduler import Driver


def make_request(rid: str, prompt: list[int], max_tokens: int, priority: int = 0, arrival: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = Request(rid, None, list(prompt), params, seed=0, max_len=len(prompt) + max_tokens, priority=priority,
                  arrival=arrival)
    req.seqs.append(Sequence(rid, list(prompt), len(prompt)))
    return req


def v1_driver(num_blocks: int, block_size: int = 4, budget: int = 16, max_num_seqs: int = 8,
              max_model_len: int = 1000, policy: str = "fcfs", watermark_blocks: int = 0) -> Driver:
    """The real ``LLMEngine.step`` over ``SchedulerV1`` and a prefix-caching pool, with the fake runner and
    made-up tokens of ``test_scheduler.Driver``."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = SchedulerV1(bm, max_num_seqs, budget, max_model_len, policy=policy, watermark_blocks=watermark_blocks)
    return Driver(bm, scheduler=sched, semantics="v1")


def test_long_prompt_is_prefilled_in_chunks_of_the_budget():
    eng = v1_driver(num_blocks=100, budget=16)
    eng.add(make_request("A", list(range(40)), max_tokens=3))
    eng.run()
    assert [s["scheduled"].get("A") for s in eng.steps] == [16, 16, 8, 1, 1]
    assert [s["kind"] for s in eng.steps] == ["prefill", "prefill", "prefill", "decode", "decode"]
    # a chunk short of the prompt's end samples nothing: 3 tokens came from the last 3 steps only
    assert eng.requests[0].seqs[0].output_token_ids and len(eng.requests[0].seqs[0].output_token_ids) == 3


def test_running_requests_go_first_and_share_the_budget_with_a_new_prefill():
    eng = v1_driver(num_blocks=100, budget=16)
    eng.add(make_request("A", list(range(10)), max_tokens=5))
    eng.step()
    eng.add(make_request("B", list(range(100, 130)), max_tokens=2))
    step = eng.step()
    assert step["scheduled"] == {"A": 1, "B": 15}  # A's decode token first, B's chunk takes the rest
    assert step["kind"] == "mixed"


def test_admission_needs_the_whole_sequence_to_fit_not_just_the_first_chunk():
    # budget 4 would allocate one block for B's first chunk, but its 20 tokens need 5: only 4 are free
    eng = v1_driver(num_blocks=6, block_size=4, budget=4)
    eng.add(make_request("A", list(range(4)), max_tokens=4))
    eng.step()
    eng.add(make_request("B", list(range(100, 120)), max_tokens=1))
    step = eng.step()
    assert "B" not in step["scheduled"]
    assert any(e.kind == EventKind.WAIT and e.request_id == "B" for e in step["events"])


def test_fcfs_preempts_the_last_running_request_and_admits_nobody_that_step():
    eng = v1_driver(num_blocks=4, block_size=4, budget=64)
    for rid in "ABC":
        eng.add(make_request(rid, [ord(rid)] * 4, max_tokens=6))
    eng.step()  # all three prefill (3 blocks of 4, 1 free); each sampled a 5th token, which needs a new block
    step = eng.step()
    assert step["preempted"] == ["C"]  # A takes the free block; B needs one: C, the last admitted, goes
    assert step["scheduled"] == {"A": 1, "B": 1} and [r.request_id for r in eng.sched.waiting] == ["C"]
    eng.run()
    assert all(r.status == FINISHED for r in eng.requests)


def test_priority_policy_preempts_the_highest_priority_value_then_the_latest_arrival():
    eng = v1_driver(num_blocks=4, block_size=4, budget=64, policy="priority")
    eng.add(make_request("A", [1] * 4, max_tokens=6, priority=1))
    eng.add(make_request("B", [2] * 4, max_tokens=6, priority=0))
    eng.add(make_request("C", [3] * 4, max_tokens=6, priority=0))
    first = eng.step()
    assert list(first["scheduled"]) == ["B", "C", "A"]  # admitted by (priority, arrival)
    step = eng.step()
    assert step["preempted"][0] == "A"  # the highest priority value, though admitted last anyway
    eng2 = v1_driver(num_blocks=4, block_size=4, budget=64, policy="priority")
    eng2.add(make_request("A", [1] * 4, max_tokens=6, priority=0))
    eng2.add(make_request("B", [2] * 4, max_tokens=6, priority=2))
    eng2.add(make_request("C", [3] * 4, max_tokens=6, priority=1))
    eng2.step()
    assert eng2.step()["preempted"][0] == "B"


def test_identical_prompts_admitted_in_one_step_share_the_full_blocks():
    eng = v1_driver(num_blocks=20, block_size=4, budget=64)
    for rid in "ABC":
        eng.add(make_request(rid, list(range(10)), max_tokens=2))
    step = eng.step()
    assert step["scheduled"] == {"A": 10, "B": 2, "C": 2}  # B and C find A's 2 full blocks cached at once
    assert [r.num_cached_tokens for r in eng.requests] == [0, 8, 8]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2)), min_size=1,
                     max_size=8),
    num_blocks=st.integers(9, 30),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 5),
    policy=st.sampled_from(["fcfs", "priority"]),
    shared=st.booleans(),
)
def test_random_workloads_keep_v1_invariants(lengths, num_blocks, budget, max_num_seqs, policy, shared):
    eng = v1_driver(num_blocks=num_blocks, block_size=4, budget=budget, max_num_seqs=max_num_seqs,
                     policy=policy)
    for i, (plen, gen, prio) in enumerate(lengths):
        gen = min(gen, num_blocks * 4 - plen)  # a lone request fits the pool (the engine refuses others)
        prompt = ([7] * plen) if shared else [i * 100 + t for t in range(plen)]
        eng.add(make_request(f"R{i}", prompt, max_tokens=gen, priority=prio))
    while eng.sched.has_unfinished():
        before = list(eng.sched.running)
        step = eng.step()
        assert sum(step["scheduled"].values()) <= budget
        assert len(eng.sched.running) <= max_num_seqs
        assert not eng.bm.invariant_violations()
        if step["preempted"]:
            # no request was admitted in a step that preempted
            assert all(r in before for r in eng.sched.running)
            first = step["preempted"][0]
            key = (lambda r: (r.priority, r.arrival)) if policy == "priority" else None
            expected = max(before, key=key) if key else before[-1]
            assert first == expected.request_id
        assert len(eng.steps) < 3000
    assert all(r.status == FINISHED and len(r.seqs[0].output_token_ids) == r.params.max_tokens
               for r in eng.requests)
    assert eng.bm.num_free_blocks == num_blocks


def test_v1_reuses_freed_uncached_blocks_before_evicting_a_cached_prefix():
    """vLLM V1's BlockPool.free_blocks: a freed block with no prefix-cache hash goes to the front of the
    free queue, a cached one to the back, so the next allocation evicts no cached prefix while uncached
    blocks are free. The paper's engine puts both at the back, in the order freed."""
    for v1, first_evicts in ((True, False), (False, True)):
        bm = BlockManager(4, 4, enable_prefix_caching=True, evict_uncached_first=v1)
        bm.allocate("A", 6, [1, 2, 3, 4, 5, 6])  # block 0 full (cached), block 1 partly filled (uncached)
        bm.allocate("B", 8, [9, 9, 9, 9, 8, 8, 8, 8])  # blocks 2, 3: both full, cached
        bm.free("B")  # paper: free queue [3, 2] then A's tail first [1, 0] -> [3, 2, 1, 0]
        bm.free("A")  # V1: A's uncached block 1 goes to the front -> [1, 3, 2, 0]
        bm.drain_kv_events()
        bm.allocate("C", 4, [7, 7, 7, 7])
        evicted = [e for e in bm.drain_kv_events() if e["type"] == "BlockRemoved"]
        assert bool(evicted) == first_evicts
