"""Lesson 9 (planning memory): vLLM's start-up arithmetic against hand-computed figures and vLLM's own log
wording, the engine check against an independent replay of the scheduler's rule, every exercise's answer
and slips, and the page end to end in AppTest."""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from engine.scenarios.presets import SCENARIOS
from lessons import catalog, kv_math
from lessons.common import LessonContext
from lessons.exercise import Exercise, format_value
from lessons.text import fields, fill, split_body

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
SLUG = "l9_planning_memory"
l9 = importlib.import_module(f"lessons.{SLUG}")
VLLM_KV_UTILS = ROOT / l9.VLLM_SOURCE
GIB = 2**30


@pytest.fixture(scope="module")
def ctx():
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"))


@pytest.fixture(scope="module")
def exs(ctx) -> dict[str, Exercise]:
    return l9.exercises(ctx)


@pytest.fixture(scope="module")
def lesson():
    return next(l for l in catalog() if l.slug == SLUG)


# ------------------------------------------------------------------------------------------ structure
def test_the_lesson_is_in_the_catalog_with_its_markers_fields_and_preset(ctx, exs, lesson):
    assert lesson.number == 9 and lesson.nav_title == "Planning memory"
    assert lesson.playground["preset"] in SCENARIOS
    parts = split_body(lesson.body)
    assert [v for k, v in parts if k == "exercise"] == list(exs), "markers in the .md = exercises(ctx), in order"
    for kind, value in parts:
        if kind == "widget":
            assert callable(getattr(l9, f"widget_{value}"))
    facts = l9.facts(ctx)
    assert fields(lesson.body) <= set(facts)
    assert "{{" not in fill(lesson.body, facts)
    for name in dir(l9):
        if name.startswith("reveal_"):
            assert name[len("reveal_"):] in exs
    lines = [fill(line, facts) for line in l9.RECAP]
    assert 3 <= len(lines) <= 5 and all("{{" not in line for line in lines)


def test_the_playground_preset_opens(lesson):
    from ui.state import preset_settings

    settings = {k: v for k, v in lesson.playground.items() if k != "preset"}
    lab = preset_settings(lesson.playground["preset"], **settings)
    lab.engine_config("paged")  # raises ValueError if the settings do not make an engine config


def test_numbers_are_not_typed_into_the_markdown(lesson):
    """Every figure in the text comes from facts(ctx); only names carry digits (H100, PR 10511, vLLM 0.32 and
    V1, lesson 1)."""
    text = re.sub(r"\{\{[^}]*\}\}", "", lesson.body)
    text = re.sub(r"(?m)^\d+\. ", "", text)  # the numbered list's markers
    text = re.sub(r"[Ll]esson \d", "", text)  # references to other lessons
    for name in ("H100", "pull request 10511", "version 0.32", "V1"):
        text = text.replace(name, "")
    assert not re.findall(r"\d", text)


def _needles(ex: Exercise) -> list[str]:
    """How a text would state the answer (a bare number only when it is specific: 3+ digits or decimals)."""
    if ex.kind == "number":
        number = format_value(ex.expected)
        rounded = [f"{ex.expected:,.2f}"] if isinstance(ex.expected, float) else []  # as the lesson prints it
        return [format_value(ex.expected, ex.unit)] + rounded + (
            [number] if len(number.replace(",", "").replace(".", "")) >= 3 or "." in number else [])
    if ex.kind in ("list", "set"):
        return ["[" + ", ".join(map(str, ex.expected)) + "]"]
    return [ex.expected]


def test_no_text_above_a_question_states_its_answer(ctx, exs, lesson):
    facts = l9.facts(ctx)
    above = ""
    for kind, value in split_body(lesson.body):
        if kind == "text":
            above += fill(value, facts)
        elif kind == "exercise":
            seen = above + "\n" + exs[value].question
            for needle in _needles(exs[value]):
                assert not re.search(r"(?<![\w.,])" + re.escape(needle) + r"(?![\w]|[.,]\d)", seen), (value, needle)


def test_tags_transfer_and_allocator(exs):
    assert len([e for e in exs.values() if "transfer" in e.tags]) >= 2
    assert [e.id for e in exs.values() if "allocator" in e.tags] == ["e_victims"]


def test_each_answer_is_accepted_and_each_slip_named(exs):
    for ex in exs.values():
        assert ex.check(ex.expected).correct, ex.id
        text = ", ".join(map(str, ex.expected)) if isinstance(ex.expected, list) else str(ex.expected)
        assert ex.check(text).correct, f"{ex.id}: the answer typed as text"
        if ex.kind == "number" and ex.unit and ex.unit != "%":
            assert ex.check(f"{ex.expected} {ex.unit}").correct, f"{ex.id}: with its unit"
        if ex.kind == "set":
            assert ex.check(", ".join(map(str, reversed(ex.expected)))).correct, f"{ex.id}: in any order"
        assert ex.slips, f"{ex.id} names no usual slip"
        seen = []
        for slip in ex.slips:
            verdict = ex.check(slip.answer)
            assert not verdict.correct and verdict.slip == slip.name, (ex.id, slip.name, verdict)
            assert verdict.message.startswith(slip.message) and "The engine says" in verdict.message
            seen.append(repr(ex.parse(slip.answer)))
        assert len(seen) == len(set(seen)), f"{ex.id}: two slips give the same answer"


def test_the_expected_slips_are_all_there(exs):
    """The slips are filtered for distinctness; with the shipped data none may be lost."""
    names = {i: [s.name for s in ex.slips] for i, ex in exs.items()}
    assert names == {
        "p_weights": ["gb", "fp32"], "p_budget": ["no-profile", "whole-gpu", "util-last"],
        "p_blocks": ["tokens", "gb"], "p_concurrency": ["floor", "no-profile", "blocks-per-token"],
        "p_maxlen": ["tokens", "floor"], "e_admit": ["formula", "tokens", "all"],
        "e_victims": ["oldest", "victim-still-needs", "tokens"],
        "t_heavy": ["same-length", "waiting"], "t_small": ["same-as-16", "none-preempted", "first-step-only"],
    }


# ------------------------------------------------------------------------- part 1, computed independently
def test_the_worked_example_reproduces_vllms_log():
    plan = l9.example_plan()
    assert round(plan.weight_bytes / GIB, 2) == l9.PROFILE["model weights"]  # the config's count = vLLM's load
    assert abs(plan.kv_bytes / GIB - l9.PROFILE["available_kv_cache_memory"]) <= 0.015  # the log rounds each line
    assert plan.bytes_per_token == 131_072 and plan.bytes_per_block == 2 * 2**20
    assert plan.blocks_per_request == 8192 // 16


def test_the_real_plan_by_hand(exs):
    params = kv_math.parameter_count(kv_math.model_presets()["qwen2.5-7b"])
    weights = params * 2  # bfloat16
    act, other = round(1.26 * GIB), round(1.79 * GIB)
    budget = 72 * 10**9 - weights - act - other  # A100 80 GB x 0.9
    per_token = 2 * 28 * 4 * 128 * 2
    blocks = budget // (16 * per_token)
    assert exs["p_weights"].expected == pytest.approx(weights / GIB)
    assert exs["p_budget"].expected == pytest.approx(budget / GIB)
    assert exs["p_blocks"].expected == blocks
    assert exs["p_concurrency"].expected == pytest.approx(blocks / (131_072 // 16))
    assert exs["p_maxlen"].expected == pytest.approx(blocks / math.ceil(1000 / 16))
    assert exs["p_maxlen"].expected < exs["p_maxlen"].slips[0].answer  # whole blocks fit fewer than tokens say


def test_log_lines_use_vllms_wording():
    """Our two lines are vLLM 0.32's format strings, read from its installed source, filled the same way."""
    plan = kv_math.plan_kv_cache(80 * 10**9, 16 * 10**9, 131_072, 3000, 16)
    assert plan.blocks_per_request == 188 and plan.kv_cache_tokens == int(plan.num_blocks / 188 * 3000)
    assert plan.kv_cache_tokens < plan.slots
    if not VLLM_KV_UTILS.is_file():
        pytest.skip("vLLM's source (.peer-venv) is not installed here")
    source = VLLM_KV_UTILS.read_text()
    fmt = re.search(r'"%s KV cache size: %s tokens, "\s*"(Maximum concurrency for %s tokens per request: %.2fx)"',
                    source)
    assert fmt, "vLLM's log format moved; update KVPlan.log_lines and its docstring"
    assert "cdiv(" in source.split("def get_max_concurrency_for_kv_cache_config", 1)[1].split("def ", 1)[0]
    expected = ("GPU KV cache size: %s tokens, " + fmt.group(1)) % (f"{plan.kv_cache_tokens:,}",
                                                                    f"{plan.max_model_len:,}", plan.max_concurrency)
    assert plan.log_lines()[1] == expected
    worker = (VLLM_KV_UTILS.parent.parent / "worker" / "gpu_worker.py").read_text()
    assert '"Available KV cache memory: %s GiB"' in worker
    assert plan.log_lines()[0].startswith("Available KV cache memory: ")


def test_plan_refuses_bad_values():
    for bad in ({"memory_bytes": 0}, {"bytes_per_token": -1}, {"max_model_len": 0}, {"block_size": 0},
                {"activation_bytes": -1}, {"utilization": 1.5}):
        args = dict(memory_bytes=10**9, weight_bytes=0, bytes_per_token=1, max_model_len=16)
        args.update(bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            kv_math.plan_kv_cache(**args)
    assert kv_math.plan_kv_cache(10**9, 2 * 10**9, 1, 16).kv_bytes == 0  # weights alone do not fit: no budget


# --------------------------------------------------------------------- part 2, checked against the records
def _replay_victims(running: list[str], free: int, held: dict[str, int]) -> list[str]:
    """vLLM V1's FCFS rule, replayed by hand: in admission order each request needs one block; while none
    is free, the last running request is preempted (its blocks freed)."""
    running, victims = list(running), []
    i = 0
    while i < len(running):
        req = running[i]
        while free < 1:
            victim = running.pop()
            victims.append(victim)
            free += held[victim]
            if victim == req:
                break
        if req in victims:
            break
        free -= 1
        i += 1
    return victims


def test_the_engine_check_matches_the_formula_and_the_rule(ctx, exs):
    run = l9.main_run(ctx)
    B, L, P = l9.BLOCK_SIZE, l9.PROMPT + l9.OUTPUT, l9.PROMPT
    assert run.num_blocks == math.floor(round(l9.real_plan().max_concurrency, 2) * math.ceil(L / B))
    first = run.records[0].snapshot
    assert exs["e_admit"].expected == len(first.running) == run.num_blocks // math.ceil(P / B)
    assert first.num_used_blocks == len(first.running) * math.ceil(P / B)
    assert exs["e_admit"].expected > run.num_blocks // math.ceil(L / B)  # more start than the formula says
    fp = l9.first_preemption(run)
    assert fp["position"] % B == 0  # at a block boundary ...
    assert fp["position"] < L  # ... before anyone reaches the full length
    victims = _replay_victims(fp["running"], fp["free"], fp["held"])
    assert sorted(exs["e_victims"].expected) == sorted(l9.number_of(v) for v in victims)
    assert len(fp["survivors"]) == run.num_blocks // math.ceil(L / B)  # exactly the formula's whole requests
    # every request, preempted or not, finishes with all its tokens
    assert all(len(run.outputs[r].output_token_ids) == l9.OUTPUT for r in run.request_ids)


def test_the_transfers_come_from_their_own_runs(ctx, exs):
    heavy, small = l9.heavy_run(ctx), l9.small_block_run(ctx)
    assert exs["t_heavy"].expected == len(heavy.events("preempt")) == 0
    assert len(heavy.records[0].snapshot.running) == heavy.num_blocks // math.ceil(l9.HEAVY_PROMPT / l9.BLOCK_SIZE)
    assert small.num_blocks * l9.SMALL_BLOCK == l9.main_run(ctx).num_blocks * l9.BLOCK_SIZE  # the same bytes
    preempted = {e.request_id for e in small.events("preempt")}
    assert exs["t_small"].expected == len(set(small.request_ids) - preempted)
    admitted = [e.request_id for e in small.records[0].events if e.kind == "admit"]
    full = math.ceil((l9.PROMPT + l9.OUTPUT) / l9.SMALL_BLOCK)
    assert len([r for r in admitted if r not in preempted]) == small.num_blocks // full  # the formula, again


def test_paging_and_preemption_do_not_change_the_outputs(ctx):
    """Recomputed victims write the same tokens as in the run where nobody is preempted (greedy)."""
    run = l9.main_run(ctx)
    roomy = l9.planning_run(ctx.loaded, 64, l9.BLOCK_SIZE, l9.PROMPT, l9.OUTPUT, len(run.request_ids))
    assert not roomy.events("preempt") and run.events("preempt")
    for r in run.request_ids:
        assert run.outputs[r].output_token_ids == roomy.outputs[r].output_token_ids, r


def test_first_visit_is_quick(ctx, monkeypatch):
    """A first visit runs three small runs, not a workload: its cost counted in engine steps (123 today, ~1-3 s on
    2 cores), not timed, so a loaded machine cannot fail it (a 10 s limit failed at load 16)."""
    from engine.llm_engine import LLMEngine

    steps = []
    step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: steps.append(1) or step(self))
    fresh = LessonContext(loaded=ctx.loaded)
    l9.exercises(fresh)
    l9.facts(fresh)
    assert 0 < len(steps) <= 150, len(steps)


# ----------------------------------------------------------------------------------------------- the page
def _commit(at: AppTest, ex_id: str, answer: str) -> None:
    key = f"{SLUG}:{ex_id}"
    at.text_input(key=f"in-{key}").input(answer)
    next(b for b in at.button if b.label.startswith("Commit my answer") and key in b.form_id).click().run()
    assert not at.exception, [e.value for e in at.exception]


def test_the_page_end_to_end(exs):
    at = AppTest.from_file(APP, default_timeout=300)
    at.run()
    at.switch_page(f"lessons/{SLUG}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    n = len(exs)
    assert f"0 of {n} predictions made" in at.caption[0].value
    for k, (ex_id, ex) in enumerate(exs.items()):
        slip = ex.slips[0]
        wrong = ", ".join(map(str, slip.answer)) if isinstance(slip.answer, list) else str(slip.answer)
        _commit(at, ex_id, wrong)  # a usual slip: its own message
        assert any(slip.message in e.value for e in at.error), (ex_id, [e.value for e in at.error])
        next(b for b in at.button if b.key == f"again-{SLUG}:{ex_id}").click().run()
        right = ", ".join(map(str, ex.expected)) if isinstance(ex.expected, list) else str(ex.expected)
        _commit(at, ex_id, right)
        assert any("engine agrees" in s.value for s in at.success), ex_id
        assert f"{k + 1} of {n} predictions made, {k + 1} right (0 at the first try)" in at.caption[0].value
    assert not at.error
    assert any(s.label == "Model config" for s in at.selectbox)  # the planner, after the last question
    assert any("Maximum concurrency for" in c.value for c in at.code)
    labels = [p.proto.label for p in at.get("page_link")]
    assert any(l.startswith("Next:") or l == "All lessons" for l in labels), labels
    if hasattr(importlib.import_module("lessons.render"), "show_recap"):
        assert any(s.value == "Recap" for s in at.subheader)
    # the planner reacts: a shorter max_model_len raises the concurrency it logs
    before = next(c.value for c in at.code if "Maximum concurrency" in c.value)
    at.number_input(key="keep_l9_len").set_value(4096).run()
    after = next(c.value for c in at.code if "Maximum concurrency" in c.value)
    assert not at.exception and "4,096 tokens per request" in after and after != before
    next(b for b in at.button if b.label == "Open this in the Playground").click().run()
    assert not at.exception and at.session_state["lab"].run.settings.semantics == "v1"
