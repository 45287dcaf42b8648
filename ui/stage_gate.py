"""At most ``STAGE_SLOTS`` Playground stage runs at once in one server process, the rest waiting in arrival order.

Why (issue 16's class at once): every browser session runs its script in a thread of its own, and one Python
process runs one thread at a time (the GIL), switching every few milliseconds. When 30 students press Step
together, 30 stage runs share the process evenly and all finish at about the same moment, as late as the last:
the median wait equals the longest (measured: 30 students, median 1.47 s, p95 1.74 s). Served in order, a few
at a time, the first answers come back after one step's time and the median is half the round, with the same
total work (the same reason a server's scheduler runs a bounded batch rather than every request at once).
Two slots rather than one, so that one long press ("Run to the end": up to ``Lab.MAX_RUN_STEPS`` steps) does
not hold everyone else up.

``stage_slot()`` is re-entrant within a thread (a full run of the page calls the stage fragment's body
inside it) and always released, also when a run is stopped or re-run (Streamlit raises through it).
``PAL_STAGE_SLOTS`` sets the number of slots (a positive integer; default ``STAGE_SLOTS``).
"""

from __future__ import annotations

import os
import threading
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


_slots = threading.Semaphore(slots_from_env(os.environ.get(ENV)))  # waiters are woken first come, first served
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
