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

``configure_threads`` applies it once, at a program's start (``python -m engine``, ``app.py``).

``LLMEngine`` used as a library (``engine_threads``, when the engine is built): a caller's choice stands, and
without one the engine chooses as vLLM's CPU backend does, since torch's default (one thread per core) is
what collapsed on a busy machine (issue 26: 0.17x vLLM's tokens/s at load ~15, while vLLM picked its own).

* The caller's choice, in this order: ``EngineConfig.num_threads`` (applied); ``OMP_NUM_THREADS`` or
  ``MKL_NUM_THREADS`` in the environment (torch read it at start); ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  (vLLM then leaves OpenMP alone: so does the engine); ``configure_threads`` or ``torch.set_num_threads``
  called before: the count differs from torch's default (the physical or logical cores of this process's
  CPU set) or from what the engine set last. A call that set exactly torch's default before any engine was
  built cannot be told from no call, and is treated as none.
* Otherwise ``library_num_threads``: vLLM's CPU worker (``vllm/utils/ompmultiprocessing.py``,
  ``OMPProcessManager``, ``VLLM_CPU_OMP_THREADS_BIND=auto``, its default) binds one OpenMP thread per
  physical core of the first NUMA node in the process's CPU set (x86 SMT siblings: one each) less
  ``reserve_cpu_num`` cores (1 on x86 / Arm, one per local worker; ``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides)
  that it keeps for the engine-core process's busy loop, unless that leaves none, and sets
  ``OMP_NUM_THREADS`` to that count (a list in ``VLLM_CPU_OMP_THREADS_BIND``, "0-3", takes those CPUs). vLLM
  does not look at other work; the lab also takes no more threads than cores are free now (``busy_cores``),
  as the CLI does, since its host work and the model share one process. Then ``torch.set_num_threads``, once:
  a later engine finds the count it set and keeps it. On this 2-core machine: 1 thread, as the peer harness
  runs vLLM.

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
VLLM_BIND = "VLLM_CPU_OMP_THREADS_BIND"
VLLM_RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# the count this module last set and why: by a program's choice (configure_threads, EngineConfig.num_threads) or
# as the library's default (engine_threads)
_chosen: dict = {"threads": None, "why": None, "by_caller": False}
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


def cpu_topology() -> list[tuple[int, int, tuple[int, int]]]:
    """(cpu id, NUMA node, physical core) of every logical CPU this process may run on, from /sys (vLLM reads
    the same through ``lscpu``); a CPU whose topology cannot be read counts as its own core on node 0."""
    import glob

    cpus = []
    for cpu in sorted(_affinity()):
        base = f"/sys/devices/system/cpu/cpu{cpu}"
        nodes = glob.glob(f"{base}/node[0-9]*")
        node = int(nodes[0].rsplit("node", 1)[1]) if nodes else 0
        try:
            with open(f"{base}/topology/physical_package_id") as f, open(f"{base}/topology/core_id") as g:
                core = (int(f.read()), int(g.read()))
        except (OSError, ValueError):
            core = (-1, cpu)
        cpus.append((cpu, node, core))
    return cpus


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> list[int]:
    """CPU ids of a list like "0-3,6" (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``). Raises ValueError naming it."""
    ids = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            ids.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{VLLM_BIND} must be 'auto', 'nobind' or a CPU list like '0-3,6', got {text!r}") from None
    if not ids:
        raise ValueError(f"{VLLM_BIND} must be 'auto', 'nobind' or a CPU list like '0-3,6', got {text!r}")
    return sorted(set(ids))


def vllm_cpu_threads(topology: list[tuple[int, int, tuple[int, int]]] | None = None) -> tuple[int, str]:
    """(threads, why) vLLM's CPU backend gives its one worker (see the module docstring): a CPU list in
    ``VLLM_CPU_OMP_THREADS_BIND`` (its count), else "auto": one per physical core of the first NUMA node of
    ``topology`` (default ``cpu_topology()``) less the reserved cores, unless that leaves none. Raises
    ValueError for a bad ``VLLM_CPU_OMP_THREADS_BIND`` or ``VLLM_CPU_NUM_OF_RESERVED_CPU``."""
    bind = os.environ.get(VLLM_BIND, "auto")
    if bind not in ("auto", "nobind"):
        cpus = parse_cpu_list(bind)
        return len(cpus), f"{VLLM_BIND}={bind}: {len(cpus)} CPUs"
    topology = cpu_topology() if topology is None else topology
    first = min(node for _, node, _ in topology)
    cores = len({core for _, node, core in topology if node == first})
    reserved = 1  # vLLM's reserve_cpu_num on x86 / Arm: one core per local worker, here one
    forced = os.environ.get(VLLM_RESERVED)
    if forced is not None:
        if not forced.isdigit():
            raise ValueError(f"{VLLM_RESERVED} must be an integer >= 0, got {forced!r}")
        reserved = int(forced)
    n = cores - reserved if cores > reserved else cores
    return n, f"vLLM's CPU backend: {cores} physical cores on NUMA node {first}, {reserved} kept for its engine core"


def library_num_threads(load: float | None = None, topology=None) -> tuple[int, str]:
    """(threads, why) for ``LLMEngine`` without a caller's choice: ``vllm_cpu_threads``, and no more than the
    cores free now (``available_cores`` less ``busy_cores``, or ``load``), at least 1. ``PAL_NUM_THREADS``
    overrides, as for the CLI."""
    forced = os.environ.get(ENV)
    if forced is not None:
        return choose_num_threads("cli")
    base, why = vllm_cpu_threads(topology)
    cores = available_cores()
    load = busy_cores() if load is None else load
    free = max(1, int(cores - load + 0.5))
    n = max(1, min(base, free))
    return n, f"{why}: {base}; {load:.1f} of {cores} cores busy with other work: {n}"


def torch_default_threads() -> set[int]:
    """The counts torch starts with when nobody set one: the physical cores (MKL's and PyTorch's thread pool
    default) or the logical CPUs (OpenMP's) of this process's CPU set."""
    topology = cpu_topology()
    return {len({core for _, _, core in topology}), len(topology)}


def callers_choice(current: int) -> str | None:
    """Who chose torch's ``current`` intra-op threads, when it was not this module's default: the
    environment, ``configure_threads`` or a ``torch.set_num_threads`` call (see the module docstring)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    if os.environ.get(VLLM_BIND) == "nobind":
        return f"{VLLM_BIND}=nobind: torch's own count"
    if _chosen["threads"] is None:
        if current not in torch_default_threads():
            return f"torch.set_num_threads({current}) before the engine"
        return None
    if current != _chosen["threads"]:
        return f"torch.set_num_threads({current}) since the engine set {_chosen['threads']}"
    return _chosen["why"] if _chosen["by_caller"] else None


def engine_threads(requested: int | None = None) -> tuple[int, str]:
    """Torch's intra-op threads for an ``LLMEngine`` being built, set now if needed; returns (threads, why).
    ``requested``: ``EngineConfig.num_threads`` (applied). Else a caller's choice stands (``callers_choice``);
    else the count this function set for an earlier engine stays; else ``library_num_threads`` is applied."""
    import torch

    if requested is not None:
        _set_threads(torch, requested, "EngineConfig.num_threads", by_caller=True)
        return requested, "EngineConfig.num_threads"
    current = torch.get_num_threads()
    caller = callers_choice(current)
    if caller is not None:
        return current, caller
    if _chosen["threads"] == current:  # this function chose it for an earlier engine
        return current, _chosen["why"]
    n, why = library_num_threads()
    _set_threads(torch, n, why, by_caller=False)
    return n, why


def _set_threads(torch, n: int, why: str, by_caller: bool) -> None:
    torch.set_num_threads(n)
    _chosen.update(threads=n, why=why, by_caller=by_caller)


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
    _set_threads(torch, n, f"configure_threads({role!r}): {why}", by_caller=True)
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
