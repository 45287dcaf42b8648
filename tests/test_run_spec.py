"""One run spec (issue 24, item 3): ``engine.scenarios.run_spec.RunSpec`` is the one type a run's settings take
(the CLI, the Playground's ``RunSpec``, Compare and the benchmarks build it), ``RunSpec.engine_config`` the
one place an ``EngineConfig`` is derived, "the baseline runs the paper's scheduler" is written there once
(``RunSpec.baseline``), and "learn the final lengths, then run the contiguous policies" once
(``run_paged_then_contiguous`` / ``baseline_final_lengths``)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.scenarios.presets import SCENARIOS
from engine.scenarios.run_spec import RunSpec, max_num_seqs_for

ROOT = Path(__file__).resolve().parent.parent
RUN_BUILDERS = ["engine/cli.py", "ui/lab.py", "ui/compare.py", "bench/policies.py"]


def calls(path: Path) -> list[tuple[str, int]]:
    """(called name, line) of every call in a module (``f(...)`` and ``x.f(...)`` alike)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name:
                found.append((name, node.lineno))
    return found


# ------------------------------------------------------------------------------------------ written once
def test_learning_final_lengths_is_written_once():
    """The CLI, the Playground, Compare and the policies benchmark call run_paged_then_contiguous /
    baseline_final_lengths; none learns final lengths or builds an engine config of its own."""
    for rel in RUN_BUILDERS:
        names = [n for n, _ in calls(ROOT / rel)]
        assert "learn_final_lengths" not in names, f"{rel} learns final lengths itself"
        assert "EngineConfig" not in names, f"{rel} builds an EngineConfig itself"
        assert {"run_paged_then_contiguous", "baseline_final_lengths"} & set(names), rel
    learners = [p.relative_to(ROOT) for top in ("engine", "ui", "lessons", "bench", "viz", "scripts", "peer")
                for p in sorted((ROOT / top).rglob("*.py")) if "learn_final_lengths" in [n for n, _ in calls(p)]]
    assert [str(p) for p in learners] == ["engine/scenarios/run_spec.py"]


def test_the_baseline_runs_the_papers_scheduler_in_one_place():
    """Every spec's contiguous config is the paper's, FCFS, without V1's token budget, whatever the paged
    engine runs; the paged engine keeps the spec's semantics."""
    spec = RunSpec(semantics="v1", scheduling_policy="priority", max_num_batched_tokens=32)
    paged, contiguous = spec.engine_config("paged"), spec.engine_config("contiguous")
    assert (paged.semantics, paged.scheduling_policy, paged.max_num_batched_tokens, paged.max_num_seqs) == \
        ("v1", "priority", 32, 32)
    assert (contiguous.allocator, contiguous.semantics, contiguous.scheduling_policy,
            contiguous.max_num_batched_tokens, contiguous.max_num_seqs) == ("contiguous", "paper", "fcfs", None, 256)
    assert spec.baseline().engine_config("paged") == dataclasses.replace(contiguous, allocator="paged")


def test_the_paper_prefill_budget_reaches_both_paper_engines_only():
    """The CLI's --max-num-batched-tokens in paper semantics is the prefill budget of both engines (both run
    the paper's scheduler); in V1 it is the paged engine's token budget, and the baseline has none."""
    paper = RunSpec(prefill_budget=512)
    assert paper.engine_config("paged").max_num_batched_tokens == 512
    assert paper.engine_config("contiguous").max_num_batched_tokens == 512
    v1 = RunSpec(semantics="v1", max_num_batched_tokens=512)
    assert v1.engine_config("paged").max_num_batched_tokens == 512
    assert v1.engine_config("contiguous").max_num_batched_tokens is None


def test_every_preset_spec_is_its_registry_settings():
    """A preset's spec derives the config the registry's engine_defaults give (the scenario file, the CLI
    and the app meet in one shape)."""
    for name, scenario in SCENARIOS.items():
        spec = RunSpec.from_preset(name)
        for allocator in ("paged", "contiguous"):
            defaults = dict(scenario.engine_defaults)
            if allocator == "contiguous":  # the baseline runs the paper's scheduler, whatever the preset's semantics
                defaults.pop("semantics", None)
            want = EngineConfig(allocator=allocator, **defaults)
            want = dataclasses.replace(want, reservation_tokens=want.reservation_tokens or want.max_model_len)
            assert spec.engine_config(allocator) == want, (name, allocator)


def test_bad_values_are_named():
    with pytest.raises(ValueError, match=r"block_size must be a positive integer, got 0"):
        RunSpec(block_size=0).engine_config("paged")
    with pytest.raises(ValueError, match=r"kv_budget_mb must be a finite number of MiB .*got inf"):
        RunSpec(kv_budget_mb=float("inf")).engine_config("paged")
    with pytest.raises(ValueError, match=r"allocator must be 'paged' or 'contiguous', got 'both'"):
        RunSpec().engine_config("both")
    with pytest.raises(ValueError, match=r"unknown Playground setting\(s\): blocks"):
        RunSpec.from_preset("batch", blocks=3)
    with pytest.raises(ValueError, match=r"unknown scenario 'nope'"):
        RunSpec.from_preset("nope")


def test_max_num_seqs():
    assert max_num_seqs_for("v1", 32) == 32 and max_num_seqs_for("paper", 32) == 256
    assert RunSpec(semantics="v1", max_num_batched_tokens=32, max_num_seqs=8).engine_config("paged").max_num_seqs == 8
    with pytest.raises(ValueError, match=r"max_num_batched_tokens 8 must be at least max_num_seqs 256"):
        RunSpec(semantics="v1", max_num_batched_tokens=8, max_num_seqs=256).engine_config("paged")
