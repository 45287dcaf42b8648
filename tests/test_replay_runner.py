"""The contiguous baselines replay the paged run's tokens (``engine.replay_runner``): a replayed run equals a
real run of the model, record for record (every field but the step's wall time), and its outputs too.

Fast: the sampler picks a replayed row's token under every kind of sampling; mismatches are refused by name;
a small workload (greedy, seeded n = 3 samples, stop tokens, a late arrival, preemptions on the paged engine)
replays exactly; a beam search and a replay that does not fit run on the model.
Slow: every preset's Compare settings (``ui.compare.settings_for``), chat-workload (21 preemptions on the paged
engine) also with the paged engine in V1 (the replayed run is then the headless paper run).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine.config import CONTIGUOUS_POLICIES, FINAL_LENGTH_POLICIES, SamplingParams
from engine.replay_runner import ReplayMismatch, ReplayRunner
from engine.sampler import sample_batch
from engine.scenarios import run_spec
from engine.scenarios.run_spec import RunSpec, run, run_paged_then_contiguous
from engine.scenarios.workloads import Workload, WorkloadRequest
from engine.scheduler_output import ScheduledSeqData, SchedulerOutput
from engine.sequence import generator_for

VOCAB = 2048


@pytest.fixture(scope="module")
def loaded(model_path):
    from engine.model_loader import load_model

    return load_model(model_path, torch.device("cpu"), "float32")


def _plain(record) -> dict:
    d = dataclasses.asdict(record)
    d.pop("elapsed_s")
    return d


def assert_same_as_real(spec: RunSpec, workload: Workload, loaded, result) -> None:
    """Each policy of ``result`` replayed, and its run equals a real run of the model record for record."""
    assert result.not_replayed is None
    assert result.tokens == {p: "replayed" for p in result.contiguous}, result.tokens
    for policy, replayed in result.contiguous.items():
        assert isinstance(replayed.engine.runner, ReplayRunner) and replayed.engine.runner.num_replayed > 0
        config = dataclasses.replace(spec, contiguous_policy=policy).engine_config("contiguous")
        real = run(config, workload, loaded,
                   final_lens=result.final_lens if policy in FINAL_LENGTH_POLICIES else None)
        assert len(replayed.records) == len(real.records), policy
        for a, b in zip(replayed.records, real.records):
            assert _plain(a) == _plain(b), f"{policy}: step {b.step} differs"
        assert [dataclasses.asdict(o) for o in replayed.outputs] == [dataclasses.asdict(o) for o in real.outputs]


# ------------------------------------------------------------------------------------------------- fast
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.95, seed=3),
    SamplingParams(temperature=1.5, top_k=5), SamplingParams(temperature=0.3, top_p=0.01, top_k=1),
])
def test_the_sampler_picks_a_replayed_rows_token_and_draws_once(params):
    runner = ReplayRunner({"R1": [5, 6, 7, 1999]}, VOCAB)
    out = SchedulerOutput(1, "prefill", [ScheduledSeqData("R1", "R1", [5, 6, 7], 0, ([],), ([0, 1, 2],))])
    row = runner.execute_model(out)["R1"]
    gen, twin = generator_for(3, 0), generator_for(3, 0)
    assert sample_batch(row[None], [params], [gen]) == [1999]
    if not params.greedy:  # one draw from the sequence's stream, as a real row takes
        torch.rand((), generator=twin)
    assert torch.equal(gen.get_state(), twin.get_state())


def test_a_replay_that_does_not_fit_is_refused_by_name():
    runner = ReplayRunner({"R1": [5, 6, 7, 8]}, VOCAB)

    def out(seq_id, tokens, start=0):
        return SchedulerOutput(1, "decode", [ScheduledSeqData(seq_id, seq_id, tokens, start, ([],), ([0],))])
    with pytest.raises(ReplayMismatch, match="'R2' is not in the run"):
        runner.execute_model(out("R2", [5]))
    with pytest.raises(ReplayMismatch, match="'R1' computes tokens 1..2 that differ"):
        runner.execute_model(out("R1", [6, 9], start=1))
    with pytest.raises(ReplayMismatch, match="'R1' samples position 4, but .* ended it at 4 tokens"):
        runner.execute_model(out("R1", [8], start=3))


def _small(text_ids) -> Workload:
    p = text_ids
    return Workload("small", 0, [
        WorkloadRequest(0, p[:20], SamplingParams(max_tokens=24, temperature=0)),
        WorkloadRequest(0, p[30:45], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, n=3)),
        WorkloadRequest(0, p[50:80], SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=1,
                                                    stop_token_ids=[p[81], p[85]])),
        WorkloadRequest(2, p[90:100], SamplingParams(max_tokens=28, temperature=1.0, seed=2)),
    ])


SMALL = dict(model=run_spec.EMBEDDED_MODEL, preset="custom", block_size=4, num_blocks=48, max_model_len=64,
             device="cpu", dtype="float32")


def test_a_small_workload_replays_exactly(loaded, text_ids):
    """"max" (rows cut at the reservation) and "oracle" (final lengths learnt); the slow test runs all four."""
    spec, workload = RunSpec(**SMALL), _small(text_ids)
    result = run_paged_then_contiguous(spec, workload, loaded, ["max", "oracle"])
    assert sum(o.num_preemptions for o in result.paged.outputs) > 0  # the paged run preempted and recomputed
    assert len(result.paged.outputs[1].outputs) == 3
    assert_same_as_real(spec, workload, loaded, result)


def test_beam_search_and_a_replay_that_does_not_fit_run_on_the_model(loaded, text_ids, monkeypatch):
    spec = RunSpec(**SMALL)
    beams = Workload("beams", 0, [WorkloadRequest(0, text_ids[:12], SamplingParams(max_tokens=8, beam_width=3))])
    result = run_paged_then_contiguous(spec, beams, loaded, ["max"])
    assert "beam search" in result.not_replayed and result.tokens == {"max": "model"}
    assert not isinstance(result.contiguous["max"].engine.runner, ReplayRunner)

    import engine.replay_runner as replay_runner

    def wrong(engine):  # every sequence one token short: the replay runs out and gives up
        return {s: t[:-1] for s, t in real_tokens(engine).items()}
    real_tokens = replay_runner.tokens_by_sequence
    monkeypatch.setattr(replay_runner, "tokens_by_sequence", wrong)
    workload = Workload("two", 0, _small(text_ids).requests[:2])
    result = run_paged_then_contiguous(spec, workload, loaded, ["max_tokens"])
    assert result.tokens == {"max_tokens": "model"}
    real = run(dataclasses.replace(spec, contiguous_policy="max_tokens").engine_config("contiguous"), workload, loaded)
    assert [_plain(r) for r in result.contiguous["max_tokens"].records] == [_plain(r) for r in real.records]


# ------------------------------------------------------------------------------------------------- slow
def _compare_case(name: str, semantics: str, loaded):
    from engine.scenarios.presets import SCENARIOS
    from ui.compare import settings_for

    spec, _ = settings_for(name, 0, semantics)
    spec = dataclasses.replace(spec, device="cpu", dtype="float32")
    workload = SCENARIOS[name].make(0, lambda t: loaded[1](t, add_special_tokens=False)["input_ids"])
    return spec, workload


def _presets() -> list[str]:
    from engine.scenarios.presets import SCENARIOS

    return list(SCENARIOS)


# The benchmark-sized presets (hundreds of steps, run five times each: the paged run, then each policy replayed
# and run on the model) took 120-205 s apiece on 2 busy cores, two thirds of the whole suite's wall time in one
# file; they replay through the same code as memory-pressure (preemption) and the small presets, and
# PAL_REPLAY_ALL=1 adds them (docs/contributing.md).
WORKLOAD_PRESETS = ("lesson-lengths", "chat-workload", "chat-arrivals")


def _replay_cases() -> list[tuple[str, str]]:
    every = os.environ.get("PAL_REPLAY_ALL") == "1"
    cases = [(n, "paper") for n in _presets() if every or n not in WORKLOAD_PRESETS]
    cases += [("memory-pressure", "v1"), ("hybrid-window", "v1")]
    return cases + ([("chat-workload", "v1")] if every else [])


@pytest.mark.slow
@pytest.mark.parametrize("name,semantics", _replay_cases())
def test_every_presets_compare_replays_exactly(name, semantics, loaded):
    spec, workload = _compare_case(name, semantics, loaded)
    result = run_paged_then_contiguous(spec, workload, loaded, CONTIGUOUS_POLICIES, skip_refused=True)
    if name == "beam-search":
        assert result.not_replayed and set(result.tokens.values()) == {"model"}
        return
    if (name, semantics) in {("chat-workload", "paper"), ("memory-pressure", "paper")}:  # preempted, recomputed
        assert sum(o.num_preemptions for o in result.paged.outputs) > 0
    assert result.contiguous, result.skipped
    assert_same_as_real(spec, workload, loaded, result)


def test_compares_timing_line_says_how_the_baselines_got_their_tokens():
    from ui.compare import timing_line

    result = {"seconds": {"paged": 1.0, "learn": 0.0, "contiguous": {"max": 0.5, "oracle": 0.4}, "total": 2.0},
              "paged": ([1, 2], None), "policies": {"max": ([1], None), "oracle": ([1], None)},
              "tokens": {"max": "replayed", "oracle": "replayed"}, "not_replayed": None}
    assert "contiguous 0.9 s, replaying the paged run's tokens)" in timing_line(result, False)
    result["seconds"]["learn"] = 3.0  # V1: the headless run under the paper's scheduler is the one replayed
    assert "the paper's scheduler for the baselines 3.0 s, contiguous 0.9 s, replaying that run's tokens" in \
        timing_line(result, False)
    result.update(tokens={"max": "model", "oracle": "model"}, not_replayed="beam search: why")
    assert timing_line(result, True).endswith("on the model: beam search: why).")
