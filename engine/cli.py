"""Headless main job: ``python -m engine run --scenario NAME [...]``.

Prints each request's prompt and generated text and a per-step table of blocks used/free, or with
``--json`` one JSON object (keys listed in ``summarize``). ``--trace FILE`` writes every StepRecord as
JSON lines (with ``--allocator both``, the contiguous run goes to ``FILE`` with ``.contiguous`` before
its suffix).

Scenarios that compare (``lesson-lengths``, ``chat-workload``) run the paged engine and the contiguous
baseline on the same requests in the same KV byte budget unless ``--allocator`` picks one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from . import metrics
from .watch import command as watch
from .config import (CONTIGUOUS_POLICIES, EMBEDDED_MODEL, FINAL_LENGTH_POLICIES, SCHEDULING_POLICIES, SEMANTICS,
                     EngineConfig)
from .records import StepRecord, write_trace
from .scenarios.presets import SCENARIOS, get_scenario
from .scenarios.run_spec import Run, RunSpec, run_paged_then_contiguous
from .scenarios.workloads import run_workload

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
    run.add_argument("--preemption-mode", choices=("recompute", "swap"),
                     help="what happens to a preempted request (default: the scenario's, or recompute)")
    run.add_argument("--device", default="auto", help="auto | cpu | cuda")
    run.add_argument("--seed", type=int, default=0, help="seed of the scenario's sampling streams")
    run.add_argument("--allocator", choices=("paged", "contiguous", "both"),
                     help="KV allocator (default: both for scenarios that compare, else paged)")
    run.add_argument("--reservation", type=int, help="contiguous baseline: slots reserved per request under "
                                                     "the max policy (default: the scenario's, or max model length)")
    run.add_argument("--contiguous-policy", choices=CONTIGUOUS_POLICIES,
                     help="contiguous baseline: how much a request reserves (default: the scenario's, or max): "
                          "max, max_tokens (prompt + max_tokens), pow2 or oracle (its true final length, "
                          "learned from the paged run)")
    run.add_argument("--semantics", choices=SEMANTICS,
                     help="the paged engine's scheduler (default: the scenario's, paper for all but hybrid-window): paper (vLLM V0 as the PagedAttention paper describes it: "
                          "prefill or decode steps, fork and copy-on-write, swap) or v1 (vLLM V1: one token budget "
                          "per step with chunked prefill, n as child requests over the prefix cache, recompute "
                          "only). The contiguous baseline always runs the paper's scheduler")
    run.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES,
                     help="v1: fcfs (default) or priority: the lowest priority value runs first, then arrival. "
                          "The scenarios give every request priority 0, so under priority they run as under "
                          "fcfs; priorities come from the Python API (add_request(..., priority=k))")
    run.add_argument("--max-num-seqs", type=int,
                     help="most sequences running at once (default 256; v1 refuses a token budget below it, "
                          "as vLLM does)")
    run.add_argument("--max-num-batched-tokens", type=int,
                     help="tokens one step may compute (v1: the budget shared by decode and prefill chunks, "
                          "default 2048; paper: a prefill step's budget)")
    run.add_argument("--watermark", type=float,
                     help="share of the paged pool that admission keeps free (default: the scenario's, or "
                          "0.01 in paper semantics and 0 in v1, as vLLM V0 / V1)")
    run.add_argument("--passes", type=int, default=1,
                     help="run the scenario's requests this many times in a row on the same engine (later "
                          "passes can hit the prefix cache the earlier ones filled)")
    run.add_argument("--reset-prefix-cache", action="store_true",
                     help="with --passes: reset the prefix cache between passes (vLLM's reset_prefix_cache)")
    run.add_argument("--kv-events-endpoint",
                     help="publish the paged engine's KV cache events in vLLM's schema on this ZMQ endpoint "
                          "(bound), e.g. tcp://127.0.0.1:5557, for `python -m engine watch` or any vLLM consumer")
    run.add_argument("--kv-events-replay-endpoint", help="with --kv-events-endpoint: the replay (ROUTER) endpoint")
    run.add_argument("--step-delay", type=float, default=0.0,
                     help="seconds to wait after each step, so a watcher can follow (default 0)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    run.add_argument("--trace", help="write every StepRecord to this JSON-lines file")
    sub.add_parser("scenarios", help="list the scenarios")
    watch.add_parsers(sub)
    return p


def run_spec(args, scenario) -> RunSpec:
    """The run's spec: the scenario's settings (``RunSpec.from_preset``), overridden by the flags the user
    gave. ``--max-num-batched-tokens`` is V1's token budget under ``--semantics v1``, else the paper's
    prefill budget (``RunSpec.prefill_budget``); ``--max-num-seqs`` defaults to the engine's 256 for both
    engines (V1 refuses a smaller token budget, as vLLM does). Raises ValueError naming a bad flag."""
    fields = {flag: getattr(args, flag) for flag in ("block_size", "num_blocks", "max_model_len", "reservation",
                                                     "preemption_mode", "contiguous_policy", "watermark",
                                                     "scheduling_policy")
              if getattr(args, flag, None) is not None}
    if args.kv_budget_mb is not None:
        if not math.isfinite(args.kv_budget_mb) or args.kv_budget_mb <= 0:
            raise ValueError(f"--kv-budget-mb must be a finite number > 0, got {args.kv_budget_mb}")
        fields["kv_budget_mb"] = args.kv_budget_mb
    semantics = getattr(args, "semantics", None) or RunSpec.from_preset(scenario.name).semantics
    budget = getattr(args, "max_num_batched_tokens", None)
    spec = RunSpec.from_preset(scenario.name, model=args.model, device=args.device, seed=args.seed,
                               semantics=semantics, max_num_batched_tokens=budget if semantics == "v1" else None,
                               prefill_budget=None if semantics == "v1" else budget,
                               max_num_seqs=getattr(args, "max_num_seqs", None) or EngineConfig.max_num_seqs,
                               kv_events_endpoint=getattr(args, "kv_events_endpoint", None),
                               kv_events_replay_endpoint=getattr(args, "kv_events_replay_endpoint", None), **fields)
    if semantics == "v1" and spec.preemption_mode == "swap":
        raise ValueError(f"scenario {scenario.name!r} preempts by swap, which vLLM V1 does not have "
                         f"(recompute only): add --preemption-mode recompute to run it with --semantics v1")
    return spec


def engine_config(args, scenario, allocator: str = "paged") -> EngineConfig:
    """Scenario defaults, overridden by the flags the user gave: ``run_spec(args, scenario).engine_config``."""
    return run_spec(args, scenario).engine_config(allocator)


def paged_summary(engine, records: list[StepRecord], outputs) -> dict:
    """Paged accounting per completion at its final length L (``metrics.paged_accounting``), the pool's
    peak, the prefix cache (hit rate of first admissions; re-admissions apart), preemptions, run stats.

    ``blocks_allocated`` / ``slots_*`` / ``waste_pct`` count ONE block table per sequence: with KV cache
    groups (a hybrid model) that is the first full-attention group's. ``groups`` (None for a model of one
    full-attention group) accounts for every group's tables (``group_accounting``), ``all_groups`` sums them."""
    out = {
        "peak_blocks_used": engine.block_manager.peak_used_blocks,
        **metrics.paged_accounting(outputs, engine.block_size, metrics.first_admission_hits(records, engine.parents),
                                   {rid for rid, r in engine.requests.items() if r.is_beam_search}),
        "prefix_cache": metrics.prefix_cache_stats(engine.block_manager.stats),
        "preemption": metrics.preemption_counts(records),
        **metrics.run_stats(records, outputs),
        "groups": None, "all_groups": None,
    }
    if records and records[0].snapshot.kv_cache_groups:
        out["groups"] = group_accounting(records)
        blocks = sum(g["blocks_allocated"] for g in out["groups"])
        slots, used = blocks * engine.block_size, sum(g["slots_used"] for g in out["groups"])
        out["all_groups"] = {"blocks_allocated": blocks, "slots_allocated": slots, "slots_used": used,
                             "waste_pct": round(metrics.pct(slots - used, slots), 2)}
    return out


def group_accounting(records: list[StepRecord]) -> list[dict]:
    """Every KV cache group's tables at the sequences' final lengths, one dict per group in group order:
    ``{kind, sliding_window, layers, blocks_allocated, slots_allocated, slots_used, given_back}``.

    Read from each sequence's last group tables in the records (``SequenceState.group_block_tables``; a
    finished sequence keeps them) and its final length L (``token_ids``): a group's blocks are the entries
    that are not the null block (-1), from the sequence's first-admission prefix hit on (the hit's blocks
    are counted for the sequence that computed them, as ``metrics.paged_accounting`` does); a block's used
    slots are the tokens of ``[0, L)`` it covers (up to the block size). ``given_back``: the null entries
    past the hit, blocks a sliding window freed. The full-attention group's blocks equal
    ``paged_accounting``'s (one table per sequence)."""
    snap0 = records[0].snapshot
    B = snap0.block_size
    last: dict[str, object] = {}
    for r in records:
        for s in r.snapshot.sequences:
            if s.group_block_tables:
                last[s.seq_id] = s
    hits: dict[str, int] = {}
    for r in records:
        for e in r.events:
            if e.kind == "prefix_hit" and not e.data.get("readmission"):
                hits[e.request_id] = hits.get(e.request_id, 0) + e.data["num_tokens"]
    out = []
    for g, group in enumerate(snap0.kv_cache_groups):
        blocks = used = given_back = 0
        for sid, s in last.items():
            L, first = len(s.token_ids), hits.get(sid, 0) // B
            for i, b in enumerate(s.group_block_tables[g][first:], start=first):
                if b < 0:
                    given_back += 1
                else:
                    blocks += 1
                    used += max(0, min(B, L - i * B))
        out.append({**group, "blocks_allocated": blocks, "slots_allocated": blocks * B, "slots_used": used,
                    "given_back": given_back})
    return out


def contiguous_summary(engine, records: list[StepRecord], outputs) -> dict:
    """Contiguous accounting over the released reservations (``metrics.contiguous_accounting``: reserved,
    used = final lengths, internal fragmentation, waste), the largest external fragmentation seen at any
    step, and run stats (``queued_at_door``: requests that waited for a large enough gap)."""
    alloc = engine.block_manager
    return {
        "policy": alloc.policy,
        "reservation": alloc.reservation if alloc.policy == "max" else None,  # per request under "max" only
        "capacity_slots": alloc.capacity,
        **metrics.contiguous_accounting(alloc.finished),
        "external_frag_slots": max((r.snapshot.contiguous["external_frag_slots"] for r in records), default=0),
        "preemption": metrics.preemption_counts(records),
        **metrics.run_stats(records, outputs),
    }


def hybrid_summary(engine, records: list[StepRecord], outputs) -> dict | None:
    """A hybrid model's KV cache groups and what its sliding windows saved against the all-full-attention
    twin, step by step (``metrics.hybrid_saving`` of each record's snapshot: the Playground's line reads the
    same), None for a model of one full-attention group. ``group_block_tables``: each request's last tables
    (its first sequence's, as ``block_table``), the null block -1 where a window gave a block back;
    ``by_request``: the blocks each request held fewer at its last running step; ``peak``: the step where
    the windows saved the most; ``steps``: [step, blocks saved, blocks held, twin's blocks] per step."""
    if not records or not records[0].snapshot.kv_cache_groups:
        return None
    from .kv_cache import page_bytes

    per_block = page_bytes(engine.geometry, engine.block_size, engine.kv_cache_groups)
    tables: dict[str, list[list[int]]] = {}
    by_seq: dict[str, int] = {}
    steps, peak = [], None
    for rec in records:
        saving = metrics.hybrid_saving(rec.snapshot, per_block)
        steps.append([rec.step, saving["blocks"], saving["held"], saving["twin"]])
        if peak is None or saving["blocks"] > peak["blocks"]:
            peak = {"step": rec.step, **{k: saving[k] for k in ("blocks", "bytes", "held", "twin")}}
        by_seq.update(saving["by_sequence"])
        for s in rec.snapshot.sequences:
            if s.group_block_tables:
                tables.setdefault(s.request_id, [])
                if s.seq_id == s.request_id or s.seq_id.endswith(".0") or not tables[s.request_id]:
                    tables[s.request_id] = [list(t) for t in s.group_block_tables]
    return {"kv_cache_groups": records[0].snapshot.kv_cache_groups, "bytes_per_block": per_block,
            "group_block_tables": tables, "by_request": by_seq, "peak": peak, "steps": steps}


def summarize(runs: dict) -> dict:
    """The ``--json`` object, from ``{"paged" | "contiguous": (engine, records, outputs)}``.

    Top-level fields describe the paged run (the contiguous one if only it ran); ``paged`` and
    ``contiguous`` hold each allocator's accounting.
    """
    engine, records, outputs = runs.get("paged") or runs["contiguous"]
    counts: dict[str, int] = {}
    for r in records:
        for e in r.events:
            counts[e.kind] = counts.get(e.kind, 0) + 1
    stats = metrics.run_stats(records, outputs)
    out = {
        "model": engine.config.model,
        "device": str(engine.device),
        "dtype": engine.dtype,
        "attention_backend": engine.backend,
        "allocators": list(runs),
        "semantics": engine.semantics,
        "scheduler": {"semantics": engine.semantics, "max_num_batched_tokens": engine.max_num_batched_tokens,
                      "max_num_seqs": engine.config.max_num_seqs, "scheduling_policy": engine.config.scheduling_policy,
                      "watermark": engine.config.watermark},
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
                "prompt_text": o.prompt if o.prompt is not None else engine.tokenizer.decode(o.prompt_token_ids),
                "output_text": o.output_text,
                "output_token_ids": o.output_token_ids,
                "finish_reason": o.finish_reason,
                "num_preemptions": o.num_preemptions,
                "num_cached_tokens": o.num_cached_tokens,  # V1: prefix-cache hit of its first admission
                "block_table": o.block_table,
                "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                             "finish_reason": c.finish_reason, "score": round(c.score, 4)} for c in o.outputs],
            }
            for o in outputs
        ],
        "events": {
            "allocations": counts.get("allocate", 0),
            "new_blocks": counts.get("new_block", 0),
            "cow_copies": counts.get("cow", 0),
            "forks": counts.get("fork", 0),
            "prefix_cache_hit_tokens": sum(e.data.get("num_tokens", 0) for r in records for e in r.events
                                           if e.kind == "prefix_hit" and not e.data.get("readmission")),
            "readmission_hit_tokens": sum(e.data.get("num_tokens", 0) for r in records for e in r.events
                                          if e.kind == "prefix_hit" and e.data.get("readmission")),
            "evictions": counts.get("evict", 0),
            "preemptions": counts.get("preempt", 0),
            "swaps_out": counts.get("swap_out", 0),
            "swaps_in": counts.get("swap_in", 0),
        },
        "generated_tokens": stats["generated_tokens"],  # every sample and beam
        "tokens_per_s": stats["tokens_per_s"],
    }
    if "paged" in runs and (hybrid := hybrid_summary(*runs["paged"])) is not None:
        out["kv_cache_groups"] = hybrid.pop("kv_cache_groups")
        out["hybrid"] = hybrid
        for r in out["requests"]:
            r["group_block_tables"] = hybrid["group_block_tables"].get(r["id"], [])
    if "paged" in runs:
        out["paged"] = paged_summary(*runs["paged"])
    if "contiguous" in runs:
        out["contiguous"] = contiguous_summary(*runs["contiguous"])
    return out


def print_text(summary: dict, records: list[StepRecord], out) -> None:
    w = out.write
    w(f"model {summary['model']}  device {summary['device']} ({summary['dtype']}, {summary['attention_backend']} attention)\n")
    sch = summary["scheduler"]
    if sch["semantics"] == "v1":
        w(f"semantics: vLLM V1 (token budget {sch['max_num_batched_tokens']:,} per step, chunked prefill, "
          f"{sch['scheduling_policy']} policy, recompute-only preemption, watermark {sch['watermark']:.0%})\n")
    else:
        w(f"semantics: the paper's (vLLM V0: prefill or decode steps, fork and copy-on-write, "
          f"watermark {sch['watermark']:.0%})\n")
    what = "paged pool" if "paged" in summary else "contiguous region"
    if "hybrid" in summary:  # a block holds one KV cache group's layers: its bytes, not every layer's per token
        per_block, groups = summary["hybrid"]["bytes_per_block"], summary["kv_cache_groups"]
        layers = sum(len(g["layers"]) for g in groups)
        w(f"{what}: {summary['num_blocks']} blocks x {summary['block_size']} tokens = "
          f"{summary['num_blocks'] * summary['block_size']:,} token slots; a block holds one KV cache group's "
          f"layers ({len(groups[0]['layers'])} of {layers}): {summary['block_size']} tokens x "
          f"{per_block // summary['block_size']:,} bytes = {per_block:,} bytes, {summary['num_blocks']} x "
          f"{per_block:,} bytes = {summary['kv_cache_bytes'] / MIB:.2f} MiB ({summary['kv_bytes_per_token']:,} bytes "
          f"of KV per token over all {layers} layers, one slot in each group)\n\n")
    else:
        w(f"{what}: {summary['num_blocks']} blocks x {summary['block_size']} tokens = "
          f"{summary['num_blocks'] * summary['block_size']:,} token slots, "
          f"{summary['kv_bytes_per_token']:,} bytes of KV per token, {summary['kv_cache_bytes'] / MIB:.2f} MiB\n\n")
    for r in summary["requests"]:
        given = "" if r["prompt"] is not None else f" ({len(r['prompt_token_ids'])} token ids)"
        w(f"[{r['id']}]{given} {r['prompt_text']!r}\n   -> {r['output_text']!r}\n")
        for c in r["outputs"][1:]:
            w(f"   -> [{c['index']}] {c['text']!r}\n")
        w(f"   {len(r['output_token_ids'])} tokens, finish: {r['finish_reason']}, "
          f"preempted {r['num_preemptions']}x, last block table {r['block_table']}\n")
    unit = "blocks" if "paged" in summary else "slots"
    w(f"\n{'step':>5} {'kind':<8} {'seqs':>4} {'tokens':>6} {'used':>6} {'free':>6}  notes (used/free in {unit}; "
      f"contiguous 'used' = reserved)\n")
    waited: set = set()
    for rec in records:
        snap = rec.snapshot
        shown = [e for e in rec.events if e.kind in ("preempt", "finish", "cow", "fork", "prefix_hit", "swap_out",
                                                     "swap_in", "evict", "leave_window")
                 or e.kind == "wait" and e.request_id not in waited]
        waited |= {e.request_id for e in rec.events if e.kind == "wait"}
        notes = "; ".join(e.message for e in shown)
        w(f"{rec.step:>5} {rec.kind:<8} {len(rec.scheduled):>4} {rec.num_tokens:>6} "
          f"{snap.num_used_blocks:>6} {snap.num_free_blocks:>6}  {notes}\n")
    w(f"\n{summary['steps']} steps, {summary['generated_tokens']} tokens generated, {summary['tokens_per_s']} tokens/s\n")
    if "paged" in summary:
        p = summary["paged"]
        if p["groups"] is None:
            w(f"paged: {p['blocks_allocated']} blocks = {p['slots_allocated']:,} slots for {p['slots_used']:,} tokens "
              f"at their final lengths ({p['waste_pct']}% waste); peak {p['peak_blocks_used']} blocks in use, "
              f"peak concurrency {p['peak_concurrency']}, KV utilisation {p['kv_utilization']}%\n")
        else:
            a = p["all_groups"]
            w(f"paged, every KV cache group's tables at the final lengths: {a['blocks_allocated']} blocks = "
              f"{a['slots_allocated']:,} slots for {a['slots_used']:,} token slots ({a['waste_pct']}% waste); peak "
              f"{p['peak_blocks_used']} blocks in use (all groups, one pool), peak concurrency {p['peak_concurrency']}, "
              f"KV utilisation {p['kv_utilization']}%\n")
            for g in p["groups"]:
                name = ("full" if g["kind"] == "full_attention" else f"window {g['sliding_window']}") + \
                    f" (layers {', '.join(map(str, g['layers']))})"
                back = f", {g['given_back']} given back by the window" if g["kind"] == "sliding_window" else ""
                w(f"   {name}: {g['blocks_allocated']} blocks = {g['slots_allocated']:,} slots for "
                  f"{g['slots_used']:,} tokens{back}\n")
    if "contiguous" in summary:
        c = summary["contiguous"]
        each = (f"{c['reservation']:,} per request" if c["reservation"] is not None
                else f"{c['policy']} policy: {c['mean_reservation']:,.0f} per request on average")
        w(f"contiguous: {c['reserved_slots']:,} slots reserved ({each}) for "
          f"{c['used_slots']:,} tokens ({c['waste_pct']}% waste: {c['internal_frag_slots']:,} never used); "
          f"external fragmentation up to {c['external_frag_slots']:,} slots; {c['queued_at_door']} requests "
          f"waited at the door; peak concurrency {c['peak_concurrency']}, KV utilisation {c['kv_utilization']}%, "
          f"{c['steps']} steps, {c['tokens_per_s']} tokens/s\n")
    w("events: " + ", ".join(f"{k} {v}" for k, v in summary["events"].items()) + "\n")
    if "hybrid" in summary:
        h, groups = summary["hybrid"], summary["kv_cache_groups"]
        names = ", ".join(("full attention" if g["kind"] == "full_attention" else f"sliding window "
                           f"{g['sliding_window']} tokens") + f" (layers {', '.join(map(str, g['layers']))})"
                          for g in groups)
        p = h["peak"]
        w(f"hybrid model: KV cache groups {names}, one pool of {h['bytes_per_block']:,}-byte blocks; the sliding "
          f"windows gave back up to {p['blocks']} blocks ({p['bytes']:,} bytes) at step {p['step']}: "
          f"{p['held']} blocks held where the same model with every layer full would hold {p['twin']} (blocks of "
          f"{h['bytes_per_block']:,} bytes, one group's layers each: {p['held'] * h['bytes_per_block']:,} bytes held, "
          f"{p['twin'] * h['bytes_per_block']:,} with every layer full)\n")
        for rid, t in h["group_block_tables"].items():
            w(f"   [{rid}] last tables by group: " + "; ".join(
                f"{'full' if g['kind'] == 'full_attention' else 'window ' + str(g['sliding_window'])} {table}"
                for g, table in zip(groups, t)) + "\n")


def _tokenizer(engine):
    return lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _build_engines(engine_cls, configs: dict, allocators: list[str], scenario, seed: int) -> dict:
    """Build the engines (one copy of the weights) and check every request on each before anything runs.

    Raises:
        ValueError: a bad setting, or a request an allocator refuses (naming the allocator and request).
    """
    engines: dict = {}
    for alloc in allocators:
        first = next(iter(engines.values()), None)
        engine = engine_cls(configs[alloc], (first.model, first.tokenizer) if first else None)
        for i, r in enumerate(scenario.make(seed, _tokenizer(engine)).requests):
            try:
                if alloc == "contiguous" and engine.config.contiguous_policy in FINAL_LENGTH_POLICIES:
                    # the longest final length the request may reach stands in for the one learned later
                    ids = engines["paged"].check_request(r.prompt, r.params)
                    engine.check_request(r.prompt, r.params,
                                         final_len=min(len(ids) + r.params.max_tokens, engine.max_model_len))
                else:
                    engine.check_request(r.prompt, r.params)
            except ValueError as exc:
                raise ValueError(f"{alloc} allocator: request {i + 1} of {scenario.name!r}: {exc}") from None
        engines[alloc] = engine
    return engines


def run(args) -> int:
    from .llm_engine import LLMEngine  # heavy (torch, transformers): only for the run command

    scenario = get_scenario(args.scenario)
    if not 0 <= args.seed < 2**40:
        raise ValueError(f"--seed must be an integer in [0, 2**40), got {args.seed}")
    if args.trace:
        # Refuse before the run, not after it: an existing path must be a regular file that opens for
        # writing (in append mode, so nothing is truncated); a new one needs a writable folder.
        trace = Path(args.trace)
        if trace.exists():
            writable = trace.is_file()
            try:
                if writable:
                    open(trace, "a").close()
            except OSError:  # e.g. /proc/version: a regular file that refuses writes, even to root
                writable = False
        else:
            parent = trace.resolve().parent
            writable = parent.is_dir() and os.access(parent, os.W_OK)
        if not writable:
            raise ValueError(f"--trace {args.trace!r} is not a writable file path")
    if isinstance(args.passes, bool) or not 1 <= args.passes <= 100:
        raise ValueError(f"--passes must be an integer in [1, 100], got {args.passes}")
    if args.reset_prefix_cache and args.passes < 2:
        raise ValueError("--reset-prefix-cache resets between passes: give --passes 2 or more")
    choice = args.allocator or ("both" if scenario.compare else "paged")
    wanted = ["paged", "contiguous"] if choice == "both" else [choice]
    events = [f"{flag} {value!r}" for flag, value in (("--kv-events-endpoint", args.kv_events_endpoint),
                                                       ("--kv-events-replay-endpoint", args.kv_events_replay_endpoint))
              if value]
    if events and "paged" not in wanted:  # EngineConfig refuses the pair; the contiguous config never gets it
        raise ValueError(f"{' and '.join(events)}: the contiguous allocator has no prefix cache, so it publishes no "
                         f"KV events; use --allocator paged or both (the paged engine publishes)")
    spec = run_spec(args, scenario)
    configs = {a: spec.engine_config(a) for a in ("paged", "contiguous")}  # bad flags fail first
    # "pow2" and "oracle" reserve by each request's true final length: a paged run of the same requests
    # learns them (run_paged_then_contiguous; the same seeds give the same tokens on both allocators)
    oracle = "contiguous" in wanted and configs["contiguous"].contiguous_policy in FINAL_LENGTH_POLICIES
    allocators = ["paged", "contiguous"] if oracle else wanted
    engines = _build_engines(LLMEngine, configs, allocators, scenario, args.seed)
    cont = engines.get("contiguous")
    if cont is not None and cont.config.contiguous_policy == "max":
        workload = scenario.make(args.seed, _tokenizer(cont))
        longest = max(len(cont.check_request(r.prompt, r.params)) + r.params.max_tokens for r in workload.requests)
        if longest > cont.max_model_len:
            print(f"note: on the contiguous baseline requests stop at its {cont.max_model_len}-slot reservation; "
                  f"the longest request here needs {longest}, so its outputs are cut short", file=sys.stderr)

    def run_engine(what: str, config, final_lens) -> Run:
        """One of the engines built above, the scenario run ``--passes`` times on it, its trace written."""
        alloc = "paged" if what == "paged" else "contiguous"
        engine = engines[alloc]
        records: list[StepRecord] = []
        outputs = []
        for k in range(args.passes):
            if k and args.reset_prefix_cache:
                engine.reset_prefix_cache()
            outputs += run_workload(engine, scenario.make(args.seed, _tokenizer(engine)),
                                    on_step=_recorder(records, args.step_delay), final_lens=final_lens)
        engine.close()  # sends the KV events still queued
        if args.trace and alloc in wanted:
            path = Path(args.trace)
            if alloc == "contiguous" and len(wanted) > 1:
                path = path.with_name(f"{path.stem}.contiguous{path.suffix}")
            write_trace(records, path)
        return Run(engine, records, outputs)

    first = engines[allocators[0]]
    if "contiguous" in wanted:
        done = run_paged_then_contiguous(spec, scenario.make(args.seed, _tokenizer(first)),
                                         (first.model, first.tokenizer), paged="paged" in wanted,
                                         run_engine=run_engine)
        runs = {"paged": done.paged, "contiguous": done.contiguous[spec.contiguous_policy]}
    else:
        runs = {"paged": run_engine("paged", configs["paged"], None)}
    runs = {a: (runs[a].engine, runs[a].records, runs[a].outputs) for a in wanted}
    if args.semantics == "v1" and "contiguous" in wanted:
        print("note: the contiguous baseline runs the paper's scheduler (vLLM V0); --semantics v1 applies to the "
              "paged engine", file=sys.stderr)
    summary = summarize(runs)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_text(summary, runs.get("paged", runs.get("contiguous"))[1], sys.stdout)
    return 0


def _recorder(records: list, delay_s: float):
    """The on_step callback: keep each record, then wait ``delay_s`` (``--step-delay``)."""
    if not math.isfinite(delay_s) or not 0 <= delay_s <= 60:
        raise ValueError(f"--step-delay must be a number of seconds in [0, 60], got {delay_s}")

    def on_step(record) -> None:
        records.append(record)
        if delay_s:
            time.sleep(delay_s)
    return on_step


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "scenarios":
        for s in SCENARIOS.values():
            print(f"{s.name:<20} {s.description}")
        return 0
    try:
        if args.command == "watch":
            return watch.watch(args)
        if args.command == "replay":
            return watch.replay(args)
        if args.command == "route":
            from .watch import router

            return router.main(args)
        return run(args)
    except ValueError as exc:  # bad flags, bad model: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `... --json | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
