"""Torch intra-op threads for one engine, on a quiet and on a busy machine (``engine/threads.py``'s choice).

    .venv/bin/python -m bench.threads [--runs 3] [--write]

Each run is a fresh process (``torch.set_num_threads`` is per process) that runs the shared-prefix workload of
``peer/workload.py`` (20 requests, 48 greedy tokens each) through the V1 engine with step records on, as the app
uses it, and reports tokens/s. Settings alternate run by run (1, 2, auto, 1, 2, auto, ...) so a drift in the
machine's load touches them alike. "busy" starts ``--burners`` processes that spin on a core each (other work
on the machine) for the whole measurement. ``--write`` puts the table in docs/benchmarks.md (section ``cpu-threads``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine.threads import busy_cores

from .report import write_section

ROOT = Path(__file__).resolve().parent.parent
ONE_RUN = r"""
import sys, time, torch
from engine import LLMEngine, SamplingParams
from engine.scenarios.run_spec import RunSpec
from engine.threads import choose_num_threads
from peer.workload import shared_prefix_requests
setting = sys.argv[1]
n = choose_num_threads("cli")[0] if setting == "auto" else int(setting)
torch.set_num_threads(n)
e = LLMEngine(RunSpec(semantics="v1", block_size=32, num_blocks=512, max_model_len=512, device="cpu",
                      dtype="float32").engine_config("paged"))
for r in shared_prefix_requests(max_tokens=48):
    e.add_request(r.prompt_token_ids, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
t0 = time.perf_counter()
records = []
while e.has_unfinished():
    records.append(e.step())
dt = time.perf_counter() - t0
print(n, sum(len(r.new_tokens) for r in records) / dt)
"""


def one_run(setting: str) -> tuple[int, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PAL_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", ONE_RUN, setting], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=600, check=True).stdout.split()
    return int(out[-2]), float(out[-1])


def measure(runs: int) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {"1": [], "2": [], "auto": []}
    for _ in range(runs):
        for setting in out:
            out[setting].append(one_run(setting))
    return out


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.threads")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    rows = []
    for case in ("quiet", "busy"):
        procs = burners(args.burners) if case == "busy" else []
        try:
            if procs:
                time.sleep(2)
            load = busy_cores(1.0)
            result = measure(args.runs)
        finally:
            for p in procs:
                p.kill()
        for setting, vals in result.items():
            tps = [v for _, v in vals]
            rows.append(f"| {case} ({load:.1f} cores busy) | {setting} | {', '.join(str(n) for n, _ in vals)} | "
                        f"{statistics.median(tps):,.0f} | {min(tps):,.0f}-{max(tps):,.0f} |")
    table = "\n".join(["| machine | threads asked | threads used | tokens/s (median) | range |",
                       "| --- | --- | --- | --- | --- |", *rows])
    text = (f"## CPU: torch threads per engine, quiet and busy (section `cpu-threads`)\n\n"
            f"`python -m bench.threads --runs {args.runs}` on {cores} cores: the shared-prefix workload (20 requests, "
            f"48 greedy tokens each) in V1 mode with step records on, one fresh process per run, settings alternated "
            f"run by run; busy = {args.burners} processes spinning on a core each. \"auto\" is `engine/threads.py`'s "
            f"choice for the CLI (cores less the 1-minute load average); the app always uses 1.\n\n{table}\n")
    print(text)
    if args.write:
        write_section(ROOT / "docs" / "benchmarks.md", "cpu-threads", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
