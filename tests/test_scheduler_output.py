"""The contract between the scheduler and the model runner (issue 24, item 1): ``schedule()`` writes a step down
as plain data (``SchedulerOutput``), the model runner reads only that, and ``update_from_output`` takes the
sampled tokens back. Checked on real engine runs of the presets that fork, copy on write, swap and preempt."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.scenarios.presets import SCENARIOS
from engine.scheduler_output import ScheduledSeqData, SchedulerOutput
from engine.scenarios.workloads import run_workload

ENGINE = Path(__file__).resolve().parent.parent / "engine"


@pytest.fixture(scope="module")
def loaded(model_path):
    from engine.model_loader import load_model

    return load_model(model_path, torch.device("cpu"), "float32")


def _run(loaded, name: str, semantics: str):
    """(records, the SchedulerOutput the runner got each step) of a preset."""
    sc = SCENARIOS[name]
    settings = dict(sc.engine_defaults)
    if semantics == "v1":  # V1 has neither swap nor a choice of preemption
        settings.pop("swap_space_blocks", None), settings.pop("preemption_mode", None)
    engine = LLMEngine(EngineConfig(device="cpu", semantics=semantics, **settings), loaded=loaded)
    outputs = []
    real = engine.runner.execute_model

    def spy(output):
        outputs.append(output)
        return real(output)

    engine.runner.execute_model = spy
    tokenize = lambda t: engine.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    records = []
    run_workload(engine, sc.make(0, tokenize), on_step=records.append)
    return records, outputs, engine.block_size


def _plain(value) -> bool:
    """Lists, tuples and dicts of ints, strings, bools and None only: nothing live."""
    if value is None or isinstance(value, (int, str, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, (SchedulerOutput, ScheduledSeqData)):
        return all(_plain(getattr(value, f)) for f in value.__dataclass_fields__)
    return False


@pytest.mark.parametrize("name,semantics", [("parallel-sampling", "paper"), ("swap", "paper"),
                                            ("beam-search", "paper"), ("memory-pressure", "v1")])
def test_the_runner_gets_plain_data_that_agrees_with_the_step(loaded, name, semantics):
    records, outputs, B = _run(loaded, name, semantics)
    assert len(outputs) == len(records)
    copies = swaps = 0
    for out, rec, before in zip(outputs, records, [None] + records[:-1]):
        assert _plain(out), rec.step
        assert out.step == rec.step and out.kind == rec.kind
        assert [(s.seq_id, s.req_id, s.num_new_tokens, s.num_computed_tokens) for s in out.scheduled] == \
            [(s.seq_id, s.request_id, s.num_tokens, s.start_pos) for s in rec.scheduled]
        tokens = {s.seq_id: s.token_ids for s in rec.snapshot.sequences}
        ended = {e.request_id for e in rec.events if e.kind == "finish"}
        for s in out.scheduled:
            [table], [slots] = s.block_tables, s.slot_mappings
            positions = range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
            assert slots == [table[p // B] * B + p % B for p in positions], (rec.step, s.seq_id)
            if s.seq_id in tokens:  # else a beam pruned in this step's update
                assert s.token_ids == tokens[s.seq_id][positions.start:positions.stop], (rec.step, s.seq_id)
                # it samples exactly when the step computes its last token: one token is appended (none
                # when a beam search ends)
                n = len(tokens[s.seq_id])
                assert s.sample == (n == positions.stop + 1 or (s.req_id in ended and n == positions.stop)), \
                    (rec.step, s.seq_id)
        kinds = [e.kind for e in rec.events]
        # a step's copies and swaps are those its scheduling decided (a fork's would wait for the next)
        assert [op for op in out.kv_ops if op[0] == "copy"] == \
            [("copy", e.data["src"], e.data["dst"]) for e in rec.events if e.kind == "cow"]
        assert sum(op[0] == "swap_out" for op in out.kv_ops) == sum(len(e.data["pairs"]) for e in rec.events
                                                                      if e.kind == "swap_out")
        copies += kinds.count("cow")
        swaps += kinds.count("swap_out")
        assert out.preempted_req_ids == [e.request_id for e in rec.events if e.kind == "preempt"]
        finished_before = [e.request_id for e in before.events if e.kind == "finish"] if before else []
        assert out.finished_req_ids == finished_before
        # the n samples forked right after their prompt's prefill (a beam's forks come from its update)
        forks = [e.request_id for e in rec.events if e.kind == "fork"]
        assert list(out.sample_from) == [f for f in forks if ".b" not in f]
    if name == "parallel-sampling":
        assert copies and any(out.sample_from for out in outputs)
    if name == "swap":
        assert swaps
    if name == "memory-pressure":
        assert any(out.preempted_req_ids for out in outputs)


def test_the_model_runner_reads_nothing_of_the_scheduler():
    """engine/model_runner.py imports no scheduler, request or allocator module; it reads a SchedulerOutput."""
    tree = ast.parse((ENGINE / "model_runner.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"scheduler", "scheduler_v1", "sequence", "block_manager", "kv_cache_manager"}, imported


def test_the_engine_fits_450_lines_and_beam_search_is_its_own_module():
    text = (ENGINE / "llm_engine.py").read_text()
    assert text.count("\n") <= 450, text.count("\n")
    assert "topk" not in text and "def _beam" not in text  # the beam search lives in engine/beam_search.py
