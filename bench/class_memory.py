"""One student cannot take the memory: a class server's resident memory while 30 sessions each open the
heaviest scenario link its caps allow, and after they close; writes the "class-memory" section of
docs/benchmarks.md (issue 23, item 14).

    nice -n 10 .venv/bin/python bench/class_memory.py                       # 30 sessions, as the issue asks
    nice -n 10 .venv/bin/python bench/class_memory.py --sessions 4 --duration 60 --no-write   # a quick check
    nice -n 10 .venv/bin/python bench/class_memory.py --calibrate           # the per-step formula's table

A fresh class server (``streamlit run app.py``, ``PAL_CLASS_SERVER=1``) on 127.0.0.1 with ``PAL_CLASS_SEATS``
= the sessions and ``PAL_SESSION_MEMORY_MB`` = ``--session-mb``: its configured memory is what it holds
before the class (the process, PyTorch, the model) plus the seats' shares. Students are real Streamlit sessions
over the websocket (``bench/class_load.py``'s ``Student``). Two phases, the server's RSS (``/proc``, VmRSS)
sampled every second throughout:

1. ``--tabs`` tabs open the default Playground and close (the issue: "20 tabs add about 17 MiB each, not
   given back 20 s after closing"): RSS with them open, and ``--after`` seconds after they closed.
2. ``--sessions`` sessions each open the heaviest link the caps allow (``heaviest_link``: 64 requests, the
   largest ``n`` and pool a session's share admits, ``max_tokens`` 400, every request running to its end,
   ``step=2000``), all at once; after ``--duration`` seconds they close. Reported: the charge each session was
   given before anything ran (``ui.class_server.session_plan``), the steps each had replayed, the RSS peak
   against the configured memory, and the RSS ``--after`` seconds after they closed.

``--calibrate`` instead measures what a recorded step keeps (tracemalloc) for the runs in
``infra.class_limits.recorded_step_bytes``'s table and prints it next to the formula's bound.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from bench.class_load import Student, free_port, start_server, stop_server, tree_rss_mib  # noqa: E402
from bench.report import write_section  # noqa: E402

MIB = 2**20
PROGRESS_RE = re.compile(rb"Running the link's steps: ([\d,]+) of")
ERROR_RE = re.compile(rb"(This link[^\x00-\x1f]{0,400})")


# ------------------------------------------------------------------------------------------ the link
def heavy_scenario(n: int, num_blocks: int, requests: int = 64, max_tokens: int = 400, max_model_len: int = 1024):
    """A scenario of ``requests`` requests with ``n`` samples each, ``max_tokens`` tokens each (``ignore_eos``:
    every sample runs to its end) on a pool of ``num_blocks`` blocks of 16."""
    from engine.scenarios.scenario_file import parse_scenario

    return parse_scenario({
        "name": f"heavy-{requests}x{n}", "settings": {"num_blocks": num_blocks, "block_size": 16,
                                                     "max_model_len": max_model_len},
        "requests": [{"prompt": f"ROMEO. Request {i} speaks", "max_tokens": max_tokens, "n": n, "temperature": 1.0,
                      "seed": i, "ignore_eos": True} for i in range(requests)]})


def heaviest_link(loaded, budget: int):
    """The heaviest link a class server with this environment admits at a session share of ``budget`` bytes:
    of 64 requests x n (64, 32, 16, 8, 4, 2, 1) on 4,096 ... 64 blocks of 16, the admitted one charging the
    most before its first step (pools, engines' state, page, the fewest recorded steps). Returns (scenario,
    plan)."""
    from infra import class_limits as limits
    from ui.class_server import session_plan
    from ui.state import scenario_settings

    best = None
    for n in (64, 32, 16, 8, 4, 2, 1):
        for blocks in (4096, 2048, 1024, 512, 256, 128, 64):
            scenario = heavy_scenario(n, blocks)
            try:
                plan = session_plan(scenario_settings(scenario), loaded, budget)
            except ValueError:
                continue
            need = plan.total - plan.history_steps * plan.step_bytes + limits.MIN_HISTORY_STEPS * plan.step_bytes
            if best is None or need > best[0]:
                best = (need, scenario, plan)
    if best is None:
        raise SystemExit(f"no heavy link fits a session share of {budget / MIB:.0f} MiB")
    return best[1], best[2]


# ------------------------------------------------------------------------------------------ sampling
@dataclass
class Trace:
    """The server's RSS over time: (seconds since the start, MiB, what was happening)."""

    pid: int
    t0: float = field(default_factory=time.monotonic)
    samples: list = field(default_factory=list)
    phase: str = "idle"

    def sample(self) -> float:
        rss = tree_rss_mib(self.pid)[0]
        self.samples.append((time.monotonic() - self.t0, rss, self.phase))
        return rss

    def peak(self, phase: str) -> float:
        return max((r for _, r, p in self.samples if p == phase), default=0.0)

    def last(self, phase: str) -> float:
        return next((r for _, r, p in reversed(self.samples) if p == phase), 0.0)


async def sampler(trace: Trace, stop: asyncio.Event, every: float = 1.0) -> None:
    while not stop.is_set():
        await asyncio.to_thread(trace.sample)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def wait_sampling(trace: Trace, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.to_thread(trace.sample)
        await asyncio.sleep(1.0)


# ------------------------------------------------------------------------------------------ sessions
@dataclass
class LinkSession:
    """A student opening a link: its first script run replays the link's steps (it does not finish within the
    benchmark); its messages are read as they come, for the replay's progress and any refusal."""

    student: Student
    steps: int = 0
    error: str = ""
    reader: asyncio.Task | None = None

    async def open(self, query: str) -> None:
        from streamlit.proto.BackMsg_pb2 import BackMsg

        await self.student.connect()
        msg = BackMsg()
        msg.rerun_script.query_string = query
        msg.rerun_script.page_script_hash = ""
        await self.student.ws.send(msg.SerializeToString())
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                raw = await self.student.ws.recv()
                for m in PROGRESS_RE.findall(raw):
                    self.steps = max(self.steps, int(m.replace(b",", b"")))
                if not self.error and (m := ERROR_RE.search(raw)):
                    self.error = m.group(1).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the socket closed
            return

    async def close(self) -> None:
        await self.student.ws.close()
        if self.reader is not None:
            self.reader.cancel()


async def tabs_phase(url: str, trace: Trace, tabs: int, after: float) -> dict:
    """``tabs`` default Playground tabs opened (each to its page's end), then closed; RSS before, open, after.
    A first tab, opened and closed before, loads PyTorch and the model (the server's own, not a tab's)."""
    trace.phase = "warm-up"
    first = Student(-1, url)
    await first.open_page()
    await first.close()
    await wait_sampling(trace, after)
    trace.phase = "before tabs"
    before = trace.sample()
    students = [Student(i, url) for i in range(tabs)]
    trace.phase = "tabs open"
    for s in students:  # one at a time, as tabs opened by one browser
        await s.open_page()
    await asyncio.sleep(2)
    opened = trace.sample()
    for s in students:
        await s.close()
    trace.phase = "tabs closed"
    await wait_sampling(trace, after)
    return {"tabs": tabs, "before": before, "open": opened, "after": trace.last("tabs closed"),
            "errors": [e for s in students for e in s.errors]}


async def link_phase(url: str, trace: Trace, sessions: int, query: str, duration: float, after: float,
                     ttl_wait: float = 0.0) -> dict:
    trace.phase = "before links"
    before = trace.sample()
    stop = asyncio.Event()
    trace.phase = "links open"
    task = asyncio.create_task(sampler(trace, stop))
    links = [LinkSession(Student(i, url)) for i in range(sessions)]
    t_open = time.monotonic()
    await asyncio.gather(*(s.open(query) for s in links))
    await asyncio.sleep(max(0.0, duration - (time.monotonic() - t_open)))
    stop.set()
    await task
    at_close = trace.sample()
    for s in links:
        await s.close()
    trace.phase = "links closed"
    t_closed = time.monotonic()
    await wait_sampling(trace, after)
    got = {"sessions": sessions, "before": before, "peak": trace.peak("links open"), "at_close": at_close,
           "after": trace.last("links closed"), "steps": [s.steps for s in links],
           "errors": [s.error for s in links if s.error], "ttl": None}
    if ttl_wait:  # past Streamlit's own hold on closed sessions (disconnectedSessionTTL), which it expires
        trace.phase = "past the TTL"  # only when a later connection comes: one tab opens and closes
        await wait_sampling(trace, max(0.0, ttl_wait - (time.monotonic() - t_closed)))
        late = Student(-2, url)
        await late.open_page()
        await late.close()
        await wait_sampling(trace, after)
        got["ttl"] = (round(time.monotonic() - t_closed), trace.last("past the TTL"))
    return got


# ------------------------------------------------------------------------------------------ the run
@dataclass
class Result:
    sessions: int
    session_mb: float
    budget: int
    scenario: object
    plan: object
    link_chars: int
    idle: float
    tabs: dict
    links: dict
    trace: Trace
    load: str

    @property
    def configured(self) -> float:
        """The server's configured memory: what it held before the class plus every seat's share (MiB)."""
        return self.links["before"] + self.sessions * self.budget / MIB


def measure(sessions: int, session_mb: float, duration: float, after: float, tabs: int,
            ttl_wait: float = 0.0) -> Result:
    from engine import EMBEDDED_MODEL
    from infra import class_limits as limits
    from engine.model_loader import load_shared
    from engine.scenarios.scenario_file import encode_link

    env = {limits.CLASS_SERVER_ENV: "1", limits.SEATS_ENV: str(sessions), limits.SESSION_MEMORY_ENV: f"{session_mb:g}"}
    os.environ.update(env)  # the server inherits it (start_server), and heaviest_link plans with it here
    budget = limits.session_budget_bytes(limits.class_limits())
    scenario, plan = heaviest_link(load_shared(EMBEDDED_MODEL), budget)
    code = encode_link(scenario)
    query = f"scenario={code}&step=2000"
    port = free_port()
    proc = start_server(port)
    url = f"http://127.0.0.1:{port}"
    trace = Trace(proc.pid)
    try:
        idle = trace.sample()

        async def both():
            got_tabs = await tabs_phase(url, trace, tabs, after) if tabs else {}
            got_links = await link_phase(url, trace, sessions, query, duration, after, ttl_wait)
            return got_tabs, got_links
        got_tabs, got_links = asyncio.run(both())
    finally:
        stop_server(proc)
    return Result(sessions, session_mb, budget, scenario, plan, len(code), idle, got_tabs, got_links, trace,
                  machine_load())


def machine_load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        one, five, _ = os.getloadavg()
        return f"load average {one:.2f}, {five:.2f}"


# ------------------------------------------------------------------------------------------ report
def run_text(r: Result, label: str) -> list[str]:
    links, tabs = r.links, r.tabs
    steps = sorted(links["steps"])
    s0 = r.scenario.requests[0]
    lines = [f"**{label}** (`uptime` at the end: {r.load})", "",
             "| what | MiB |", "|---|---:|",
             f"| server before any page | {r.idle:,.0f} |"]
    if tabs:
        lines += [f"| after one tab opened and closed (PyTorch and the model loaded) | {tabs['before']:,.0f} |"]
        per = (tabs["open"] - tabs["before"]) / tabs["tabs"]
        lines += [f"| {tabs['tabs']} default tabs open (from {tabs['before']:,.0f}: {per:,.1f} MiB a tab) | "
                  f"{tabs['open']:,.0f} |",
                  f"| the same, {r_after(r)} s after they closed | {tabs['after']:,.0f} |"]
    lines += [f"| before the {r.sessions} link sessions | {links['before']:,.0f} |",
              f"| **configured memory**: that + {r.sessions} seats x {r.budget / MIB:,.0f} MiB | "
              f"**{r.configured:,.0f}** |",
              f"| peak while the {r.sessions} sessions replayed their links | **{links['peak']:,.0f}** |",
              f"| when they closed | {links['at_close']:,.0f} |",
              f"| {r_after(r)} s after they closed | **{links['after']:,.0f}** |",
              *([f"| {links['ttl'][0]} s after they closed, one more tab having opened and closed (Streamlit "
                 f"drops a closed session 120 s after it closed, at the next connection) | {links['ttl'][1]:,.0f} |"]
                if links.get("ttl") else []),
              "",
              "RSS over time (s since the server started: MiB): " + over_time(r.trace),
              "",
              f"The link ({r.link_chars:,} characters): {len(r.scenario.requests)} requests x n = {s0.n}, "
              f"max_tokens {s0.max_tokens} (ignore_eos), pool {r.scenario.settings.num_blocks:,} x "
              f"{r.scenario.settings.block_size}, `step=2000`. Charged to each session before anything ran: "
              + ", ".join(f"{k} {v / MIB:,.1f} MiB" for k, v in r.plan.parts.items())
              + f" = {r.plan.total / MIB:,.1f} MiB of its {r.budget / MIB:,.0f} MiB share. Steps replayed per "
              f"session when they closed: min {steps[0]:,}, median {steps[len(steps) // 2]:,}, max {steps[-1]:,}"
              + (f"; refused or failed: {len(links['errors'])} ({links['errors'][0][:200]})" if links["errors"]
                 else "; none refused") + ". Within the configured memory: "
              + ("**yes**" if links["peak"] <= r.configured else "**NO**") + "."]
    return lines


def over_time(trace: Trace, every: float = 15.0) -> str:
    """The trace every ``every`` seconds, with where each phase starts."""
    shown, next_t, phase = [], 0.0, None
    for t, rss, p in trace.samples:
        if t >= next_t or p != phase:
            shown.append(f"{t:.0f}: {rss:,.0f}" + (f" ({p})" if p != phase else ""))
            next_t, phase = t + every, p
    return ", ".join(shown)


def r_after(r: Result) -> int:
    closed = [t for t, _, p in r.trace.samples if p == "links closed"]
    return round(closed[-1] - closed[0]) + 1 if closed else 0


def section(results: list[Result], duration: float, options: str = "") -> str:
    r = results[0]
    return "\n".join([
        "## One student cannot take the memory: heavy links on a class server (issue 23)",
        "",
        f"Command: `nice -n 10 python bench/class_memory.py{options}` ({len(results)} run"
        f"{'s' * (len(results) != 1)}, a fresh server each). A fresh class server (`streamlit run app.py`, `PAL_CLASS_SERVER=1`, "
        f"`PAL_CLASS_SEATS={r.sessions}`, `PAL_SESSION_MEMORY_MB={r.session_mb:g}`) on this shared 2-core CPU; "
        f"its RSS (`/proc`) sampled every second. First {r.tabs.get('tabs', 0)} tabs open the default Playground "
        f"one after another and close; then {r.sessions} sessions open the heaviest scenario link the caps admit "
        f"at once (`heaviest_link`: of 64 requests x n on up to 4,096 blocks, the one charged the most before "
        f"its first step) and close after {duration:g} s. Every session is charged before anything is "
        f"allocated (`ui.class_server.session_plan`, `infra.class_limits.plan_session`): its KV pools, the engines' "
        f"state for its sequences, Streamlit's session, and its recorded steps at the calibrated bound "
        f"(`infra.class_limits.recorded_step_bytes`); the steps kept are capped to what fits. A closed tab's lab is "
        f"released 10 s after its websocket went (`PAL_CLOSED_SECONDS`) and the heap trimmed (`malloc_trim`).",
        "",
        *[line for i, res in enumerate(results) for line in run_text(res, f"Run {i + 1}") + [""]],
    ])


# ------------------------------------------------------------------------------------------ calibration
def calibrate() -> str:
    """Measure what a recorded step keeps (tracemalloc) for the table in ``infra.class_limits.recorded_step_bytes``."""
    import gc
    import tracemalloc

    from engine import EMBEDDED_MODEL
    from infra import class_limits as limits
    from engine.model_loader import load_shared
    from engine.scenarios.scenario_file import parse_scenario
    from ui.lab import Lab
    from ui.state import scenario_settings

    os.environ[limits.CLASS_SERVER_ENV] = "1"
    loaded = load_shared(EMBEDDED_MODEL)
    rows = []
    for reqs, n, max_tokens, blocks, mml, words, view in ((16, 16, 100, 1024, 256, 0, True),
                                                          (64, 1, 200, 512, 512, 60, True),
                                                          (8, 1, 50, 256, 256, 0, False)):
        scenario = parse_scenario({"name": "calibrate", "settings": {"num_blocks": blocks, "block_size": 16,
                                                                     "max_model_len": mml},
                                   "requests": [{"prompt": "ROMEO. " + "word " * words + f"Request {i} speaks",
                                                 "max_tokens": max_tokens, "n": n, "temperature": 1.0, "seed": i,
                                                 "ignore_eos": True} for i in range(reqs)]})
        lab = Lab.create(scenario_settings(scenario, EMBEDDED_MODEL), loaded)
        lab.session.history_limit = None
        for _ in range(3):
            lab.step()
        gc.collect()
        tracemalloc.start()
        base, listed, tokens, steps = tracemalloc.get_traced_memory()[0], 0, 0, 30
        for _ in range(steps):
            lab.step()
            for record in lab.run.history[-1]:
                if record is not None:
                    if view:
                        record.snapshot.ref_counts  # noqa: B018 - built as a view builds it
                    listed += len(record.snapshot.sequences)
                    tokens += sum(len(s.token_ids) for s in record.snapshot.sequences)
        gc.collect()
        per = (tracemalloc.get_traced_memory()[0] - base) / steps
        tracemalloc.stop()
        bound = limits.recorded_step_bytes(lab.run_sizes())
        rows.append(f"| {reqs} x {n}, {max_tokens}, {blocks:,} x 16{'' if view else ' (no view)'} | "
                    f"{per / 1024:,.0f} KiB | {listed / steps:,.0f} | {tokens / steps:,.0f} | {bound / 1024:,.0f} KiB |")
    return "\n".join(["| run (requests x n, max_tokens, pool) | measured / step | sequences listed / step | "
                      "tokens listed / step | bound |", "| --- | ---: | ---: | ---: | ---: |", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=30, help="link sessions at once (and the seats)")
    parser.add_argument("--session-mb", type=float, default=64.0, help="PAL_SESSION_MEMORY_MB: one seat's share")
    parser.add_argument("--duration", type=float, default=240.0, help="seconds the link sessions stay open")
    parser.add_argument("--after", type=float, default=20.0, help="seconds measured after they close")
    parser.add_argument("--tabs", type=int, default=20, help="default tabs opened and closed first (0: none)")
    parser.add_argument("--runs", type=int, default=1, help="measure this many times (a fresh server each)")
    parser.add_argument("--ttl-wait", type=float, default=0.0,
                        help="also measure this many seconds after the sessions closed (e.g. 130: past "
                             "Streamlit's 120 s hold on closed sessions), after one more tab opens and closes")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="Markdown file to write")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--calibrate", action="store_true", help="print the per-step calibration table and exit")
    args = parser.parse_args(argv)
    if args.calibrate:
        print(calibrate())
        return 0
    if args.sessions < 1:
        parser.error(f"--sessions {args.sessions}: at least 1")
    results = []
    for i in range(args.runs):
        r = measure(args.sessions, args.session_mb, args.duration, args.after, args.tabs, args.ttl_wait)
        results.append(r)
        print("\n".join(run_text(r, f"Run {i + 1}")), flush=True)
    text = section(results, args.duration, "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])
                                                   if a not in ("--no-write",)))
    if not args.no_write:
        write_section(args.doc, "class-memory", text)
    else:
        print(text)
    return 0 if all(r.links["peak"] <= r.configured for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
