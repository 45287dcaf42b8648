"""How many CPU threads torch uses for one engine step: chosen on purpose, not left to torch's default.

Why it matters (issue 14's measurements, 2-core machine, the embedded model): torch's default intra-op
pool has one thread per core, and when those cores are busy with other work its threads spin and wait for
each other. On the same workload at the same moment, with another process busy on the machine, the lab ran
231 tokens/s with 2 threads and 2,484 tokens/s with 1; on a quiet machine 2 threads are about 1.5x faster
than 1 (2,533-2,767 vs 3,913-3,927 tokens/s here, the shared-prefix workload in V1 mode; ``bench/threads.py``
measures both cases and writes ``docs/benchmarks.md``). vLLM's CPU backend makes the same choice explicit
(``VLLM_CPU_OMP_THREADS_BIND``; the peer harness runs it with 1 thread).

The choice (``choose_num_threads``), by role:

* ``PAL_NUM_THREADS`` set: that many, always (an operator knows the machine best).
* ``"app"`` (the Streamlit server): 1. Every browser session steps its own engine in its own script thread
  of one process, and torch's intra-op threads are per process: with a class stepping at once, any pool
  wider than one thread per step oversubscribes the cores (the issue's class runs: 5-20 students).
* ``"cli"`` (``python -m engine``, benchmarks): the cores this process may run on
  (``os.sched_getaffinity``) less the cores busy with other work right now (``busy_cores``: /proc/stat over
  0.25 s), rounded, at least 1.

``configure_threads`` applies it once, at a program's start (``python -m engine``, ``app.py``); the library
(``LLMEngine``) never changes a process-wide setting behind its caller's back.

The garbage collector is the other process-wide setting (``configure_gc``, same callers): every step makes a
few thousand small objects (its record's sequence states and token lists), so CPython's youngest generation
(700 allocations by default) was collected several times a step, each pass walking the records kept so far.
A threshold of 20,000 took `chat-workload` with step records kept from 2,012-2,223 to 2,115-2,282 tokens/s
(3 alternated runs each, 1 thread; records dropped: 2,217-2,269), i.e. keeping records costs no longer
measurably. vLLM freezes its startup heap (``gc.freeze``) for the same reason; ``configure_gc`` does that too.
"""

from __future__ import annotations

import os

ENV = "PAL_NUM_THREADS"
_gc_configured = False
GC_THRESHOLD0 = 20_000  # allocations between collections of the youngest generation (CPython's default: 700)


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def choose_num_threads(role: str = "cli", cores: int | None = None, load: float | None = None) -> tuple[int, str]:
    """(threads, why) for ``role`` "cli" or "app"; ``cores`` / ``load`` default to this machine's.
    Raises ValueError for an unknown role or a ``PAL_NUM_THREADS`` that is not a positive integer."""
    if role not in ("cli", "app"):
        raise ValueError(f"role must be 'cli' or 'app', got {role!r}")
    forced = os.environ.get(ENV)
    if forced is not None:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"{ENV} must be a positive integer, got {forced!r}")
        return int(forced), f"{ENV}={forced}"
    if role == "app":
        return 1, "app: sessions step at once in one process; one thread per step avoids oversubscription"
    cores = available_cores() if cores is None else cores
    load = busy_cores() if load is None else load
    free = max(1, min(cores, int(cores - load + 0.5)))
    return free, f"{cores} cores, {load:.1f} busy with other work: {free} free"


def busy_cores(window_s: float = 0.25) -> float:
    """Cores busy right now, measured over ``window_s`` from /proc/stat (this process is idle meanwhile, so
    it is other work). Not the load average: that lags a minute and counts work already gone, e.g. the
    previous run of a benchmark (measured: load 0.6 on an idle machine made the choice 1 thread instead of
    2). Falls back to the 1-minute load average where /proc/stat is missing."""
    import time

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    a = sample()
    if a is None:
        return os.getloadavg()[0]
    time.sleep(window_s)
    b = sample()
    total, idle = b[0] - a[0], b[1] - a[1]
    return 0.0 if total <= 0 else (os.cpu_count() or 1) * (total - idle) / total


def configure_threads(role: str = "cli") -> tuple[int, str]:
    """Set torch's intra-op threads for this process as ``choose_num_threads`` says; returns (n, why)."""
    import torch

    n, why = choose_num_threads(role)
    torch.set_num_threads(n)
    return n, why


def configure_gc() -> None:
    """Collect once, freeze what is alive now (the loaded modules: never garbage, never walked again) and
    collect the youngest generation every ``GC_THRESHOLD0`` allocations instead of 700 (see above). Once per
    process: Streamlit runs ``app.py`` again on every interaction, and a full collection is not free."""
    import gc

    global _gc_configured
    if _gc_configured:
        return
    _gc_configured = True
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, gen1, gen2)
