"""The headless main job: ``python -m engine run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine import read_trace
from engine.cli import main

ROOT = Path(__file__).resolve().parent.parent
TOP_KEYS = {"model", "device", "block_size", "num_blocks", "steps", "requests", "paged", "tokens_per_s"}
REQUEST_KEYS = {"id", "prompt", "output_text", "output_token_ids", "block_table"}
PAGED_KEYS = {"peak_blocks_used", "slots_allocated", "slots_used", "waste_pct"}


def test_batch_json_through_the_real_entry_point():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "engine", "run", "--scenario", "batch", "--json"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert TOP_KEYS <= out.keys()
    assert out["model"].endswith("tiny_model") and out["device"] == "cpu"
    assert len(out["requests"]) == 6
    for r in out["requests"]:
        assert REQUEST_KEYS <= r.keys()
        assert r["output_text"] and r["output_token_ids"] and r["block_table"]
        assert r["finish_reason"] in ("stop", "length")
    paged = out["paged"]
    assert PAGED_KEYS <= paged.keys()  # their values: test_accounting_gives_the_scenario_s_known_figures
    assert 0 < paged["peak_blocks_used"] <= out["num_blocks"]
    assert out["events"]["preemptions"] > 0  # the batch scenario's pool is too small on purpose
    assert out["tokens_per_s"] > 0


def test_tiny_pool_preempts_and_still_finishes_every_request(capsys, tmp_path):
    trace = tmp_path / "run.jsonl"
    code = main(["run", "--scenario", "batch", "--device", "cpu", "--block-size", "4", "--num-blocks", "12",
                 "--max-model-len", "48", "--json", "--trace", str(trace)])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_blocks"] == 12 and out["block_size"] == 4
    assert out["events"]["preemptions"] > 0
    assert all(r["finish_reason"] is not None for r in out["requests"])
    records = list(read_trace(trace))
    assert len(records) == out["steps"]
    assert records[-1].snapshot.num_free_blocks == 12
    preempts = [e for r in records for e in r.events if e.kind == "preempt"]
    assert len(preempts) == out["events"]["preemptions"]


def test_text_summary_lists_requests_and_steps(capsys):
    assert main(["run", "--scenario", "single", "--device", "cpu", "--num-blocks", "16"]) == 0
    text = capsys.readouterr().out
    assert "[R1] 'ROMEO." in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["step", "kind", "seqs"])
    end = lines.index("", header)
    table = [line.split() for line in lines[header + 1:end]]
    assert [row[1] for row in table] == ["prefill"] + ["decode"] * (len(table) - 1)
    assert len(table) == 48  # one prefill (first token) + 47 decode steps for max_tokens=48


def test_kv_budget_flag_sets_the_pool(capsys):
    assert main(["run", "--scenario", "single", "--device", "cpu", "--kv-budget-mb", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_blocks"] == (1024 * 1024) // (out["kv_bytes_per_token"] * out["block_size"])


def test_bad_flag_value_is_one_line_error(capsys):
    assert main(["run", "--scenario", "single", "--device", "cpu", "--block-size", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: block_size must be a positive integer, got 0"


def run_json(capsys, *argv) -> dict:
    assert main(["run", "--device", "cpu", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_parallel_sampling_scenario_events_add_up(capsys):
    out = run_json(capsys, "--scenario", "parallel-sampling")
    [req] = out["requests"]
    assert len(req["outputs"]) == 4 and all(o["text"] for o in req["outputs"])
    ev = out["events"]
    assert ev["forks"] == 3
    mid_block = len(req["prompt_token_ids"]) % out["block_size"] != 0
    assert ev["cow_copies"] == (3 if mid_block else 0)  # every sample but the last copies the shared block


def test_beam_search_scenario(capsys):
    out = run_json(capsys, "--scenario", "beam-search")
    [req] = out["requests"]
    assert len(req["outputs"]) == 4
    scores = [o["score"] for o in req["outputs"]]
    assert scores == sorted(scores, reverse=True)
    assert out["events"]["forks"] > 0 and out["events"]["cow_copies"] > 0


def test_shared_prefix_scenario_hits_what_is_shared(capsys):
    out = run_json(capsys, "--scenario", "shared-prefix")
    B = out["block_size"]
    expected = 0
    seen = []
    for r in out["requests"]:  # all admitted in one step, in order: each hits the longest earlier prefix
        ids = r["prompt_token_ids"]
        common = max((next((i for i, (a, b) in enumerate(zip(ids, s)) if a != b), min(len(ids), len(s)))
                      for s in seen), default=0)
        expected += min(common, len(ids) - 1) // B * B
        seen.append(ids)
    assert expected > 0
    assert out["events"]["prefix_cache_hit_tokens"] == expected


def test_swap_scenario_swaps_out_and_back(capsys):
    out = run_json(capsys, "--scenario", "swap")
    ev = out["events"]
    assert ev["preemptions"] > 0
    assert ev["swaps_out"] == ev["swaps_in"] == ev["preemptions"]
    assert all(len(r["output_token_ids"]) == 40 for r in out["requests"])


def test_counts_cover_every_sample_and_the_peak_inside_a_step(capsys):
    out = run_json(capsys, "--scenario", "parallel-sampling")
    [req] = out["requests"]
    assert out["generated_tokens"] == sum(len(o["token_ids"]) for o in req["outputs"])
    # a request that finishes in the step it was admitted in still counts toward the peak
    out = run_json(capsys, "--scenario", "single", "--num-blocks", "2", "--max-model-len", "20")
    assert out["paged"]["peak_blocks_used"] == 2


def test_beam_finish_sentence_matches_the_best_beam(capsys, tmp_path):
    trace = tmp_path / "beam.jsonl"
    out = run_json(capsys, "--scenario", "beam-search", "--trace", str(trace))
    [finish] = [e for r in read_trace(trace) for e in r.events if e.kind == "finish"]
    assert f"after {len(out['requests'][0]['output_token_ids'])} tokens: " in finish.message


def test_memory_pressure_with_either_preemption_mode_gives_the_same_text(capsys):
    recompute = run_json(capsys, "--scenario", "memory-pressure")
    swap = run_json(capsys, "--scenario", "memory-pressure", "--preemption-mode", "swap")
    assert recompute["events"]["preemptions"] > 0 and recompute["events"]["swaps_out"] == 0
    assert swap["events"]["swaps_out"] == swap["events"]["preemptions"] > 0
    assert [r["output_token_ids"] for r in recompute["requests"]] == [r["output_token_ids"] for r in swap["requests"]]
    # prompts given as token ids are shown as text too
    assert [len(r["prompt_token_ids"]) for r in swap["requests"]] == [20, 20, 20, 20, 100]
    assert swap["requests"][0]["prompt"] is None and swap["requests"][0]["prompt_text"].startswith("ROMEO.")


def test_accounting_gives_the_scenario_s_known_figures(capsys, tmp_path):
    """memory-pressure (lesson 5) by construction: four 20-token prompts writing 30 tokens and one of 100
    writing 10, all ignore_eos, in blocks of 16. Final lengths 50, 50, 50, 50, 110: paged they hold
    4 x 4 + 7 = 23 blocks = 368 slots for 310 tokens (15.76% empty); the contiguous oracle reserves exactly
    50, 50, 50, 50 and 110 slots (no waste). (lesson-lengths gives the lesson's own figures, 325 blocks =
    5,200 slots / 1.4% and 16,384 reserved / 5,126 used / 68.7%, but takes minutes on a CPU.)"""
    trace = tmp_path / "run.jsonl"
    out = run_json(capsys, "--scenario", "memory-pressure", "--allocator", "both", "--contiguous-policy", "oracle",
                   "--trace", str(trace))
    paged, cont = out["paged"], out["contiguous"]
    assert (paged["blocks_allocated"], paged["slots_allocated"], paged["slots_used"], paged["waste_pct"]) == \
        (23, 368, 310, 15.76)
    assert cont["policy"] == "oracle"
    assert (cont["reserved_slots"], cont["used_slots"], cont["internal_frag_slots"], cont["waste_pct"]) == \
        (310, 310, 0, 0.0)
    # the contiguous run's own trace: each reservation is the request's final length
    records = list(read_trace(tmp_path / "run.contiguous.jsonl"))
    reserved = [e.data["length"] for r in records for e in r.events if e.kind == "allocate"]
    assert reserved == [50, 50, 50, 50, 110]
    finals = [e.data["final_len"] for r in records for e in r.events if e.kind == "free"]
    assert sorted(finals) == [50, 50, 50, 50, 110]


def test_watermark_flag_keeps_blocks_free_at_admission(capsys, tmp_path):
    """batch: 12 blocks. With --watermark 0.5, admission keeps 6 blocks free (except for the first request
    into an empty pool): after a prefill step that admitted into a pool in use, at least 6 are free."""
    runs = {}
    for w in ("0", "0.5"):
        trace = tmp_path / f"w{w}.jsonl"
        out = run_json(capsys, "--scenario", "batch", "--watermark", w, "--trace", str(trace))
        runs[w] = list(read_trace(trace))
        assert all(r["finish_reason"] is not None for r in out["requests"])
    used_before = 0
    checked = 0
    for rec in runs["0.5"]:
        admits = sum(e.kind == "admit" for e in rec.events)
        if rec.kind == "prefill" and (used_before or admits > 1):
            assert rec.snapshot.num_free_blocks >= 6, rec.step
            checked += 1
        used_before = rec.snapshot.num_used_blocks
    assert checked
    waits = [e.data["reason"] for r in runs["0.5"] for e in r.events if e.kind == "wait"]
    assert any("+ 6 kept free (watermark)" in w for w in waits)
    first_admits = {w: sum(e.kind == "admit" for e in recs[0].events) for w, recs in runs.items()}
    assert first_admits["0.5"] < first_admits["0"]
    assert main(["run", "--scenario", "batch", "--device", "cpu", "--watermark", "1"]) == 2
    assert capsys.readouterr().err.strip() == "error: watermark must be a number in [0, 1), got 1.0"


def _hits_by_pass(trace, num_requests: int) -> list[int]:
    """Prefix-cache hit tokens of first admissions, per pass (requests R1..Rn, then Rn+1..R2n)."""
    hits = [0, 0]
    for r in read_trace(trace):
        for e in r.events:
            if e.kind == "prefix_hit" and not e.data["readmission"]:
                hits[(int(e.request_id[1:]) - 1) // num_requests] += e.data["num_tokens"]
    return hits


def test_passes_hit_the_cache_unless_it_is_reset_between_them(capsys, tmp_path):
    """shared-prefix twice on one engine: the second pass finds the first pass's blocks cached; with
    --reset-prefix-cache it hits only what it shares within itself, exactly as the first pass did."""
    kept = tmp_path / "kept.jsonl"
    out = run_json(capsys, "--scenario", "shared-prefix", "--passes", "2", "--trace", str(kept))
    assert len(out["requests"]) == 16
    first, second = _hits_by_pass(kept, 8)
    B = out["block_size"]
    prompts = [r["prompt_token_ids"] for r in out["requests"][:8]]
    assert first > 0
    assert second == sum((len(p) - 1) // B * B for p in prompts) > first  # every full prompt block hits
    reset = tmp_path / "reset.jsonl"
    out = run_json(capsys, "--scenario", "shared-prefix", "--passes", "2", "--reset-prefix-cache", "--trace",
                   str(reset))
    assert _hits_by_pass(reset, 8) == [first, first]
    assert out["events"]["prefix_cache_hit_tokens"] == 2 * first
    resets = [(r.step, e.data["num_blocks"]) for r in read_trace(reset) for e in r.events
              if e.kind == "reset_prefix_cache"]
    assert len(resets) == 1 and resets[0][1] > 0


def test_zero_passes_is_a_one_line_error(capsys):
    assert main(["run", "--scenario", "single", "--device", "cpu", "--passes", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --passes must be an integer in [1, 100], got 0"
    assert len(err.strip().splitlines()) == 1


def test_kv_events_flags_with_only_the_contiguous_allocator_are_refused(capsys):
    # EngineConfig refuses allocator="contiguous" with kv_events_endpoint; the CLI dropped the flag instead
    assert main(["run", "--scenario", "single", "--device", "cpu", "--allocator", "contiguous",
                 "--kv-events-endpoint", "tcp://127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --kv-events-endpoint 'tcp://127.0.0.1:0': the contiguous allocator has no prefix "
                          "cache") and len(err.strip().splitlines()) == 1
    assert main(["run", "--scenario", "single", "--device", "cpu", "--allocator", "contiguous",
                 "--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]) == 2
    assert "--kv-events-replay-endpoint 'tcp://127.0.0.1:0': the contiguous" in capsys.readouterr().err
