"""The fast tier (``-m "not slow"``) holds no test that runs a Streamlit page, a server, a browser, vLLM, another
Python or a benchmark-sized workload: conftest marks them from their code (tests/conftest.py NEEDS)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache  # one collection per argument list per worker (each is a pytest start: ~15 s on 2 cores)
def collected_in_order(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def collected(*args: str) -> set[str]:
    return set(collected_in_order(*args))


def test_the_fast_tier_holds_only_what_needs_nothing_slow():
    order = collected_in_order("-m", "not slow")
    fast = set(order)
    # files are handed to the xdist workers longest first (conftest COST, from the whole file before the tier is
    # selected): a file's tests stay together, and a file of vLLM runs comes before the block manager's
    runs = [node.split("::")[0] for node in order]
    files_in_order = [f for i, f in enumerate(runs) if i == 0 or runs[i - 1] != f]
    assert len(files_in_order) == len(set(files_in_order)), "a file's tests are split"
    assert files_in_order.index("tests/test_vllm_server.py") < files_in_order.index("tests/test_block_manager.py")
    files = {node.split("::")[0] for node in fast}
    # a whole module of AppTest pages, of browsers, of vLLM: none of its tests is fast
    for module in ("tests/test_app.py", "tests/test_browser_stage.py",
                   "tests/test_conformance.py", "tests/test_server_events.py"):
        assert module not in files, module
    # a test reached through a helper of another test file (test_app.new_app runs AppTest)
    assert "tests/test_ui_semantics.py::test_parallel_sampling_in_the_paper_semantics_copies_on_write" not in fast
    # a subprocess, a workload preset named in a list literal, kaleido's Chromium, the app's Lab
    for node in ("tests/test_cli.py::test_batch_json_through_the_real_entry_point",
                 "tests/test_vllm_server.py::test_server_answers_and_serves_metrics",
                 "tests/test_contiguous.py::test_lesson_lengths_reproduce_the_lesson",
                 "tests/test_export.py::test_gif_has_one_frame_per_step",
                 "tests/test_stage_runs.py::test_run_to_the_end_runs_every_step_once"):
        assert node not in fast, node
    # what the tier is for stays in it: the block manager, the scheduler, exactness against transformers
    for module in ("tests/test_block_manager.py", "tests/test_scheduler_v1.py", "tests/test_exactness.py"):
        assert module in files, module
    assert len(fast) > 500


def test_a_need_is_also_a_marker_to_select_by():
    browser = collected("-m", "browser")
    assert browser and all(n.startswith(("tests/test_browser", "tests/test_class", "tests/test_export")) for n in browser)
    assert "tests/test_export.py::test_gif_has_one_frame_per_step" in browser  # kaleido drives a Chromium


def test_files_are_collected_longest_measured_first():
    from conftest import FILE_DURATIONS

    table = json.loads(FILE_DURATIONS.read_text())
    # the fast tier's collection (the ranking is made before the tier is selected; test_tiers collects it too)
    runs = [node.split("::")[0] for node in collected_in_order("-m", "not slow")]
    files = [f for i, f in enumerate(runs) if i == 0 or runs[i - 1] != f]
    measured = [f for f in files if f in table]
    assert len(measured) > 40
    assert [table[f] for f in measured] == sorted((table[f] for f in measured), reverse=True)
