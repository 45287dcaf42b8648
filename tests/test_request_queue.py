"""V1's scheduling policies as request queues (``engine.request_queue``, vLLM's ``request_queue.py``): one
registry that config validation, the CLI, the scenario file's schema and the app's labels read, so a new
policy is a ``RequestQueue`` subclass and its registry entry, with no string switch on a policy's name
elsewhere. The policies' scheduling rules themselves are pinned in tests/test_scheduler_v1.py."""

from __future__ import annotations

import typing

import pytest

from engine.cli import build_parser
from engine.config import SCHEDULING_POLICIES, EngineConfig
from engine.records import EventKind
from engine.request_queue import (REQUEST_QUEUES, FCFSRequestQueue, PriorityRequestQueue, RequestQueue,
                                  create_request_queue, register)
from engine.scenarios.scenario_file import ScenarioSettings
from test_scheduler_v1 import make_request, v1_driver
from ui.lab import SCHEDULING_LABELS, semantics_line


class LIFORequestQueue(RequestQueue):
    """A policy vLLM lacks, written as a newcomer would: the latest arrival first, the earliest running the
    victim."""

    name = "lifo"
    label = "LIFO (last come, first served)"
    short = "LIFO"

    def first(self):
        return self[-1]

    def victim(self, running):
        return running[0]

    def says(self, req):
        return " (lifo)"


@pytest.fixture
def lifo(monkeypatch):
    """LIFO registered for one test (``monkeypatch`` takes it out again)."""
    monkeypatch.setitem(REQUEST_QUEUES, LIFORequestQueue.name, LIFORequestQueue)
    return LIFORequestQueue


def _cli_choices() -> tuple:
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    return tuple(next(a for a in run._actions if a.dest == "scheduling_policy").choices)


def test_every_place_that_offers_a_policy_reads_the_registry():
    assert SCHEDULING_POLICIES == tuple(REQUEST_QUEUES) == ("fcfs", "priority")
    assert SCHEDULING_LABELS == {name: queue.label for name, queue in REQUEST_QUEUES.items()}
    assert _cli_choices() == SCHEDULING_POLICIES
    schema = ScenarioSettings.model_fields["scheduling_policy"].annotation
    assert typing.get_args(schema) == SCHEDULING_POLICIES
    assert [create_request_queue(name).__class__ for name in REQUEST_QUEUES] == [FCFSRequestQueue, PriorityRequestQueue]


def test_a_new_policy_is_a_class_and_its_registry_entry(lifo):
    config = EngineConfig(semantics="v1", scheduling_policy="lifo")  # validation reads the registry
    assert config.scheduling_policy == "lifo"
    line = semantics_line("v1", 64, "lifo")
    assert line.endswith("recompute-only preemption, LIFO"), line

    # the scheduler admits in the queue's order and names the policy's word in its admission lines
    eng = v1_driver(num_blocks=100, budget=64, policy="lifo")
    for i, rid in enumerate("ABC"):
        eng.add(make_request(rid, list(range(10 * i, 10 * i + 4)), max_tokens=2, arrival=i))
    eng.step()
    admitted = [e for e in eng.steps[0]["events"] if e.kind == EventKind.ADMIT]
    assert [e.request_id for e in admitted] == ["C", "B", "A"]
    assert admitted[0].message.startswith("C (lifo) admitted"), admitted[0].message


def test_the_new_policy_picks_the_victim(lifo):
    # 4 blocks of 4: LIFO admits B, then A (running order [B, A]); when B's decode needs a block none is
    # free, and LIFO's victim is the first running request, B itself (FCFS's would be the last, A)
    eng = v1_driver(num_blocks=4, budget=64, policy="lifo")
    eng.add(make_request("A", list(range(8)), max_tokens=4, arrival=0))
    eng.add(make_request("B", list(range(100, 107)), max_tokens=4, arrival=1))
    eng.run()
    preempted = [e.request_id for s in eng.steps for e in s["events"] if e.kind == EventKind.PREEMPT]
    admitted = [e.request_id for e in eng.steps[0]["events"] if e.kind == EventKind.ADMIT]
    assert admitted == ["B", "A"] and preempted and preempted[0] == "B", (admitted, preempted)


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'lifo'; known: fcfs, priority"):
        create_request_queue("lifo")
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"):
        EngineConfig(semantics="v1", scheduling_policy="lifo")
    with pytest.raises(ValueError, match=r"scheduling policy 'fcfs' is already registered \(FCFSRequestQueue\)"):
        register(LIFORequestQueue.__class__("Again", (LIFORequestQueue,), {"name": "fcfs"}))
    with pytest.raises(ValueError, match=r"Unnamed needs a non-empty class attribute 'name'"):
        register(type("Unnamed", (RequestQueue,), {}))
    assert "fcfs" in REQUEST_QUEUES and REQUEST_QUEUES["fcfs"] is FCFSRequestQueue


def test_the_priority_queue_keeps_its_order_through_removals_and_requeues():
    queue = create_request_queue("priority")
    reqs = {rid: make_request(rid, [1, 2], 1, priority=p, arrival=a)
            for rid, p, a in [("A", 2, 0), ("B", 0, 1), ("C", 1, 2), ("D", 0, 3)]}
    for req in reqs.values():
        queue.append(req)
    assert queue.first() is reqs["B"] and queue[0] is reqs["A"]  # the heap's head, not the queue's
    queue.remove(reqs["B"])
    assert queue.first() is reqs["D"]
    queue.remove(reqs["D"])
    queue.appendleft(reqs["B"])  # a preempted request goes back to the front, and to the heap
    assert queue.first() is reqs["B"] and queue[0] is reqs["B"]
    assert [r.request_id for r in queue] == ["B", "A", "C"]
    assert queue.victim([reqs["A"], reqs["C"], reqs["D"]]) is reqs["A"]
    assert queue.says(reqs["C"]) == " (priority 1)"
    fcfs = create_request_queue("fcfs")
    fcfs.append(reqs["A"])
    fcfs.append(reqs["C"])
    assert fcfs.first() is reqs["A"] and fcfs.victim([reqs["A"], reqs["C"]]) is reqs["C"] and fcfs.says(reqs["A"]) == ""
