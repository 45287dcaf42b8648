"""How long a learner waits for a lesson page's first visit and for a Compare run, as the app runs them: the
``app-first-visit`` section of docs/benchmarks.md.

    .venv/bin/python -m bench.lessons_speed [--reps 3] [--only lessons|compare] [--before DIR] [--write]

Every measurement is a fresh process (no run kept by ``infra.runs``, no Streamlit cache, the engine cold)
driving ``app.py`` under ``streamlit.testing.v1.AppTest``, as the pages are drawn for a browser (server
side; the browser's own drawing is not counted); medians of ``--reps`` processes.

Lessons, nothing answered yet (a learner arriving): the Lessons overview is opened first (untimed), then
the lesson (timed):
  * "first visit, model not loaded": a fresh server whose model nobody has loaded yet (the overview's
    background preload is switched off for this one); the process has already imported PyTorch and drawn
    the overview, so a browser's direct link to a server that has served nothing yet waits longer by
    Streamlit's session start and those imports (3.5-4.4 s more, measured in Chromium at load 1-2);
  * "first visit, model loaded": the model already loaded (by the Playground, the app's landing page, or by
    the background preload the overview and the lessons start), the lesson's engine runs not yet;
  * "repeat visit": the same session back on the page after the overview (its runs kept).
Compare, each ``compare=True`` scenario (seed 0, the paper's semantics): the model loaded first (untimed),
"Run all" clicked (timed to the finished page); "paged" and "contiguous" are the engine runs inside it
(``engine.scenarios.workloads.run_workload`` timed per call); "again" is another session clicking "Run all" with the
same settings afterwards. ``--before DIR``: a copy of the tree before a change (``git archive <commit> | tar -x
-C DIR``); each Compare measurement then alternates a process of that tree's app and one of this tree's, so a
drift in the machine's load touches both alike, and the table gives both.

With ``--only``, ``--write`` replaces only that part of the section (its "### " block), keeping the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.report import write_section  # noqa: E402

APP = str(ROOT / "app.py")


def _quiet() -> None:
    import logging

    logging.getLogger("streamlit").setLevel(logging.ERROR)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("streamlit"):
            logging.getLogger(name).setLevel(logging.ERROR)


def _app():
    from streamlit.testing.v1 import AppTest

    return AppTest.from_file(APP, default_timeout=600)


def _timed_run(at) -> float:
    t0 = time.perf_counter()
    at.run()
    seconds = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(f"the page raised: {[e.value for e in at.exception]}")
    return seconds


def _load_model() -> None:
    """Load the shared model the way the app does (untimed), so only the page's own work is measured."""
    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_shared

    try:
        from infra import runs
    except ImportError:  # before infra/runs.py (lessons/runs.py before it): the app's pages load through load_shared
        load_shared(EMBEDDED_MODEL)
        return
    runs.MODELS.get(("model", EMBEDDED_MODEL), lambda report: runs.load_reporting(EMBEDDED_MODEL, report))


def one_lesson(number: int, model_loaded: bool) -> dict:
    """A lesson's first visit (and, with the model loaded, a repeat visit) in this fresh process."""
    from lessons import catalog

    lesson = next(l for l in catalog() if l.number == number)
    if model_loaded:
        _load_model()
    at = _app()
    at.switch_page("ui/lessons.py")
    try:
        from infra import runs
        preload, runs.preload_model = runs.preload_model, lambda *a, **k: None
    except ImportError:
        runs = None
    _timed_run(at)  # the overview: no engine (and here no background preload: a direct link's first visit)
    if runs is not None:
        runs.preload_model = preload
    at.switch_page(lesson.page_path)
    first = _timed_run(at)
    at.switch_page("ui/lessons.py")
    _timed_run(at)
    at.switch_page(lesson.page_path)
    return {"first": first, "repeat": _timed_run(at)}


def one_compare(name: str) -> dict:
    """A Compare run of ``name`` (seed 0, the paper's semantics) in this fresh process, then another
    session's run of the same settings."""
    import engine.scenarios.workloads as workloads

    _load_model()
    spent = {"paged": 0.0, "contiguous": 0.0}
    run_workload = workloads.run_workload

    def timed(engine, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run_workload(engine, *args, **kwargs)
        finally:
            spent[engine.config.allocator] += time.perf_counter() - t0
    workloads.run_workload = timed  # the page imports it from engine.scenarios.workloads on every run

    def click(at) -> float:
        at.switch_page("ui/compare.py")
        _timed_run(at)
        next(s for s in at.selectbox if s.label == "Workload").set_value(name)
        _timed_run(at)
        next(b for b in at.button if b.label == "Run all").click()
        seconds = _timed_run(at)
        if at.error:
            raise RuntimeError(f"Compare said: {[e.value for e in at.error]}")
        return seconds
    total = click(_app())
    first = dict(spent)  # the engine runs of the first click (the second may find them kept)
    again = click(_app())
    return {"total": total, "paged": first["paged"], "contiguous": first["contiguous"], "again": again}


def _child(args: list[str], root: Path = ROOT) -> dict:
    """One measurement in a fresh process of the tree at ``root`` (its own app, engine and this bench's child)."""
    out = subprocess.run([sys.executable, "-m", "bench.lessons_speed", "--one", *args], cwd=root,
                         capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="fresh processes per measurement (median)")
    parser.add_argument("--only", choices=["lessons", "compare"])
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks.md section app-first-visit")
    parser.add_argument("--before", type=Path, help="a copy of the tree before a change: Compare alternates it "
                                                    "with this tree")
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a child: one measurement, one JSON line
        from engine.threads import configure_threads

        configure_threads("app")  # as app.py: one intra-op thread
        _quiet()
        kind, what = args.one[0], args.one[1]
        result = (one_lesson(int(what), model_loaded=args.one[2] == "loaded") if kind == "lesson"
                  else one_compare(what))
        print(json.dumps(result), flush=True)
        return 0

    from engine.scenarios.presets import SCENARIOS
    from lessons import catalog

    load = os.getloadavg()[0]
    lesson_rows, compare_rows = [], []
    if args.only in (None, "lessons"):
        for lesson in catalog():
            cold, warm = [], []
            for _ in range(args.reps):  # alternated, so a drift in the machine's load touches both alike
                cold.append(_child(["lesson", str(lesson.number), "cold"]))
                warm.append(_child(["lesson", str(lesson.number), "loaded"]))
            row = (f"{lesson.number}. {lesson.title}", median(cold, "first"), median(warm, "first"),
                   median(warm, "repeat"))
            lesson_rows.append(row)
            print(f"lesson {row[0]}: first visit {row[1]:.2f} s (model not loaded), {row[2]:.2f} s (model "
                  f"loaded), repeat {row[3]:.2f} s", flush=True)
    lessons_load = (load, os.getloadavg()[0])
    if args.only in (None, "compare"):
        for name in [n for n, s in SCENARIOS.items() if s.compare]:
            before, after = [], []
            for _ in range(args.reps):  # alternated, as above
                if args.before is not None:
                    before.append(_child(["compare", name], root=args.before))
                after.append(_child(["compare", name]))
            row = (name, median(after, "paged"), median(after, "contiguous"), median(after, "total"),
                   median(after, "again"), median(before, "total") if before else None,
                   median(before, "contiguous") if before else None)
            compare_rows.append(row)
            print(f"compare {name}: paged {row[1]:.1f} s, contiguous {row[2]:.1f} s, total {row[3]:.1f} s, "
                  f"again {row[4]:.2f} s" + (f"; before: total {row[5]:.1f} s, contiguous {row[6]:.1f} s"
                                             if before else ""), flush=True)
    compare_load = (lessons_load[1], os.getloadavg()[0])
    parts = {
        "head": "\n".join([
            "## Lesson pages' first visit and Compare runs (server side, this 2-core CPU, embedded model)",
            "",
            "Command: `python -m bench.lessons_speed`. Medians of fresh processes (nothing kept, no Streamlit "
            "cache), one torch thread as in the app, under AppTest. Targets (issue 26): a lesson's first visit "
            "within 3 s, Compare's first run within 3 s for every preset, progress shown for anything longer "
            "than a second."]),
        "lessons": "\n".join([
            "### Lessons",
            "",
            f"Medians of {args.reps} processes each; load average {lessons_load[0]:.1f} at the start, "
            f"{lessons_load[1]:.1f} at the end.",
            "",
            "| page | first visit, model not loaded (s) | first visit, model loaded (s) | repeat visit (s) |",
            "|---|---:|---:|---:|",
            *[f"| {t} | {a:.2f} | {b:.2f} | {c:.2f} |" for t, a, b, c in lesson_rows]]) if lesson_rows else None,
        "compare": "\n".join([
            "### Compare",
            "",
            f"Medians of {args.reps} processes each" + (
                ", before (the tree without token replay) and after alternating" if args.before else "")
            + f"; load average {compare_load[0]:.1f} at the start, {compare_load[1]:.1f} at the end (1-minute; "
            "other work shared the 2 cores). \"contiguous\" is the four baselines' engine runs; after the change "
            "they replay the paged run's tokens (`engine.replay_runner`) instead of running the model.",
            "",
            *(["| Compare preset | before: total, click to table (s) | before: contiguous, 4 policies (s) | "
               "after: paged (s) | after: contiguous, 4 policies (s) | after: total, click to table (s) | again, "
               "any session (s) |",
               "|---|---:|---:|---:|---:|---:|---:|",
               *[f"| {n} | {b:.1f} | {bc:.1f} | {p:.1f} | {c:.1f} | {t:.1f} | {a:.2f} |"
                 for n, p, c, t, a, b, bc in compare_rows]] if args.before else
              ["| Compare preset | paged (s) | contiguous, 4 policies (s) | total, click to table (s) | again, any "
               "session (s) |",
               "|---|---:|---:|---:|---:|",
               *[f"| {n} | {p:.1f} | {c:.1f} | {t:.1f} | {a:.2f} |" for n, p, c, t, a, _, _ in compare_rows]]),
        ]) if compare_rows else None,
    }
    kept = _kept_parts(ROOT / "docs" / "benchmarks.md") if args.write else {}
    text = "\n\n".join(p for p in (parts["head"], parts["lessons"] or kept.get("lessons"),
                                     parts["compare"] or kept.get("compare")) if p)
    print(text)
    if args.write:
        write_section(ROOT / "docs" / "benchmarks.md", "app-first-visit", text)
    return 0


def _kept_parts(path: Path) -> dict:
    """The "### Lessons" and "### Compare" blocks of the section now in ``path`` (what ``--only`` keeps)."""
    text = path.read_text() if path.exists() else ""
    start, end = "<!-- app-first-visit:start -->", "<!-- app-first-visit:end -->"
    if start not in text or end not in text:
        return {}
    section = text.split(start, 1)[1].split(end, 1)[0]
    blocks = {block.split("\n", 1)[0].strip().lower(): "### " + block.strip() for block in section.split("\n### ")[1:]}
    if not blocks and "| page |" in section:  # a section written before the parts had headings
        import re

        lines = section.splitlines()
        first = next(i for i, line in enumerate(lines) if line.startswith("| page |"))
        table = lines[first:next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))]
        load = re.search(r"load average ([0-9.]+) at the start", section)
        blocks["lessons"] = "\n".join(["### Lessons", "", "Kept from the section's earlier run (medians of 3 "
                                        f"processes each; load average {load.group(1) if load else '?'} at the "
                                        "start).", "", *table])
    return blocks


if __name__ == "__main__":
    sys.exit(main())
