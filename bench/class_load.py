"""A class at once: N simulated students stepping the Playground on one server; writes the "class-load"
section of docs/benchmarks.md.

    nice -n 10 .venv/bin/python bench/class_load.py                 # 10, 30 and 60 students
    nice -n 10 .venv/bin/python bench/class_load.py --students 10 --rounds 4 --profile /tmp/steps.prof

Each student is a real Streamlit session over the websocket (``/_stcore/stream``), speaking the browser's
protocol with Streamlit's own protobufs: a ``BackMsg.rerun_script`` carries the widget states, the server
answers with ``ForwardMsg``s (``new_session``, deltas, ..., ``script_finished``). The Step button's widget
id (key ``stage_step``) and the fragment it is drawn in are read from the page's deltas; a Step click is a
rerun of that fragment with a ``trigger_value`` for it, as the browser sends one. A Step's time is from
sending that BackMsg to its ``script_finished``. Before its websocket, a student GETs the health check as a
browser does, and sends back the cookies it was given (behind ``scripts/class_server.py`` the proxy's
``pal_worker`` cookie keeps it on one worker).

One fresh class server (``PAL_CLASS_SERVER=1``) per class size and ``--workers`` count (sessions of an
earlier size would still hold memory): ``streamlit run app.py``, or with ``--workers N`` > 1
``scripts/class_server.py --workers N`` (N Streamlit processes behind nginx).
Every student first opens the page (its own Lab, the default "batch" preset), adds a custom request whose
prompt carries a marker unique to it, and steps once (warm-up). Then ``--rounds`` rounds: in each, every
student clicks Step at the same moment (the class "stepping at once") and the round ends when every page
has finished. Reported: median and p95 Step time, Step clicks served per second (all clicks / wall time of
the rounds), the server's resident memory (``/proc/PID/status`` of each of its processes: VmRSS after
the rounds and the peak VmHWM, summed), bytes sent per Step, and isolation: every student sees its own
marker and its own Lab token (the stage counter's ``token``), and no other student's marker or token ever
appears in its messages.

``--profile PATH``: the server runs under ``bench/class_profile.py``, which profiles every script run with
cProfile (per ScriptRunner thread) and writes the merged stats to PATH when the server stops; the
profiler's own cost inflates every time, so profiled runs are reported apart.

Goals (issue 16): 30 students median <= 0.5 s and p95 <= 1.5 s; 60 students p95 <= 3 s. A bench, not a
timed test; ``tests/test_classroom.py`` runs it with 2 students and ``tests/test_class_workers.py`` with 4
students behind nginx, so it cannot rot.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from bench.report import write_section  # noqa: E402

GOALS = {30: (0.5, 1.5), 60: (None, 3.0)}  # students -> (median, p95) goal in seconds (issue 16)
STEP_KEY = "stage_step"
PROMPT_LABEL = "Prompt"
ADD_LABEL = "Add request (also mid-run)"
TOKEN_RE = re.compile(rb'"token":\s*"([0-9a-f]{12})"')  # the stage counter's lab token in its component data
TAG_RE = re.compile(rb"<[^>]*>")  # generated text is tinted token by token: one <span> per token
MARKER_ALPHABET = "BCDFGHJKLMNPQRSTVWXZ"  # capitals, no vowels: a marker is no English word


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, linear between the closest ranks."""
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (a class server's workers and nginx), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def tree_rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) summed over ``pid``'s process tree, in MiB (the peaks' sum bounds the joint peak)."""
    rss = peak = 0.0
    for p in process_tree(pid):
        try:
            r, h = rss_mib(p)
        except (OSError, KeyError):
            continue
        rss, peak = rss + r, peak + h
    return rss, peak


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid``'s process tree, from /proc/PID/stat."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat), in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process ``pid`` in MiB, from /proc (psutil is not installed here)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024  # kB
    return fields["VmRSS"], fields["VmHWM"]


# ------------------------------------------------------------------------------------------------ server
def start_server(port: int, profile: str | None = None, options: tuple[str, ...] = (),
                 workers: int = 1) -> subprocess.Popen:
    """A class server (``PAL_CLASS_SERVER=1``) on ``port``, once healthy: ``streamlit run app.py`` (or
    ``bench/class_profile.py`` around it), or with ``workers`` > 1 ``scripts/class_server.py`` (that many
    Streamlit processes behind nginx, as a class would run it). ``options``: extra Streamlit config options,
    "name=value" (e.g. "runner.postScriptGC=false")."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAL_CLASS_SERVER": "1"}
    options = [f"--{o}" for o in options]
    if workers > 1:
        if profile:
            raise ValueError("--profile profiles one server process: use it with --workers 1")
        cmd = [sys.executable, str(ROOT / "scripts" / "class_server.py"), "--workers", str(workers), "--port",
               str(port), "--address", "127.0.0.1", "--first-worker-port", str(free_port()), *options]
    else:
        args = ["app.py", "--server.port", str(port), "--server.address", "127.0.0.1", "--server.headless",
                "true", *options]
        if profile:
            cmd = [sys.executable, str(_HERE / "class_profile.py"), profile, *args]
        else:
            cmd = [sys.executable, "-m", "streamlit", "run", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start within 240 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # the profiler writes its stats on SIGTERM
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _cookies_of(url: str) -> str:
    """The cookies a GET of ``url`` sets, as a ``Cookie`` header value."""
    with urllib.request.urlopen(url, timeout=60) as response:
        return "; ".join(c.split(";", 1)[0] for c in response.headers.get_all("Set-Cookie") or [])


# ----------------------------------------------------------------------------------------------- student
@dataclass
class Student:
    """One simulated student: a Streamlit session over the websocket."""

    index: int
    url: str
    marker: str = field(default_factory=lambda: "".join(secrets.choice(MARKER_ALPHABET) for _ in range(10)))
    ws: object = None
    page_hash: str = ""
    ids: dict = field(default_factory=dict)  # (element type, label or key) -> widget id
    fragments: dict = field(default_factory=dict)  # widget id -> the id of the fragment that drew it, if any
    tokens: set = field(default_factory=set)  # lab tokens seen in its messages
    text: list = field(default_factory=list)  # its messages, tags stripped, for the isolation check
    step_s: list = field(default_factory=list)
    step_bytes: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    async def connect(self) -> None:
        import websockets

        # as a browser: the health check first (a class server's proxy answers with the cookie that keeps
        # this browser on one worker), then the websocket with the cookies it was given
        cookies = await asyncio.to_thread(_cookies_of, self.url + "/_stcore/health")
        self.ws = await websockets.connect(self.url.replace("http", "ws", 1) + "/_stcore/stream",
                                           subprotocols=["streamlit"], origin=self.url, max_size=None,
                                           open_timeout=120, ping_interval=None,
                                           additional_headers={"Cookie": cookies} if cookies else None)

    async def close(self) -> None:
        await self.ws.close()

    async def rerun(self, widgets=(), fragment_id: str = "") -> tuple[float, int]:
        """One script run with these widget states; (seconds to ``script_finished``, bytes received). A widget
        drawn inside a fragment re-runs that fragment only: the browser then sends its ``fragment_id``."""
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        msg = BackMsg()
        msg.rerun_script.query_string = ""
        msg.rerun_script.page_script_hash = self.page_hash
        msg.rerun_script.widget_states.widgets.extend(widgets)
        msg.rerun_script.fragment_id = fragment_id
        t0 = time.perf_counter()
        await self.ws.send(msg.SerializeToString())
        received = 0
        while True:
            raw = await self.ws.recv()
            received += len(raw)
            fwd = ForwardMsg()
            fwd.ParseFromString(raw)
            kind = fwd.WhichOneof("type")
            if kind == "new_session":
                self.page_hash = self.page_hash or fwd.new_session.page_script_hash
            elif kind == "delta":
                self._read_delta(fwd.delta, raw)
            elif kind == "script_finished":
                return time.perf_counter() - t0, received

    def _read_delta(self, delta, raw: bytes) -> None:
        self.tokens.update(t.decode() for t in TOKEN_RE.findall(raw))
        self.text.append(TAG_RE.sub(b"", raw))
        if delta.WhichOneof("type") != "new_element":
            return
        element = delta.new_element
        kind = element.WhichOneof("type")
        inner = getattr(element, kind)
        if kind == "exception":
            self.errors.append(f"{inner.type}: {inner.message}")
        widget_id = getattr(inner, "id", "")
        if widget_id:
            self.fragments[widget_id] = delta.fragment_id
            self.ids[(kind, getattr(inner, "label", ""))] = widget_id
            self.ids[(kind, widget_id.rsplit("-", 1)[-1])] = widget_id  # by key, e.g. ("button", "stage_step")

    def widget(self, kind: str, name: str) -> str:
        try:
            return self.ids[(kind, name)]
        except KeyError:
            raise RuntimeError(f"student {self.index}: no {kind} {name!r} on the page "
                               f"(seen: {sorted(n for _, n in self.ids)})") from None

    async def open_page(self) -> None:
        await self.connect()
        await self.rerun()

    async def add_marked_request(self) -> None:
        """Submit the sidebar's "Add a request" form with this student's marker in the prompt."""
        from streamlit.proto.WidgetStates_pb2 import WidgetState

        prompt = WidgetState(id=self.widget("text_area", PROMPT_LABEL), string_value=f"ROMEO. {self.marker} ")
        submit = WidgetState(id=self.widget("button", ADD_LABEL), trigger_value=True)
        await self.rerun([prompt, submit])

    async def step(self, record: bool = True) -> None:
        from streamlit.proto.WidgetStates_pb2 import WidgetState

        step = self.widget("button", STEP_KEY)
        seconds, received = await self.rerun([WidgetState(id=step, trigger_value=True)], self.fragments.get(step, ""))
        if record:
            self.step_s.append(seconds)
            self.step_bytes.append(received)


# ------------------------------------------------------------------------------------------------- class
@dataclass
class ClassResult:
    students: int
    options: tuple[str, ...]
    rounds: int
    step_s: list[float]
    wall_s: float
    rss_mib: float
    peak_mib: float
    idle_rss_mib: float
    bytes_per_step: float
    own_seen: int  # students that saw their own marker and exactly one token, their own
    leaks: list[str]  # "student i saw student j's marker / token"
    errors: list[str]
    workers: int = 1  # Streamlit processes serving the class (more than 1: behind nginx)
    cpu_s: float = 0.0  # the server's CPU time over the rounds (user + system, all its processes)

    @property
    def cpu_ms_per_step(self) -> float:
        return 1000 * self.cpu_s / len(self.step_s)

    @property
    def median(self) -> float:
        return statistics.median(self.step_s)

    @property
    def p95(self) -> float:
        return percentile(self.step_s, 0.95)

    @property
    def clicks_per_s(self) -> float:
        return len(self.step_s) / self.wall_s


async def _gather_limited(coros, limit: int):
    gate = asyncio.Semaphore(limit)

    async def one(c):
        async with gate:
            return await c
    return await asyncio.gather(*(one(c) for c in coros))


async def run_class(url: str, pid: int, n: int, rounds: int) -> ClassResult:
    """``n`` students on the server at ``url`` (process ``pid``): open, add a marked request, warm up, then
    ``rounds`` rounds of everyone clicking Step at once."""
    students = [Student(i, url) for i in range(n)]
    idle_rss = tree_rss_mib(pid)[0]
    await _gather_limited([s.open_page() for s in students], 4)  # opening is not what is measured
    await _gather_limited([s.add_marked_request() for s in students], 4)
    await _gather_limited([s.step(record=False) for s in students], 4)
    t0, cpu0 = time.perf_counter(), tree_cpu_s(pid)
    for _ in range(rounds):
        await asyncio.gather(*(s.step() for s in students))
    wall, cpu = time.perf_counter() - t0, tree_cpu_s(pid) - cpu0
    rss, peak = tree_rss_mib(pid)
    for s in students:
        await s.close()
    leaks, own = isolation(students)
    return ClassResult(n, (), rounds, [t for s in students for t in s.step_s], wall, rss, peak, idle_rss,
                       statistics.mean(b for s in students for b in s.step_bytes), own, leaks,
                       [f"student {s.index}: {e}" for s in students for e in s.errors], cpu_s=cpu)


def isolation(students: list[Student]) -> tuple[list[str], int]:
    """Leaks (a student's messages carrying another's marker or lab token) and how many students saw their
    own marker and only their own token (without which the check would prove nothing)."""
    markers = {s.marker.encode(): s.index for s in students}
    tokens = {}
    for s in students:
        for t in s.tokens:
            tokens.setdefault(t, set()).add(s.index)
    leaks, own = [], 0
    for s in students:
        text = b"".join(s.text)
        seen = {i for m, i in markers.items() if m in text}
        leaks += [f"student {s.index} saw student {i}'s marker" for i in sorted(seen - {s.index})]
        leaks += [f"student {s.index} saw a lab token also seen by student(s) {sorted(tokens[t] - {s.index})}"
                  for t in s.tokens if tokens[t] != {s.index}]
        own += s.index in seen and len(s.tokens) == 1
    return leaks, own


def measure(n: int, rounds: int, profile: str | None = None, options: tuple[str, ...] = (),
            workers: int = 1) -> ClassResult:
    port = free_port()
    proc = start_server(port, profile, options, workers)
    try:
        result = asyncio.run(run_class(f"http://127.0.0.1:{port}", proc.pid, n, rounds))
        result.options = tuple(options)
        result.workers = workers
        return result
    finally:
        stop_server(proc)


# ------------------------------------------------------------------------------------------------ report
def goal_text(r: ClassResult) -> str:
    goal = GOALS.get(r.students)
    if goal is None or r.options:
        return "-"
    med, p95 = goal
    parts, met = [], []
    if med is not None:
        parts.append(f"median <= {med:g} s")
        met.append(r.median <= med)
    parts.append(f"p95 <= {p95:g} s")
    met.append(r.p95 <= p95)
    return f"{', '.join(parts)}: {'met' if all(met) else 'not met'}"


def table(results: list[ClassResult]) -> str:
    rows = ["| students | server | Step clicks | median Step | p95 Step | clicks served / s | server CPU / Step | "
            "server RSS after (peak) | KiB sent / Step | isolation | goal (issue 16) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        iso = ("ok: no leak; " if not r.leaks else f"{len(r.leaks)} LEAKS; ") + \
            f"{r.own_seen}/{r.students} saw their own marker and token"
        who = f"{r.students}" + "".join(f" with `{o}`" for o in r.options)
        server = "1 process" if r.workers == 1 else f"{r.workers} processes + nginx"
        rows.append(f"| {who} | {server} | {len(r.step_s)} | {r.median:.2f} s | {r.p95:.2f} s | {r.clicks_per_s:.2f} | "
                    f"{r.cpu_ms_per_step:.0f} ms | {r.rss_mib:,.0f} MiB ({r.peak_mib:,.0f}) | {r.bytes_per_step / 1024:,.0f} | {iso} | "
                    f"{goal_text(r)} |")
    return "\n".join(rows)


def breakdown(profile: str, students: int) -> str:
    """Where a Step's CPU goes, from a profile of ``--profile`` (``bench/class_profile.summary``)."""
    from bench.class_profile import summary

    rows = summary(profile)
    return "\n".join([
        "",
        f"Where a Step's time goes: `bench/class_load.py --students {students} --profile P` then "
        f"`bench/class_profile.py --summary P`: cProfile of every script run on the server, timed by the "
        f"script thread's CPU time (waits for the GIL or a core excluded), mean per script run (Step clicks "
        f"and the few page opens). cProfile slows Python-heavy code down (about 2x), so read the shares.",
        "",
        "| phase (nested phases indented) | CPU ms per script run | calls |",
        "|---|---:|---:|",
        *[f"| {label.replace('  ', '&nbsp;&nbsp;')} | {ms:,.0f} | {calls} |" for label, ms, calls in rows],
    ])


def section(results: list[ClassResult], rounds: int, load: str, extra: str = "") -> str:
    idle = results[0].idle_rss_mib if results else 0
    return "\n".join([
        "## A class at once: students stepping the Playground together (issue 16)",
        "",
        f"Command: `nice -n 10 python bench/class_load.py`. A fresh class server (`PAL_CLASS_SERVER=1`) per "
        f"row on this shared 2-core CPU ({load}): one `streamlit run app.py` process, or `scripts/class_server.py "
        f"--workers 2` (two Streamlit processes behind nginx, each browser kept on one by a cookie). Every "
        f"student is a real session over the websocket, speaking the browser's protocol (`bench/class_load.py`: "
        f"the health check first, for the proxy's cookie; a Step is a rerun of the stage fragment, as a browser "
        f"sends it). Each student opens the Playground (its own lab, the default \"batch\" preset), adds a "
        f"request with a marker of its own and steps once; then {rounds} rounds in which every student clicks "
        f"Step at the same moment. Step time: from the click's message to the page's `script_finished`. Clicks "
        f"served per second: all clicks over the rounds' wall time. Server memory from /proc, summed over the "
        f"server's processes (workers and nginx; the peak column sums each process's own peak); before any page "
        f"view: {idle:,.0f} MiB.",
        "",
        table(results),
        "",
        "Isolation: every message each student received was searched for every other student's marker (its "
        "custom request's prompt, tags stripped) and lab token (the stage counter's); a row says `ok` only "
        "when none was found and each student found its own.",
        "",
        *speedup_lines(results),
        *(["", "A row \"with `runner.postScriptGC=false`\": the same class on a server started with that Streamlit "
            "option. By default Streamlit runs a full `gc.collect()` after every script run; with every student's "
            "lab and recorded steps alive in one process, that collection walks them all, so each Step pays for "
            "the whole class (the app already freezes its modules and collects the youngest generation itself: "
            "`engine.threads.configure_gc`)."] if any("runner.postScriptGC=false" in r.options for r in results)
          else []),
        extra,
    ])


def speedup_lines(results: list[ClassResult]) -> list[str]:
    """What the table says about a second worker (the clicks served, per class size measured both ways) and
    where the Step's cost came from, as lines of the section."""
    by = {(r.students, r.workers): r for r in results if not r.options}
    ratios = [f"{n} students {by[n, w].clicks_per_s / by[n, 1].clicks_per_s:.2f}x"
              for (n, w) in sorted(by) if w > 1 and (n, 1) in by]
    return ["", "Server CPU / Step: the server's processes' user + system CPU time over the rounds (/proc), over "
            "the Step clicks. Before issue 16's last changes (commit 03786b3), one process served 5.90 clicks/s at "
            "30 students (median 4.95 s, p95 5.45 s; this table's run of 2026-12-01) at ~230 ms of CPU per Step (measured the same way). "
            "What changed: the figures are plain dicts (`viz.plain`: Plotly's object model, validation and deep "
            "copies had cost ~78 ms a Step), the stage (press counter, controls, views) is one Streamlit fragment, "
            "so a Step re-runs neither the sidebar's forms nor the page around it, the Export and block-table-rows "
            "expanders draw only when open, and the stage runs a few at a time in arrival order "
            "(`ui/stage_gate.py`): served together, 30 Steps all finished about as late as the last (median 1.47 s, "
            "p95 1.74 s before that change); served in order, the median is about half the round."
            + (f" A second worker process (`--workers 2`) served {', '.join(ratios)} the clicks of one."
               if ratios else "")]


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} (1 / 5 min) at the end"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, nargs="+", default=[10, 30, 60])
    parser.add_argument("--rounds", type=int, default=4, help="Step clicks per student (measured)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="Streamlit processes serving the class: each class size is measured with each "
                             "(more than 1: scripts/class_server.py, nginx in front)")
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"), help="Markdown file to write")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--profile", help="profile the server's script runs (cProfile) into this file")
    parser.add_argument("--breakdown", metavar="PROFILE",
                        help="add the phase table of a profile written by an earlier --profile run")
    parser.add_argument("--breakdown-students", type=int, default=10, help="the class size of that profile")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                        help="also measure the first class size with this Streamlit option (a row of its own; "
                             "repeatable), e.g. runner.postScriptGC=false")
    parser.add_argument("--option", action="append", default=[],
                        help="a Streamlit config option for the server, name=value (repeatable); not written to the doc")
    args = parser.parse_args(argv)
    results = []
    runs = [(n, tuple(args.option), w) for w in args.workers for n in args.students]
    runs[1:1] = [(args.students[0], (*args.option, v), args.workers[0]) for v in args.variant]  # after the first
    for n, options, workers in runs:
        r = measure(n, args.rounds, args.profile, options, workers)
        results.append(r)
        print(f"{n} students, {workers} worker{'s' * (workers != 1)}: median {r.median:.2f} s, p95 {r.p95:.2f} s, {r.clicks_per_s:.2f} clicks/s, "
              f"RSS {r.rss_mib:.0f} MiB (peak {r.peak_mib:.0f}), leaks {len(r.leaks)}, own {r.own_seen}/{n}, "
              f"errors {len(r.errors)}", flush=True)
        for line in r.leaks[:5] + r.errors[:5]:
            print("   ", line, flush=True)
    extra = breakdown(args.breakdown, args.breakdown_students) if args.breakdown else ""
    text = section(results, args.rounds, machine_load(), extra)
    print(text)
    if not args.no_write and not args.profile and not args.option:
        write_section(args.doc, "class-load", text)
    return 0 if all(not r.leaks and not r.errors and r.own_seen == r.students for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
