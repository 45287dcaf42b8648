"""A big server pool grouped by root prefix and drawn (section ``watch-groups`` of docs/benchmarks.md).

    .venv/bin/python -m bench.watch_groups [--runs 5] [--write]

The Server page's mirror of a vLLM server's prefix cache (``engine.watch.cache_mirror.PrefixCacheMirror``)
holding 102,000 blocks (``big_pool``: 100 system prompts of 10 blocks, each extended by 20 to 182
conversations of 10 blocks) is grouped by root prefix (``engine.watch.groups.root_groups``) and its 20
largest trees drawn (``viz.server.groups_figure``), as the page does every refresh. Timed in CPU seconds
(``time.process_time``: a loaded machine stretches the wall clock, 2.6 s once under the test suite's two
workers) and wall seconds, median of runs. Goal: under 1 s of CPU for 10^5 blocks (issue 27, item 5).
tests/test_watch_servers_groups.py checks what the grouping and the figure say of the same pool.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from .report import write_section

ROOT = Path(__file__).resolve().parent.parent
GOAL_CPU_S = 1.0


def _h(i: int) -> str:
    return format(i, "064x")


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": [_h(x) for x in hashes],
            "parent_block_hash": None if parent is None else _h(parent), "token_ids": tokens,
            "block_size": 2, "lora_id": None, "medium": "GPU"}


def big_pool():
    """A mirror of 102,000 blocks: 100 system prompts of 10 blocks, each extended by 20 to 182 conversations of
    10 blocks (prompt p by 20 + 18 x (p mod 10)): the largest trees hold 10 + 182 x 10 blocks."""
    from engine.watch.cache_mirror import PrefixCacheMirror

    m = PrefixCacheMirror(max_blocks=200_000)
    n = 1
    seq = 0
    for p in range(100):
        root = n
        m.apply(seq, 1000.0 + seq, [_stored(list(range(n, n + 10)), None, [p] * 20)])
        seq += 1
        n += 10
        tail = root + 9
        events = []
        for c in range(20 + (p % 10) * 18):
            events.append(_stored(list(range(n, n + 10)), tail, [p, c] * 10))
            n += 10
        m.apply(seq, 1000.0 + seq, events)
        seq += 1
    return m


def one_run(pool) -> tuple[float, float]:
    """(CPU seconds, wall seconds) to group ``pool`` by root prefix and draw its 20 largest trees."""
    from engine.watch.groups import root_groups
    from viz.server import groups_figure

    c0, w0 = time.process_time(), time.perf_counter()
    groups = root_groups(pool)
    groups_figure(pool, top=20, groups=groups)
    return time.process_time() - c0, time.perf_counter() - w0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.watch_groups", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs (default 5), after one warm-up")
    ap.add_argument("--write", action="store_true", help="write section watch-groups of docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    pool = big_pool()
    load_start = os.getloadavg()[0]
    one_run(pool)  # warm-up (imports, plotly's first figure)
    cpu, wall = zip(*(one_run(pool) for _ in range(args.runs)))
    med = statistics.median(cpu)
    text = (f"## Server page: a pool of 10^5 blocks grouped and drawn (section `watch-groups`)\n\n"
            f"`python -m bench.watch_groups --runs {args.runs}` ({len(os.sched_getaffinity(0))} cores, load "
            f"average {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end): a prefix-cache mirror "
            f"of {pool.num_blocks:,} blocks (100 system prompts of 10 blocks, each extended by 20 to 182 "
            f"conversations of 10 blocks) grouped by root prefix (`engine.watch.groups.root_groups`) and its 20 "
            f"largest trees drawn (`viz.server.groups_figure`); median of runs (range). Goal: under "
            f"{GOAL_CPU_S:.0f} s of CPU.\n\n"
            f"| blocks | CPU, s | wall, s | goal met |\n| --- | --- | --- | --- |\n"
            f"| {pool.num_blocks:,} | {med:.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | {statistics.median(wall):.2f} "
            f"({min(wall):.2f}-{max(wall):.2f}) | {'yes' if med < GOAL_CPU_S else 'NO'} |\n")
    print(text)
    if args.write:
        write_section(ROOT / "docs" / "benchmarks.md", "watch-groups", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
