"""Engine work the app's pages share (the Playground, Compare and the lessons): finished runs kept once per
process for every session (``RunCache``), the shared model loaded once with its progress shown
(``shared_model``, ``preload_model``), and the box a page shows while either happens (``ProgressBox``). App
infrastructure, not a page: the pages and the lessons (``lessons/render.py``) both import it from here, and
it imports neither; ui reaches the lessons only through ``lessons/__init__.py``'s public API.

Why (issue: "every lesson page's first visit within 3 s on 2 cores, every Compare run within 2 s, anything
longer than a second shows progress, never a bare spinner"; ``bench/lessons_speed.py`` measures it):

* The runs are deterministic: the same scenario, settings and seed give the same StepRecords. A lesson's
  runs and a Compare run are computed once per server process and shared by every session; a class of
  twenty opening lesson 5, or running Compare on the default workload, pays for one run, not twenty. The
  key is everything that decides the run (the lessons: the function, its arguments and the model;
  Compare: the fitted ``RunSpec``, the workload, seed, semantics and token budget), so other settings
  never get someone else's run.
* Computed once, also when several sessions ask at the same moment: the work runs in a worker thread and
  every session asking for it waits and shows its progress (``RunCache.get``). Like ``st.cache_resource``,
  but with progress (a Streamlit cache replays the elements a cached function draws, so a progress bar
  inside one would come back on every hit), and a learner's click during a run (a Streamlit rerun) does
  not throw away the run for the others.
* A cached value is shared by every session: pages read it and never change it (tests check that a page
  leaves its runs as they were).
* Progress is an ``st.status`` with an ``st.progress`` bar saying which engine runs and how far
  ("Running the paged engine ...: step 40, 320 of 5,126 tokens"), updated as the engine steps (at most ten
  times a second) and removed when the work is done.

No engine code here: the pages pass a ``compute(report)`` function that runs the engine and calls
``report`` as it steps.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable

import streamlit as st

from engine import EMBEDDED_MODEL


@dataclass(frozen=True)
class Progress:
    """How far a piece of work has got: ``what`` it is doing now (a sentence), ``fraction`` of the whole
    (0..1), and ``detail`` (e.g. "step 40, 320 of 5,126 tokens"; may be empty)."""

    what: str = "Starting"
    fraction: float = 0.0
    detail: str = ""

    @property
    def line(self) -> str:
        return f"{self.what}: {self.detail}" if self.detail else self.what


class _Flight:
    """A value being computed: its latest progress, and the result or error once done."""

    def __init__(self) -> None:
        self.done = threading.Event()  # set once ``value`` or ``error`` is there
        self.progress = Progress()
        self.value: Any = None
        self.error: BaseException | None = None


class RunCache:
    """Finished values by key, at most ``max_entries`` (the least recently used goes first), each computed
    once even when several threads ask for it at the same time. A failed computation is not kept: the
    next call computes again. Thread-safe; the values are shared, so callers must not change them, and
    ``compute`` must not draw on a page (it runs in a worker thread: ``on_progress`` draws)."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._values: OrderedDict[Hashable, Any] = OrderedDict()
        self._flights: dict[Hashable, _Flight] = {}
        self._lock = threading.Lock()
        self.computed = 0  # how many values were computed (misses), for tests and benchmarks

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._values

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The kept value for ``key``, or ``default`` (nothing is computed)."""
        with self._lock:
            if key not in self._values:
                return default
            self._values.move_to_end(key)
            return self._values[key]

    def items(self) -> list[tuple[Hashable, Any]]:
        """The kept (key, value) pairs, least recently used first."""
        with self._lock:
            return list(self._values.items())

    def clear(self) -> None:
        """Forget every finished value (computations in flight finish and are kept)."""
        with self._lock:
            self._values.clear()

    def get(self, key: Hashable, compute: Callable[[Callable[..., None]], Any],
            on_progress: Callable[[Progress], None] | None = None) -> Any:
        """The value for ``key``: kept, or computed now by ``compute(report)``, or, when another caller is
        computing it, that computation's result. ``compute`` runs in a worker thread of its own; it calls
        ``report(what, fraction, detail="")`` as it goes, and this thread hands each new ``Progress`` to
        ``on_progress`` (at most every 0.1 s) until the value is there. So an interrupted caller (a
        Streamlit rerun raised inside ``on_progress``) does not cancel the work: it is kept for the next.
        Raises what ``compute`` raised (to every caller waiting for it; the next call computes again)."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            flight = self._flights.get(key)
            mine = flight is None
            if mine:
                flight = self._flights[key] = _Flight()
        if mine:
            threading.Thread(target=self._compute, args=(key, flight, compute), daemon=True,
                             name=f"run {str(key)[:60]}").start()
        shown = None
        while not flight.done.wait(0.1):
            if on_progress is not None and flight.progress is not shown:
                shown = flight.progress
                on_progress(shown if mine else replace(shown, what=f"{shown.what} (already under way)"))
        if flight.error is not None:
            raise flight.error
        return flight.value

    def _compute(self, key: Hashable, flight: _Flight, compute) -> None:
        def report(what: str, fraction: float, detail: str = "") -> None:
            flight.progress = Progress(what, min(max(fraction, 0.0), 1.0), detail)

        try:
            value = compute(report)
        except BaseException as exc:  # noqa: BLE001  handed to every caller waiting for it
            flight.error = exc
            with self._lock:
                del self._flights[key]
        else:
            with self._lock:
                self._values[key] = flight.value = value
                self.computed += 1
                while len(self._values) > self.max_entries:
                    self._values.popitem(last=False)
                del self._flights[key]
        flight.done.set()


class ProgressBox:
    """What a page shows while engine work runs: an ``st.status`` titled ``title`` holding an
    ``st.progress`` bar whose text says what is being done (``Progress.line``). It appears with the first
    update, so work that finds its result cached shows nothing; updates are sent at most every
    ``interval`` seconds (and the first and the last always); ``close()`` removes it.

    Use as a context manager around the work; the box is the ``on_progress`` callback::

        with ProgressBox("Running the engine for this lesson") as box:
            value = cache.get(key, compute, on_progress=box)
    """

    def __init__(self, title: str, where=None, interval: float = 0.1) -> None:
        self.title = title
        self.interval = interval
        self._slot = (where if where is not None else st).empty()
        self._bar = None
        self._sent = 0.0
        self.updates = 0  # updates drawn (tests)

    def __call__(self, progress: Progress) -> None:
        now = time.monotonic()
        if self._bar is not None and now - self._sent < self.interval and progress.fraction < 1.0:
            return
        if self._bar is None:
            status = self._slot.status(self.title, expanded=True)
            self._bar = status.progress(progress.fraction, text=progress.line)
        else:
            self._bar.progress(progress.fraction, text=progress.line)
        self._sent = now
        self.updates += 1

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def close(self) -> None:
        self._slot.empty()
        self._bar = None

    def __enter__(self) -> "ProgressBox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def token_detail(step: int, tokens: int, total: int | None, known: bool = True) -> str:
    """"step 40, 320 of 5,126 tokens" (``known`` False: "of at most", when replies may stop early)."""
    if total is None:
        return f"step {step:,}, {tokens:,} tokens generated"
    return f"step {step:,}, {tokens:,} of {'' if known else 'at most '}{total:,} tokens"


# ------------------------------------------------------------------------------------------ the caches
# A lesson's runs are small (a few dozen steps of a 10-64 block pool): every lesson's runs fit many times
# over. A Compare result holds five whole runs (up to ~5,000 StepRecords over a 1,024-block pool, tens of
# MiB): a few of them, shared, instead of one per session.
LESSON_RUNS = RunCache(max_entries=128)
COMPARE_RUNS = RunCache(max_entries=6)
MODELS = RunCache(max_entries=4)


# ----------------------------------------------------------------------------------------- the model


def load_reporting(model: str, report) -> tuple:
    """``load_shared(model)``, saying what it does through ``report(what, fraction)``."""
    from engine.model_loader import load_shared, transformers_api

    report("Importing transformers and PyTorch (once per server start)", 0.05)
    transformers_api()  # the slow part of a first load: about 2 s of imports on 2 cores

    report(f"Reading the weights and tokenizer of {model}", 0.7)
    loaded = load_shared(model)
    report(f"Loaded {model}", 1.0)
    return loaded


def shared_model(model: str = EMBEDDED_MODEL, where=None) -> tuple:
    """(model, tokenizer), loaded once per process and shared read-only by every session, the lessons and
    Compare (``engine.model_loader.load_shared``); the first load shows its progress in ``where`` (default:
    the page). Kept by the folder's real path (``infra.class_limits.resolved_model_path``): every spelling of one
    folder is one copy. Raises ValueError (``ModelLoadError``) if it cannot be loaded (on a class server:
    a model it does not serve, before anything is read); that is not kept."""
    from infra.class_limits import check_model, resolved_model_path

    check_model(model)
    model = resolved_model_path(model)
    loaded = MODELS.peek(("model", model))
    if loaded is not None:
        return loaded
    with ProgressBox("Loading the model (once per server start)", where) as box:
        return MODELS.get(("model", model), lambda report: load_reporting(model, report), on_progress=box)


def preload_model(model: str = EMBEDDED_MODEL) -> None:
    """Start loading ``model`` in a background thread, once per process, so that the page that needs it
    next (a lesson that runs the engine, Compare) finds it loaded or in flight (it then shows this load's
    progress). Pages that run no engine call it: the lessons' overview, Compare before "Run all". A failed
    load is left to the page that needs the model, which says why."""
    from infra.class_limits import resolved_model_path

    model = resolved_model_path(model)
    with _PRELOAD_LOCK:
        if ("model", model) in MODELS or model in _PRELOADING:
            return
        _PRELOADING.add(model)

    def load() -> None:
        try:
            MODELS.get(("model", model), lambda report: load_reporting(model, report))
        except Exception:  # noqa: BLE001  the page that needs the model reports it
            pass
        finally:
            with _PRELOAD_LOCK:
                _PRELOADING.discard(model)

    threading.Thread(target=load, name=f"preload {model}", daemon=True).start()


_PRELOAD_LOCK = threading.Lock()
_PRELOADING: set[str] = set()
