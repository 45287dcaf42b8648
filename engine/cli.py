"""Headless main job: ``python -m engine run --scenario NAME [...]``.

Prints each request's prompt and generated text and a per-step table of blocks used/free, or with
``--json`` one JSON object (keys listed in ``summarize``). ``--trace FILE`` writes every StepRecord as
JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import EMBEDDED_MODEL, EngineConfig
from .records import StepRecord, write_trace
from .scenarios import SCENARIOS, get_scenario

MIB = 1024 * 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description="Paged Attention Lab engine")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario to completion on the paged engine")
    run.add_argument("--scenario", default="single", choices=sorted(SCENARIOS), help="what to run")
    run.add_argument("--model", default=EMBEDDED_MODEL, help="local directory or hub id (default: embedded)")
    run.add_argument("--block-size", type=int, help="tokens per block (scenario default or 16)")
    pool = run.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, help="physical blocks in the pool")
    pool.add_argument("--kv-budget-mb", type=float, help="KV cache budget in MiB (instead of --num-blocks)")
    run.add_argument("--max-model-len", type=int, help="longest sequence, tokens")
    run.add_argument("--device", default="auto", help="auto | cpu | cuda")
    run.add_argument("--seed", type=int, default=0, help="seed of the scenario's sampling streams")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    run.add_argument("--trace", help="write every StepRecord to this JSON-lines file")
    sub.add_parser("scenarios", help="list the scenarios")
    return p


def engine_config(args, scenario) -> EngineConfig:
    """Scenario defaults, overridden by the flags the user gave."""
    fields = dict(scenario.engine_defaults)
    if args.block_size is not None:
        fields["block_size"] = args.block_size
    if args.num_blocks is not None:
        fields["num_blocks"] = args.num_blocks
        fields.pop("kv_budget_bytes", None)
    if args.kv_budget_mb is not None:
        if args.kv_budget_mb <= 0:
            raise ValueError(f"--kv-budget-mb must be > 0, got {args.kv_budget_mb}")
        fields["kv_budget_bytes"] = int(args.kv_budget_mb * MIB)
        fields.pop("num_blocks", None)
    if args.max_model_len is not None:
        fields["max_model_len"] = args.max_model_len
    return EngineConfig(model=args.model, device=args.device, **fields)


def summarize(engine, records: list[StepRecord], outputs) -> dict:
    """The ``--json`` object.

    ``paged`` describes the step of peak block use: ``slots_allocated`` = blocks in use x block size,
    ``slots_used`` = tokens whose K/V those blocks hold, ``waste_pct`` = unused share of allocated slots.
    """
    peak = max(records, key=lambda r: r.snapshot.num_used_blocks) if records else None
    allocated = peak.snapshot.slots_allocated if peak else 0
    used = peak.snapshot.slots_used if peak else 0
    busy = sum(r.elapsed_s for r in records)
    generated = sum(len(o.output_token_ids) for o in outputs)
    counts: dict[str, int] = {}
    for r in records:
        for e in r.events:
            counts[e.kind] = counts.get(e.kind, 0) + 1
    return {
        "model": engine.config.model,
        "device": str(engine.device),
        "dtype": engine.dtype,
        "attention_backend": engine.backend,
        "block_size": engine.block_size,
        "num_blocks": engine.num_blocks,
        "max_model_len": engine.max_model_len,
        "kv_bytes_per_token": engine.geometry.bytes_per_token,
        "kv_cache_bytes": engine.kv_cache.nbytes,
        "steps": len(records),
        "requests": [
            {
                "id": o.request_id,
                "prompt": o.prompt,
                "prompt_token_ids": o.prompt_token_ids,
                "output_text": o.output_text,
                "output_token_ids": o.output_token_ids,
                "finish_reason": o.finish_reason,
                "num_preemptions": o.num_preemptions,
                "block_table": o.block_table,
                "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                             "finish_reason": c.finish_reason, "score": round(c.score, 4)} for c in o.outputs],
            }
            for o in outputs
        ],
        "paged": {
            "peak_blocks_used": peak.snapshot.num_used_blocks if peak else 0,
            "slots_allocated": allocated,
            "slots_used": used,
            "waste_pct": round(100.0 * (allocated - used) / allocated, 2) if allocated else 0.0,
        },
        "events": {
            "allocations": counts.get("allocate", 0),
            "new_blocks": counts.get("new_block", 0),
            "cow_copies": counts.get("cow", 0),
            "forks": counts.get("fork", 0),
            "prefix_cache_hit_tokens": sum(e.data.get("num_tokens", 0) for r in records for e in r.events
                                           if e.kind == "prefix_hit"),
            "evictions": counts.get("evict", 0),
            "preemptions": counts.get("preempt", 0),
            "swaps_out": counts.get("swap_out", 0),
            "swaps_in": counts.get("swap_in", 0),
        },
        "generated_tokens": generated,
        "tokens_per_s": round(generated / busy, 2) if busy else 0.0,
    }


def print_text(summary: dict, records: list[StepRecord], out) -> None:
    w = out.write
    w(f"model {summary['model']}  device {summary['device']} ({summary['dtype']}, {summary['attention_backend']} attention)\n")
    w(f"pool {summary['num_blocks']} blocks x {summary['block_size']} tokens, "
      f"{summary['kv_bytes_per_token']:,} bytes of KV per token, {summary['kv_cache_bytes'] / MIB:.2f} MiB\n\n")
    for r in summary["requests"]:
        prompt = r["prompt"] if r["prompt"] is not None else r["prompt_token_ids"]
        w(f"[{r['id']}] {prompt!r}\n   -> {r['output_text']!r}\n")
        for c in r["outputs"][1:]:
            w(f"   -> [{c['index']}] {c['text']!r}\n")
        w(f"   {len(r['output_token_ids'])} tokens, finish: {r['finish_reason']}, "
          f"preempted {r['num_preemptions']}x, last block table {r['block_table']}\n")
    w(f"\n{'step':>5} {'kind':<8} {'seqs':>4} {'tokens':>6} {'used':>5} {'free':>5}  notes\n")
    for rec in records:
        snap = rec.snapshot
        notes = "; ".join(e.message for e in rec.events
                          if e.kind in ("preempt", "finish", "cow", "fork", "prefix_hit", "swap_out", "swap_in", "evict"))
        w(f"{rec.step:>5} {rec.kind:<8} {len(rec.scheduled):>4} {rec.num_tokens:>6} "
          f"{snap.num_used_blocks:>5} {snap.num_free_blocks:>5}  {notes}\n")
    p = summary["paged"]
    w(f"\n{summary['steps']} steps, {summary['generated_tokens']} tokens generated, {summary['tokens_per_s']} tokens/s; "
      f"peak {p['peak_blocks_used']} blocks = {p['slots_allocated']} slots for {p['slots_used']} tokens "
      f"({p['waste_pct']}% waste)\n")
    w("events: " + ", ".join(f"{k} {v}" for k, v in summary["events"].items()) + "\n")


def run(args) -> int:
    from .llm_engine import LLMEngine  # heavy (torch, transformers): only for the run command

    scenario = get_scenario(args.scenario)
    engine = LLMEngine(engine_config(args, scenario))
    requests = scenario.build(args.seed)
    records: list[StepRecord] = []
    outputs = engine.generate([p for p, _ in requests], [sp for _, sp in requests], on_step=records.append)
    if args.trace:
        write_trace(records, args.trace)
    summary = summarize(engine, records, outputs)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_text(summary, records, sys.stdout)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "scenarios":
        for s in SCENARIOS.values():
            print(f"{s.name:<12} {s.description}")
        return 0
    try:
        return run(args)
    except ValueError as exc:  # bad flags, bad model: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
