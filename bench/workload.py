"""CPU benchmark: the paged engine vs the contiguous baseline (and transformers) on one workload.

    .venv/bin/pip install -e ".[bench]"     # matplotlib, for the plot
    .venv/bin/python bench/workload.py [--scenario chat-workload] [--seed 0] [--reps 3] [--quick]

Same workload, same KV byte budget, same model, one process; paged and contiguous runs alternate and each
figure is the median of ``--reps`` runs. Also measured on the same requests: transformers' ``generate``
one request at a time, and transformers' own continuous batching (``generate_batch``), and a block-size
sweep of the paged engine. Writes the "cpu-workload" section of docs/benchmarks.md and
docs/benchmarks_workload.png.

tokens/s = generated tokens / wall time of the whole workload (scheduling, sampling and records
included); concurrency = running requests per step; KV utilisation = slots holding real K/V over slots
allocated (paged: blocks in use x B; contiguous: reserved slots), averaged over steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from bench.report import write_section  # noqa: E402
from engine import LLMEngine, metrics  # noqa: E402
from engine.scenarios.presets import get_scenario  # noqa: E402
from engine.scenarios.run_spec import RunSpec  # noqa: E402
from engine.scenarios.workloads import run_workload  # noqa: E402


def run_engine(scenario, seed: int, allocator: str, **overrides) -> dict:
    engine = LLMEngine(RunSpec.from_preset(scenario.name, device="cpu", **overrides).engine_config(allocator))
    tokenize = lambda t: engine.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    workload = scenario.make(seed, tokenize)
    records = []
    t0 = time.perf_counter()
    outputs = run_workload(engine, workload, on_step=records.append)
    wall = time.perf_counter() - t0
    generated = sum(len(o.output_token_ids) for o in outputs)
    B = engine.block_size
    paged = metrics.paged_accounting(outputs, B, metrics.first_admission_hits(records))
    return {
        "allocator": allocator,
        "block_size": B,
        "wall_s": wall,
        "tokens": generated,
        "tokens_per_s": generated / wall,
        "steps": len(records),
        "peak_concurrency": max(len(r.snapshot.running) for r in records),
        "mean_concurrency": statistics.fmean(len(r.snapshot.running) for r in records),
        "kv_utilization_pct": metrics.kv_utilization_pct(r.snapshot for r in records),
        "waste_pct": paged["waste_pct"],
        "table_entries": paged["blocks_allocated"],
        "concurrency_trace": [len(r.snapshot.running) for r in records],
        "workload": workload,
    }


def median_runs(runs: list[dict]) -> dict:
    keys = ("wall_s", "tokens_per_s", "mean_concurrency", "kv_utilization_pct")
    out = dict(runs[0])
    for k in keys:
        out[k] = statistics.median(r[k] for r in runs)
    out["all_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in runs]
    return out


def hf_one_at_a_time(model, workload) -> dict:
    """transformers ``generate``, one request after another, same lengths and sampling settings."""
    t0 = time.perf_counter()
    tokens = 0
    for r in workload.requests:
        ids = torch.tensor([r.prompt])
        p = r.params
        torch.manual_seed(p.seed)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=p.temperature,
                             top_p=p.top_p, max_new_tokens=p.max_tokens, min_new_tokens=p.max_tokens)
        tokens += out.shape[1] - ids.shape[1]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def hf_generate_batch(model, workload) -> dict:
    """transformers' continuous batching (``generate_batch``). It takes one GenerationConfig for all
    requests, so every request generates the workload's longest output length (ignore EOS)."""
    from transformers import GenerationConfig

    longest = max(r.params.max_tokens for r in workload.requests)
    cfg = GenerationConfig(max_new_tokens=longest, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=[list(r.prompt) for r in workload.requests], generation_config=cfg)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "max_new_tokens": longest}


def plot(path: Path, paged: dict, contiguous: dict, refs: dict, sweep: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    short = {"transformers generate, one at a time": "HF generate\n(one at a time)",
             "transformers generate_batch (continuous batching)": "HF generate_batch"}
    names = ["paged", "contiguous"] + [short.get(n, n) for n in refs]
    vals = [paged["tokens_per_s"], contiguous["tokens_per_s"]] + [r.get("tokens_per_s", 0) for r in refs.values()]
    a.bar(names, vals, color=["#0072B2", "#D55E00", "#999999", "#CCCCCC"][: len(names)])
    a.set_ylabel("tokens / s (CPU)")
    a.set_title("throughput, same workload and KV budget")
    a.tick_params(axis="x", labelsize=8)
    b.plot(paged["concurrency_trace"], label="paged", color="#0072B2")
    b.plot(contiguous["concurrency_trace"], label="contiguous", color="#D55E00")
    b.set_xlabel("engine step")
    b.set_ylabel("running requests")
    b.set_title("concurrency over time")
    b.legend()
    c.plot([s["block_size"] for s in sweep], [s["waste_pct"] for s in sweep], "o-", color="#0072B2")
    c.set_xscale("log", base=2)
    c.set_xlabel("block size (tokens)")
    c.set_ylabel("waste at final lengths (%)")
    c.set_title("paged: block size vs waste")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(args, paged, contiguous, refs, sweep, env) -> str:
    ratio = lambda x, y: x / y if y else float("nan")  # noqa: E731
    lines = [
        f"## CPU: paged engine vs contiguous baseline ({args.scenario}, seed {args.seed})",
        "",
        f"Machine: {env['cpu']}, {env['threads']} torch threads; Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}. Command: `{env['command']}`. Model: the embedded tiny model, "
        f"float32. Workload: {len(paged['workload'].requests)} requests, "
        f"{sum(r.params.max_tokens for r in paged['workload'].requests):,} output tokens in all; "
        f"KV budget {paged['budget']}. Paged and contiguous runs alternate; medians of {args.reps}.",
        "",
        "| | paged | contiguous | paged / contiguous |",
        "|---|---:|---:|---:|",
        f"| tokens/s | {paged['tokens_per_s']:.0f} | {contiguous['tokens_per_s']:.0f} | "
        f"{ratio(paged['tokens_per_s'], contiguous['tokens_per_s']):.2f}x |",
        f"| time to finish the workload (s) | {paged['wall_s']:.2f} | {contiguous['wall_s']:.2f} | "
        f"{ratio(paged['wall_s'], contiguous['wall_s']):.2f}x |",
        f"| engine steps | {paged['steps']} | {contiguous['steps']} | |",
        f"| peak concurrency | {paged['peak_concurrency']} | {contiguous['peak_concurrency']} | "
        f"{ratio(paged['peak_concurrency'], contiguous['peak_concurrency']):.1f}x |",
        f"| mean concurrency | {paged['mean_concurrency']:.1f} | {contiguous['mean_concurrency']:.1f} | |",
        f"| KV utilisation (mean over steps) | {paged['kv_utilization_pct']:.1f}% | "
        f"{contiguous['kv_utilization_pct']:.1f}% | |",
        f"| tokens/s of each run | {paged['all_tokens_per_s']} | {contiguous['all_tokens_per_s']} | |",
        "",
        "External references on the same requests:",
        "",
        "| system | tokens | seconds | tokens/s | paged engine / it |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in refs.items():
        if "error" in r:
            lines.append(f"| {name} | | | failed: {r['error']} | |")
        else:
            lines.append(f"| {name} | {r['tokens']:,} | {r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | "
                         f"{ratio(paged['tokens_per_s'], r['tokens_per_s']):.2f}x |")
    lines += ["", "Block-size sweep (paged engine, same workload, one run each):", "",
              "| block size | waste at final lengths | block-table entries | tokens/s | peak concurrency |",
              "|---:|---:|---:|---:|---:|"]
    lines += [f"| {s['block_size']} | {s['waste_pct']:.1f}% | {s['table_entries']:,} | {s['tokens_per_s']:.0f} | "
              f"{s['peak_concurrency']} |" for s in sweep]
    lines += ["", "![paged vs contiguous](benchmarks_workload.png)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="chat-workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one rep, no transformers references, short sweep")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    p.add_argument("--json", type=Path, help="raw results as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 1
    scenario = get_scenario(args.scenario)
    runs = {"paged": [], "contiguous": []}
    for _ in range(args.reps):
        for alloc in ("paged", "contiguous"):  # alternate, so drift hits both alike
            runs[alloc].append(run_engine(scenario, args.seed, alloc))
            print(alloc, round(runs[alloc][-1]["tokens_per_s"], 1), "tokens/s", flush=True)
    paged, contiguous = median_runs(runs["paged"]), median_runs(runs["contiguous"])
    d = scenario.engine_defaults
    paged["budget"] = (f"{d['num_blocks']} blocks x {d['block_size']} tokens = {d['num_blocks'] * d['block_size']:,} "
                       f"token slots; contiguous reservation {d.get('reservation_tokens', d.get('max_model_len'))}")
    refs = {}
    if not args.quick:
        from transformers import AutoModelForCausalLM

        from engine import EMBEDDED_MODEL
        model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
        refs["transformers generate, one at a time"] = hf_one_at_a_time(model, paged["workload"])
        print("generate", refs["transformers generate, one at a time"], flush=True)
        try:
            refs["transformers generate_batch (continuous batching)"] = hf_generate_batch(model, paged["workload"])
        except Exception as exc:  # report what failed instead of dropping the whole benchmark
            refs["transformers generate_batch (continuous batching)"] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        print("generate_batch", refs["transformers generate_batch (continuous batching)"], flush=True)
    sizes = (4, 16, 64) if args.quick else (1, 4, 8, 16, 32, 64, 128)
    sweep = []
    for bs in sizes:
        blocks = d["num_blocks"] * d["block_size"] // bs  # same slots, same bytes
        sweep.append(run_engine(scenario, args.seed, "paged", block_size=bs, num_blocks=blocks))
        print("block size", bs, round(sweep[-1]["tokens_per_s"], 1), flush=True)
    import transformers

    env = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "command": "python bench/workload.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write_section(args.out, "cpu-workload", markdown(args, paged, contiguous, refs, sweep, env))
    try:
        plot(args.out.parent / "benchmarks_workload.png", paged, contiguous, refs, sweep)
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
    if args.json:
        strip = lambda r: {k: v for k, v in r.items() if k not in ("workload", "concurrency_trace")}  # noqa: E731
        args.json.write_text(json.dumps({"paged": strip(paged), "contiguous": strip(contiguous), "refs": refs,
                                         "sweep": [strip(s) for s in sweep], "env": env}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
