"""At most ``STAGE_SLOTS`` Playground stage runs at once in one server process, the rest waiting in arrival order.

Why (issue 16's class at once): every browser session runs its script in a thread of its own, and one Python
process runs one thread at a time (the GIL), switching every few milliseconds. When 30 students press Step
together, 30 stage runs share the process evenly and all finish at about the same moment, as late as the last:
the median wait equals the longest (measured: 30 students, median 1.47 s, p95 1.74 s). Served in order, a few
at a time, the first answers come back after one step's time and the median is half the round, with the same
total work (the same reason a server's scheduler runs a bounded batch rather than every request at once).
Two slots rather than one, so that one slow stage run does not hold everyone else up (the long presses, "Run to
the end" and "Next event", and the Export panel run outside the slot: ``ui.playground.stage``).

Arrival order is kept exactly (``FairGate``: a freed slot is handed to the longest waiter; Python's
``threading.Semaphore`` lets a thread arriving at that moment take it first). ``stage_slot()`` is re-entrant
within a thread and always released, also when a run is stopped or re-run (Streamlit raises through it).
``PAL_STAGE_SLOTS`` sets the number of slots (a positive integer; default ``STAGE_SLOTS``).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from contextlib import contextmanager

ENV = "PAL_STAGE_SLOTS"
STAGE_SLOTS = 2


def slots_from_env(value: str | None) -> int:
    """``PAL_STAGE_SLOTS`` as a number of slots. Raises ValueError naming the value unless it is an integer >= 1
    (unset or empty: ``STAGE_SLOTS``)."""
    if value is None or not value.strip():
        return STAGE_SLOTS
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{ENV}={value!r} is not a whole number of stage slots") from None
    if n < 1:
        raise ValueError(f"{ENV}={value!r}: at least 1 stage slot is needed")
    return n


class FairGate:
    """At most ``slots`` holders at once; the others wait in a queue and get a freed slot in arrival order."""

    def __init__(self, slots: int):
        self._lock = threading.Lock()
        self._free = slots
        self._waiting: deque[threading.Event] = deque()

    def acquire(self) -> None:
        with self._lock:
            if self._free and not self._waiting:
                self._free -= 1
                return
            turn = threading.Event()
            self._waiting.append(turn)
        turn.wait()  # set by ``release``, which hands its slot over: nobody can take it in between

    def release(self) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()
            else:
                self._free += 1


_slots = FairGate(slots_from_env(os.environ.get(ENV)))
_held = threading.local()  # how deep this thread is inside stage_slot()


@contextmanager
def stage_slot():
    """Hold one of the process's stage slots for the ``with`` block (waiting for one in arrival order)."""
    depth = getattr(_held, "depth", 0)
    if depth == 0:
        _slots.acquire()
    _held.depth = depth + 1
    try:
        yield
    finally:
        _held.depth = depth
        if depth == 0:
            _slots.release()
