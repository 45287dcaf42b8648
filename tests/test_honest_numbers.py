"""Honest numbers: the prefix-cache hit rate counts first admissions only, the watermark's effect, one
definition of internal fragmentation, the contiguous policies, and no swap-in undone in the same step.

One engine run of ``chat-workload`` (paged, through the CLI, shared by the module) checks the numbers the
CLI reports. The other chat-workload figures come from a replay of the same requests through the real
``Scheduler`` and allocators with made-up tokens (no model; ``tests/test_scheduler.Driver``): scheduling
depends only on the requests' lengths and prompts, and ``test_the_replay_reproduces_the_engine_run``
checks that the replay reproduces the engine run's counts exactly. The contiguous runs of chat-workload
take minutes on the engine (903 steps for "max") and seconds replayed.
"""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from engine import SamplingParams, metrics
from engine.block_manager import BlockManager
from engine.cli import contiguous_summary, main
from engine.contiguous import ContiguousAllocator
from engine.records import EventKind
from engine.scenarios.presets import get_scenario
from engine.sequence import Request, Sequence
from engine.scenarios.workloads import run_workload
from test_scheduler import Driver

CHAT = get_scenario("chat-workload")
CHAT_POOL = dict(num_blocks=128, block_size=16, max_model_len=512, reservation=512)


def cli_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["run", "--device", "cpu", "--json", *argv]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def chat_paged() -> dict:
    """``python -m engine run --scenario chat-workload --allocator paged --json`` (default watermark 0.01)."""
    return cli_json("--scenario", "chat-workload", "--allocator", "paged")


@pytest.fixture(scope="module")
def chat_requests(model_path):
    """chat-workload's requests with the engine's tokenizer (no model needed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return CHAT.make(0, lambda text: tok(text, add_special_tokens=False)["input_ids"]).requests


def replay(allocator, workload_requests, max_model_len: int = 512) -> tuple[Driver, list]:
    """Run the requests through the real Scheduler and ``allocator`` with made-up tokens (no model), with the
    engine's limits for chat-workload (max_num_seqs 256, 2,048 batched tokens); returns the fake engine and
    one record per step (``.events``, ``.running``)."""
    eng = Driver(allocator, max_num_seqs=256, max_num_batched_tokens=2048, alphabet=1_000_000)
    for i, r in enumerate(workload_requests):
        ids = list(r.prompt)
        max_len = min(len(ids) + r.params.max_tokens, max_model_len)
        # as LLMEngine.add_request: with ignore_eos the final length is known (pow2 / oracle need it)
        reservation = allocator.reservation_for(len(ids), max_len, max_len)
        req = Request(f"R{i + 1}", None, ids, r.params, seed=0, max_len=min(max_len, reservation or max_len),
                      reservation=reservation)
        req.seqs.append(Sequence(req.request_id, list(ids), len(ids)))
        eng.add(req)
    eng.run()
    assert all(r.status == "finished" for r in eng.requests)
    return eng, [SimpleNamespace(events=s["events"], running=s["running"]) for s in eng.steps]


def replay_paged(workload_requests, watermark: float):
    bm = BlockManager(CHAT_POOL["num_blocks"], CHAT_POOL["block_size"], enable_prefix_caching=True,
                      watermark=watermark)
    _, records = replay(bm, workload_requests)
    return bm, records


# ----------------------------------------------------------------------------------------- prefix cache
def test_prefix_cache_hit_rate_counts_first_admissions_only(chat_paged):
    """Re-admitted requests mostly hit their own freed blocks: the old 14.7% counted those. The hit rate
    is of first admissions; re-admissions are reported apart (vLLM's PrefixCacheStats)."""
    paged = chat_paged["paged"]
    pc = paged["prefix_cache"]
    assert {"hit_rate_pct", "hit_tokens", "query_tokens", "readmissions", "readmission_query_tokens",
            "readmission_hit_tokens"} <= pc.keys()
    prompts = [r["prompt_token_ids"] for r in chat_paged["requests"]]
    assert pc["requests"] == len(prompts) == 32
    assert pc["query_tokens"] == sum(map(len, prompts))  # each prompt queried once, at its first admission
    assert pc["hit_rate_pct"] == round(100 * pc["hit_tokens"] / pc["query_tokens"], 2)
    assert pc["hit_rate_pct"] < 5  # far below the old, self-inflated 14.7%
    # the re-admissions, apart: one per recompute preemption, and they hit (their own blocks)
    assert pc["readmissions"] == paged["preemption"]["by_recompute"] > 0
    assert pc["readmission_hit_tokens"] > pc["hit_tokens"] > 0
    mixed = 100 * (pc["hit_tokens"] + pc["readmission_hit_tokens"]) / (pc["query_tokens"] + pc["readmission_query_tokens"])
    assert mixed > 2 * pc["hit_rate_pct"]
    # the events split the same way
    assert chat_paged["events"]["prefix_cache_hit_tokens"] == pc["hit_tokens"]
    assert chat_paged["events"]["readmission_hit_tokens"] == pc["readmission_hit_tokens"]


def test_the_replay_reproduces_the_engine_run(chat_paged, chat_requests):
    """The replay (no model) gives the engine run's steps, prefix-cache counters and preemptions exactly."""
    assert [list(r.prompt) for r in chat_requests] == [r["prompt_token_ids"] for r in chat_paged["requests"]]
    bm, records = replay_paged(chat_requests, watermark=0.01)  # EngineConfig's default
    assert len(records) == chat_paged["steps"]
    assert metrics.prefix_cache_stats(bm.stats) == chat_paged["paged"]["prefix_cache"]
    assert metrics.preemption_counts(records) == chat_paged["paged"]["preemption"]
    assert bm.peak_used_blocks == chat_paged["paged"]["peak_blocks_used"]


# -------------------------------------------------------------------------------------------- watermark
def test_watermark_cuts_preemptions_and_recompute_on_chat_workload(chat_requests):
    """Keeping 10% of the pool free at admission: fewer requests are admitted only to be preempted at their
    first decode steps (measured on the engine: 24 vs 11 preemptions, 47.2% vs 32.0% recompute share)."""
    _, none = replay_paged(chat_requests, watermark=0.0)
    _, tenth = replay_paged(chat_requests, watermark=0.1)
    none, tenth = metrics.preemption_counts(none), metrics.preemption_counts(tenth)
    assert (none["preemptions"], none["recompute_share_pct"]) == (24, 47.22)
    assert (tenth["preemptions"], tenth["recompute_share_pct"]) == (11, 32.03)
    assert tenth["preemptions"] < none["preemptions"]
    assert tenth["recompute_share_pct"] < none["recompute_share_pct"]


# ----------------------------------------------------------------------------------- contiguous policies
def replay_contiguous(policy: str):
    alloc = ContiguousAllocator(CHAT_POOL["num_blocks"] * CHAT_POOL["block_size"], CHAT_POOL["reservation"], policy)
    # no prefix cache: the prompts' token values do not matter, their lengths do
    eng, records = replay(alloc, CHAT.make(0, lambda text: [ord(c) % 97 for c in text]).requests)
    peak = max(r.running for r in records)
    return alloc, eng, len(records), peak


def test_contiguous_policies_on_chat_workload():
    """`python -m engine run --scenario chat-workload --contiguous-policy P --json`, measured on the engine:
    max 903 steps at most 4 running; prompt + max_tokens 471 steps, 14; pow2 in between."""
    runs = {p: replay_contiguous(p) for p in ("max", "max_tokens", "pow2", "oracle")}
    steps = {p: r[2] for p, r in runs.items()}
    peaks = {p: r[3] for p, r in runs.items()}
    assert (steps["max"], peaks["max"]) == (903, 4)
    assert (steps["max_tokens"], peaks["max_tokens"]) == (471, 14)
    assert steps["max_tokens"] < steps["pow2"] < steps["max"] and peaks["max"] < peaks["pow2"] < peaks["max_tokens"]
    # with ignore_eos, prompt + max_tokens is the final length: the same as the oracle
    assert (steps["oracle"], peaks["oracle"]) == (471, 14)
    used = sum(min(len(r.prompt) + r.params.max_tokens, 512) for r in CHAT.make(0, lambda t: [0] * len(t)).requests)
    for policy, (alloc, _, _, _) in runs.items():
        acc = metrics.contiguous_accounting(alloc.finished)
        assert acc["used_slots"] == used == 4666
        # one definition of internal fragmentation: the region's layout and the summary agree
        assert alloc.layout()["internal_frag_slots"] == acc["internal_frag_slots"]
        if policy in ("oracle", "max_tokens"):
            assert acc["reserved_slots"] == used and acc["internal_frag_slots"] == 0 and acc["waste_pct"] == 0
    assert metrics.contiguous_accounting(runs["max"][0].finished)["internal_frag_slots"] == 11_718
    assert metrics.contiguous_accounting(runs["max"][0].finished)["reserved_slots"] == 32 * 512


def _run(engine, prompts, max_tokens) -> tuple[list, list]:
    records = []
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                        for m in max_tokens], on_step=records.append)
    return records, outputs


def test_internal_fragmentation_has_one_definition_on_the_engine(make_engine, text_ids):
    """The last step's region layout, the CLI's summary and R - L per request all give the same slots. A
    request's last sampled token is never written (nothing computes it), but it is part of its length."""
    engine = make_engine(allocator="contiguous", block_size=16, num_blocks=8, max_model_len=64, reservation_tokens=64)
    prompts = [text_ids[:5], text_ids[:9], text_ids[:12]]
    records, outputs = _run(engine, prompts, [6, 10, 3])
    lengths = metrics.final_lengths(outputs)
    assert lengths == [11, 19, 15]
    expected = sum(64 - n for n in lengths)
    assert records[-1].snapshot.contiguous["internal_frag_slots"] == expected == 147
    assert contiguous_summary(engine, records, outputs)["internal_frag_slots"] == expected
    frees = [e for r in records for e in r.events if e.kind == EventKind.FREE]
    assert sorted(e.data["final_len"] for e in frees) == sorted(lengths)
    assert all(e.data["used"] == e.data["final_len"] - 1 for e in frees)  # written slots: one fewer


def test_oracle_reserves_exactly_the_final_lengths(make_engine, text_ids):
    """With ignore_eos the final length is prompt + max_tokens; a final length given in advance (learned from
    an earlier run) may be shorter than that, and the oracle reserves it, not prompt + max_tokens."""
    engine = make_engine(allocator="contiguous", contiguous_policy="oracle", block_size=16, num_blocks=8,
                         max_model_len=64)
    records, outputs = _run(engine, [text_ids[:5], text_ids[:30], text_ids[:12]], [6, 20, 3])
    rid = engine.add_request(text_ids[:7], SamplingParams(max_tokens=40, temperature=0.0), final_len=16)
    while engine.has_unfinished():
        records.append(engine.step())
    outputs.append(engine.get_output(rid))
    lengths = metrics.final_lengths(outputs)
    allocs = {e.request_id: e.data["length"] for r in records for e in r.events if e.kind == EventKind.ALLOCATE}
    assert [allocs[o.request_id] for o in outputs] == lengths == [11, 50, 15, 16]
    summary = contiguous_summary(engine, records, outputs)
    assert summary["reserved_slots"] == summary["used_slots"] == sum(lengths)
    assert summary["internal_frag_slots"] == 0 and summary["waste_pct"] == 0


# ----------------------------------------------------------------------------------------------- swap
def test_batch_scenario_with_swap_never_swaps_a_request_in_and_out_in_one_step(make_engine):
    """The defect: in the batch scenario with swap, R5 was swapped in and out in one step."""
    scenario = get_scenario("batch")
    engine = make_engine(**{**scenario.engine_defaults, "preemption_mode": "swap"})
    tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    records = []
    outputs = run_workload(engine, scenario.make(0, tokenize), on_step=records.append)
    assert all(o.finish_reason is not None for o in outputs)
    swaps = 0
    for rec in records:
        swapped_in = set()
        for e in rec.events:
            if e.kind == EventKind.SWAP_IN:
                swapped_in.add(e.request_id)
                swaps += 1
            elif e.kind == EventKind.PREEMPT:
                assert e.request_id not in swapped_in, f"step {rec.step}: {e.request_id} swapped in and out"
    assert swaps > 0
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.block_manager.num_free_swap_blocks == engine.block_manager.num_swap_blocks
