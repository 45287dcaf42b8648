"""The stage gate (ui/stage_gate.py): at most N stage runs at once, the rest served in arrival order; re-entrant in
a thread; released whatever happens; its setting refused by name when it is not a positive whole number."""

from __future__ import annotations

import threading
import time

import pytest

from ui import stage_gate
from ui.stage_gate import slots_from_env, stage_slot


def test_at_most_the_slots_run_at_once_and_waiters_go_in_arrival_order(monkeypatch):
    monkeypatch.setattr(stage_gate, "_slots", stage_gate.FairGate(2))
    running, most, order = [0], [0], []
    lock = threading.Lock()

    def run(i: int) -> None:
        with stage_slot():
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
                order.append(i)
            time.sleep(0.05)
            with lock:
                running[0] -= 1

    threads = []
    for i in range(8):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        time.sleep(0.005)  # arrive in order 0, 1, 2, ...
    for t in threads:
        t.join(10)
    assert most[0] == 2
    assert order == list(range(8))  # first come, first served


def test_re_entrant_in_a_thread_and_released_on_an_exception(monkeypatch):
    monkeypatch.setattr(stage_gate, "_slots", stage_gate.FairGate(1))
    raised = []

    def nested() -> None:
        try:
            with stage_slot():
                with stage_slot():  # nested in one thread: no deadlock
                    raise RuntimeError("a rerun or a stop raises through the slot")
        except RuntimeError:
            raised.append(True)

    runner = threading.Thread(target=nested, daemon=True)
    runner.start()
    runner.join(5)
    assert raised == [True], "the nested slot deadlocked"
    got = []
    t = threading.Thread(target=lambda: got.append(stage_gate._slots.acquire()), daemon=True)
    t.start()
    t.join(5)
    assert got == [None]  # the one slot was given back


def test_a_freed_slot_goes_to_the_longest_waiter_not_to_a_newcomer():
    gate = stage_gate.FairGate(1)
    gate.acquire()
    order = []
    waiter = threading.Thread(target=lambda: (gate.acquire(), order.append("waiter"), gate.release()), daemon=True)
    waiter.start()
    time.sleep(0.05)  # the waiter is queued
    gate.release()  # handed to the waiter...
    assert gate._free == 0  # ...not put back for anyone to take
    newcomer = threading.Thread(target=lambda: (gate.acquire(), order.append("newcomer"), gate.release()),
                                daemon=True)
    newcomer.start()
    waiter.join(5)
    newcomer.join(5)
    assert order == ["waiter", "newcomer"] and gate._free == 1


@pytest.mark.parametrize("value, slots", [(None, stage_gate.STAGE_SLOTS), ("", stage_gate.STAGE_SLOTS), ("3", 3)])
def test_slots_from_the_environment(value, slots):
    assert slots_from_env(value) == slots


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_setting_is_refused_by_name(value):
    with pytest.raises(ValueError, match=f"PAL_STAGE_SLOTS={value!r}"):
        slots_from_env(value)
