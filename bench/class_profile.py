"""``streamlit run`` with every script run profiled: where a Step's time goes on a loaded server.

    python bench/class_profile.py OUT.prof app.py --server.port 8601 ...   (``bench/class_load.py --profile``)
    python bench/class_profile.py --summary OUT.prof                      (CPU ms per script run, by phase)

py-spy is not available here, so: cProfile timed by the thread's CPU time (``time.thread_time``: on a shared,
loaded machine wall-clock profiles count every wait for the GIL or a core against whatever ran then), one
profiler per script run (``ScriptRunner._run_script``,
which runs in each session's own script thread; cProfile profiles only the thread it is enabled in), all
merged into ``OUT.prof`` (read it with ``pstats``); the server's main thread (the event loop that
serialises and sends every ForwardMsg) is profiled apart into ``OUT.prof.main``. ``OUT.prof.runs`` holds
one line per script run: wall seconds and the thread's CPU seconds. Written at exit (SIGTERM stops the
server cleanly). The profiler roughly doubles the time of Python-heavy code, so read the shares, not the
absolute times.
"""

from __future__ import annotations

import atexit
import cProfile
import pstats
import sys
import threading
import time


def install(out: str) -> None:
    from streamlit.runtime.scriptrunner import script_runner

    lock = threading.Lock()
    merged: list[pstats.Stats] = []
    runs: list[tuple[float, float]] = []
    original = script_runner.ScriptRunner._run_script

    def profiled(self, rerun_data):
        prof = cProfile.Profile(time.thread_time)  # CPU time of this thread: waits for the GIL or the cores do not count
        t0, c0 = time.perf_counter(), time.thread_time()
        prof.enable()
        try:
            return original(self, rerun_data)
        finally:
            prof.disable()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            with lock:
                runs.append((wall, cpu))
                if merged:
                    merged[0].add(prof)
                else:
                    merged.append(pstats.Stats(prof))

    script_runner.ScriptRunner._run_script = profiled
    main = cProfile.Profile(time.thread_time)
    main.enable()

    def dump() -> None:
        main.disable()
        main.dump_stats(out + ".main")
        with lock:
            if merged:
                merged[0].dump_stats(out)
            with open(out + ".runs", "w") as f:
                f.writelines(f"{w:.4f} {c:.4f}\n" for w, c in runs)

    atexit.register(dump)


# the phases of a Playground script run after a Step click, by the function that runs each (file, name)
PHASES = [
    ("whole script run (ScriptRunner._run_script)", "script_runner.py", "_run_script"),
    ("  the engine step (Lab.press, in the stage)", "lab.py", "press"),
    ("  app.py (full runs: the whole script, the page included)", "app.py", "<module>"),
    ("  Playground page (main, full runs)", "playground.py", "main"),
    ("    sidebar settings form", "playground.py", "settings_form"),
    ("    sidebar request form", "playground.py", "request_form"),
    ("  the stage (the fragment a Step re-runs)", "playground.py", "stage"),
    ("    controls row", "playground.py", "controls"),
    ("    views", "playground.py", "views"),
    ("      metrics row", "playground.py", "metrics_row"),
    ("      pools (3 figures)", "playground.py", "pools"),
    ("        block_pool_figure", "pool.py", "block_pool_figure"),
    ("        paged_slots_figure", "region.py", "paged_slots_figure"),
    ("        contiguous_region_figure", "region.py", "contiguous_region_figure"),
    ("      step in words", "playground.py", "step_in_words"),
    ("      block tables and generated text (1 figure)", "playground.py", "tables_and_text"),
    ("      timeline (2 figures)", "playground.py", "timeline"),
    ("        timeline_figure", "timeline.py", "timeline_figure"),
    ("        step_tokens_figure", "steps.py", "step_tokens_figure"),
    ("  st.plotly_chart, all 6 (figure to JSON, element id, protobuf)", "plotly_chart.py", "plotly_chart"),
    ("  after the run: gc.collect (runner.postScriptGC)", "~", "<built-in method gc.collect>"),
]


def summary(path: str) -> list[tuple[str, float, int]]:
    """(phase, CPU ms per script run, calls) from a merged profile written by this module."""
    stats = pstats.Stats(path).stats
    runs = sum(nc for (f, _, name), (_, nc, *_rest) in stats.items() if name == "_run_script")
    out = []
    for label, file, name in PHASES:
        ct = sum(v[3] for (f, _, n), v in stats.items() if n == name and f.endswith(file))
        calls = sum(v[1] for (f, _, n), v in stats.items() if n == name and f.endswith(file))
        out.append((label, 1000 * ct / max(runs, 1), calls))
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--summary"]:
    for label, ms, calls in summary(sys.argv[2]):
        print(f"{ms:8.1f} ms/run  {calls:5d} calls  {label}")
elif __name__ == "__main__":
    out, *args = sys.argv[1:]
    install(out)
    from streamlit.web import cli

    sys.argv = ["streamlit", "run", *args]
    try:
        cli.main()
    except SystemExit:
        pass
