"""``engine.metrics.preemption_cost``: what a run's preemptions cost, read from its step records."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.metrics import preemption_cost
from engine.records import Event, EventKind


def _rec(step: int, kind: str, seconds: float, *events: Event):
    return SimpleNamespace(step=step, kind=kind, elapsed_s=seconds, events=list(events))


def _admit(rid: str, n: int, again: bool) -> Event:
    return Event(EventKind.ADMIT, rid, [], "", {"num_tokens": n, "computed": n, "readmission": again})


def _preempt(rid: str, mode: str) -> Event:
    return Event(EventKind.PREEMPT, rid, [], "", {"mode": mode, "reason": "R1 needs 1 free block, 0 are free"})


def _swap(kind: EventKind, rid: str, pairs: list) -> Event:
    return Event(kind, rid, [p[0] for p in pairs], "", {"pairs": pairs, "seqs": [rid]})


def test_recompute_counts_the_readmitted_tokens_and_times_their_steps():
    records = [_rec(1, "prefill", 0.050, _admit("R1", 20, False), _admit("R2", 20, False)),
               _rec(2, "decode", 0.010), _rec(3, "decode", 0.030, _preempt("R2", "recompute")),
               _rec(4, "decode", 0.012), _rec(5, "prefill", 0.020, _admit("R2", 23, True)),
               _rec(6, "decode", 0.011)]
    cost = preemption_cost(records, bytes_per_block=32_768)
    assert cost["preemptions"] == cost["by_recompute"] == 1 and cost["by_swap"] == 0
    assert cost["recomputed_tokens"] == 23
    assert cost["recompute_steps"] == [5] and cost["recompute_s"] == pytest.approx(0.020)
    assert cost["swap_out_blocks"] == cost["swap_in_blocks"] == cost["swap_bytes"] == 0 and cost["swap_steps"] == []
    # the yardstick leaves out the step that preempted: decode steps 2, 4 and 6
    assert cost["plain_decode_s"] == pytest.approx(0.011)


def test_swap_counts_blocks_both_ways_and_bytes():
    records = [_rec(1, "prefill", 0.05, _admit("R1", 20, False)),
               _rec(2, "decode", 0.02, _preempt("R2", "swap"), _swap(EventKind.SWAP_OUT, "R2", [[3, 0], [4, 1]])),
               _rec(3, "decode", 0.01),
               _rec(4, "decode", 0.03, _swap(EventKind.SWAP_IN, "R2", [[0, 7], [1, 2]])),
               _rec(5, "decode", 0.01)]
    cost = preemption_cost(records, bytes_per_block=1_000)
    assert (cost["by_swap"], cost["swap_out_blocks"], cost["swap_in_blocks"]) == (1, 2, 2)
    assert cost["swap_bytes"] == 4 * 1_000
    assert cost["swap_steps"] == [2, 4] and cost["swap_s"] == pytest.approx(0.05)
    assert cost["recomputed_tokens"] == 0 and cost["recompute_steps"] == []
    assert cost["plain_decode_s"] == pytest.approx(0.01)


def test_a_run_without_preemption_costs_nothing():
    cost = preemption_cost([_rec(1, "prefill", 0.1, _admit("R1", 5, False))], bytes_per_block=10)
    assert cost["preemptions"] == cost["recomputed_tokens"] == cost["swap_bytes"] == 0
    assert cost["recompute_s"] == cost["swap_s"] == cost["plain_decode_s"] == 0.0
    assert preemption_cost([], bytes_per_block=10)["preemptions"] == 0


def test_on_an_engine_run_the_swapped_blocks_come_back_and_match_the_kv_tensors(make_engine):
    """The swap scenario on the real engine: blocks out = blocks in, bytes from the engine's own tensors."""
    from engine import SamplingParams
    from engine.scenarios.presets import BATCH_PROMPTS

    engine = make_engine(block_size=8, num_blocks=16, max_model_len=96, preemption_mode="swap",
                         swap_space_blocks=64, watermark=0.0)
    for i, p in enumerate(BATCH_PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    records = []
    while engine.has_unfinished():
        records.append(engine.step())
    per_block = engine.kv_cache.nbytes // engine.num_blocks
    assert per_block == engine.geometry.bytes_per_block(engine.block_size)
    cost = preemption_cost(records, per_block)
    outs = sum(len(e.data["pairs"]) for r in records for e in r.events if e.kind == "swap_out")
    assert cost["by_swap"] > 0 and cost["swap_out_blocks"] == cost["swap_in_blocks"] == outs
    assert cost["swap_bytes"] == 2 * outs * per_block
    assert cost["swap_s"] == pytest.approx(sum(r.elapsed_s for r in records if r.step in cost["swap_steps"]))
