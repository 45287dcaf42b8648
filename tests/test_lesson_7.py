"""Lesson 7 (continuous batching and chunked prefill, vLLM V1): structure, every answer and slip, the
engine's answers checked against an independent replay of both schedulers' rules, and the page end to end."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from engine.scenarios.presets import SCENARIOS
from lessons import catalog
from lessons import l7_continuous_batching as l7
from lessons.common import LessonContext
from lessons.exercise import Exercise, TAGS
from lessons.text import fields, fill, split_body

SLUG = "l7_continuous_batching"
APP = str(Path(__file__).resolve().parent.parent / "app.py")
LESSON = next(l for l in catalog() if l.slug == SLUG)


@pytest.fixture(scope="module")
def loaded():
    return load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32")


@pytest.fixture(scope="module")
def ctx(loaded):
    kept = {}

    def memo(fn, *args):  # as the app's memo: one run per function and arguments
        key = (fn.key, args)
        if key not in kept:
            kept[key] = fn(*args)
        return kept[key]
    return LessonContext(loaded=loaded, memo=memo)


@pytest.fixture(scope="module")
def exs(ctx) -> dict[str, Exercise]:
    return l7.exercises(ctx)


@pytest.fixture(scope="module")
def runs(ctx):
    return l7._runs(ctx)


# ------------------------------------------------------------------------------------------ structure
def test_lesson_7_is_in_the_catalog_and_its_playground_preset_opens_in_v1():
    from ui.lab import fit_semantics
    from ui.state import preset_settings

    assert LESSON.number == 7 and LESSON.title and LESSON.minutes
    assert LESSON.playground["preset"] in SCENARIOS
    settings, note = fit_semantics(preset_settings(**LESSON.playground))
    assert note is None and settings.semantics == "v1"
    assert settings.max_num_batched_tokens == LESSON.playground["max_num_batched_tokens"] == \
        l7.playground()["max_num_batched_tokens"]
    assert settings.engine_config("paged").semantics == "v1"


def test_markers_fields_reveals_and_recap_resolve(ctx, exs):
    parts = split_body(LESSON.body)
    assert LESSON.exercise_ids == list(exs), "the questions appear in the text once each, in the module's order"
    for kind, value in parts:
        if kind == "widget":
            assert callable(getattr(l7, f"widget_{value}"))
    facts = l7.facts(ctx)
    assert fields(LESSON.body) <= set(facts)
    assert "{{" not in fill(LESSON.body, facts)
    for name in dir(l7):
        if name.startswith("reveal_"):
            assert name[len("reveal_"):] in exs, f"{name} reveals no exercise"
    assert 3 <= len(l7.RECAP) <= 5
    for line in l7.RECAP:
        assert fields(line) <= set(facts) and "{{" not in fill(line, facts)
    assert "identical" in facts["same_outputs"] and "NOT" not in facts["same_outputs"]


def test_tags_two_transfer_questions_and_a_scheduler_question(exs):
    assert all(ex.tags <= set(TAGS) for ex in exs.values())
    assert sum("transfer" in ex.tags for ex in exs.values()) >= 2
    assert sum("allocator" in ex.tags for ex in exs.values()) >= 1


# ---------------------------------------------------------------------------------- answers and slips
def _typed(ex: Exercise) -> str:
    return ", ".join(map(str, ex.expected)) if isinstance(ex.expected, list) else str(ex.expected)


def test_each_answer_is_accepted_and_each_slip_is_named(exs):
    for ex in exs.values():
        assert ex.check(ex.expected).correct, ex.id
        assert ex.check(_typed(ex)).correct, f"{ex.id}: the answer typed as text"
        if ex.kind == "number":
            assert ex.check(f"{ex.expected} {ex.unit}").correct, f"{ex.id}: with its unit"
        assert ex.slips, f"{ex.id} names no usual mistake"
        for slip in ex.slips:
            verdict = ex.check(slip.answer)
            assert not verdict.correct and verdict.slip == slip.name, (ex.id, slip.name)
            assert slip.message in verdict.message and "The engine says" in verdict.message
            typed = ", ".join(map(str, slip.answer)) if isinstance(slip.answer, list) else str(slip.answer)
            assert ex.check(typed).slip == slip.name, f"{ex.id}/{slip.name} typed as text"
        answers = [ex.parse(s.answer) for s in ex.slips]
        assert all(not ex._matches(a, b) for i, a in enumerate(answers) for b in answers[i + 1:]), \
            f"{ex.id}: two slips give the same answer"
        assert len({s.name for s in ex.slips}) == len(ex.slips)
        if ex.kind == "choice":  # every wrong option says what choosing it reveals
            assert sorted(s.answer for s in ex.slips) == sorted(o for o in ex.options if o != ex.expected)


def test_a_wrong_answer_without_a_slip_gets_the_plain_message(exs):
    ex = exs["v_chunk"]
    odd = next(v for v in range(1, 500) if ex.slip_for(float(v)) is None and not ex.check(v).correct)
    verdict = ex.check(odd)
    assert not verdict.correct and verdict.slip is None and verdict.message.startswith("Not quite")


# ------------------------------------------------------------- the engine's answers, replayed independently
def replay(semantics: str, budget: int | None, prompts: list[int], max_tokens: list[int], arrivals: list[int]):
    """The two schedulers' rules in plain Python, for this roomy-pool workload (no preemption, FCFS): per
    step, request index -> tokens computed. V1: running requests first, each what it lacks (a decode token
    or its prompt's next chunk) within the budget left, then waiting ones in arrival order with the rest.
    Paper: a prefill step with every waiting request's whole prompt when anyone waits, else a decode step."""
    n = len(prompts)
    have, done, written = list(prompts), [0] * n, [0] * n
    waiting, running, steps = [], [], []
    step = 0
    while len(steps) < 500 and (any(w < m for w, m in zip(written, max_tokens))):
        step += 1
        waiting += [i for i in range(n) if arrivals[i] == step]
        got = {}
        if semantics == "v1":
            left = budget
            for i in running:
                k = min(have[i] - done[i], left)
                if k > 0:
                    got[i], left = k, left - k
            while waiting and left > 0:
                i = waiting.pop(0)
                running.append(i)
                got[i] = min(have[i], left)
                left -= got[i]
        elif waiting:
            got = {i: have[i] for i in waiting}
            running += waiting
            waiting = []
        else:
            got = {i: 1 for i in running}
        for i, k in got.items():
            done[i] += k
            if done[i] == have[i]:  # nothing left uncomputed: it samples a token
                have[i] += 1
                written[i] += 1
                if written[i] == max_tokens[i]:
                    running.remove(i)
        steps.append(got)
    return steps


def _workload(loaded):
    reqs = l7.requests(loaded[1])
    return [len(p) for p, _, _ in reqs], [sp.max_tokens for _, sp, _ in reqs], [a for _, _, a in reqs]


@pytest.mark.parametrize("semantics,budget", [("paper", None), ("v1", l7.BUDGET), ("v1", l7.SMALL_BUDGET),
                                              ("v1", 8)])
def test_every_step_of_the_runs_follows_the_schedulers_rule(ctx, loaded, semantics, budget):
    run = ctx.run(l7.arrivals_run, semantics, budget)
    expected = replay(semantics, budget, *_workload(loaded))
    ids = run.request_ids
    got = [{ids.index(r): k for r, k in step.items()} for step in l7.tokens_per_step(run)]
    assert got == expected
    if semantics == "v1":
        assert all(rec.num_tokens <= budget for rec in run.records)
        assert all(rec.semantics == "v1" for rec in run.records)


def test_the_answers_are_the_replays_answers(loaded, exs):
    prompts, max_tokens, arrivals = _workload(loaded)
    v1 = replay("v1", l7.BUDGET, prompts, max_tokens, arrivals)
    small = replay("v1", l7.SMALL_BUDGET, prompts, max_tokens, arrivals)
    paper = replay("paper", None, prompts, max_tokens, arrivals)
    a4, a5 = arrivals[l7.LONG], arrivals[l7.SECOND]
    assert exs["v_chunk"].expected == v1[a4 - 1][l7.LONG]

    def ttft(steps, i):  # steps from arrival to the step that finishes its prompt, both counted
        total = 0
        for s, got in enumerate(steps, 1):
            total += got.get(i, 0)
            if total >= prompts[i]:
                return s - arrivals[i] + 1
    assert exs["v_ttft"].expected == ttft(v1, l7.LONG)
    assert exs["s_ttft16"].expected == ttft(small, l7.LONG)
    assert exs["v_step"].expected == [v1[a5 - 1].get(i, 0) for i in range(len(prompts))]
    # R1: from its first step to its last, the steps where it computed nothing
    last = max(s for s, got in enumerate(paper, 1) if 0 in got)
    assert exs["p_stall"].expected == sum(0 not in paper[s - 1] for s in range(2, last + 1))
    last16 = max(s for s, got in enumerate(small, 1) if 0 in got)
    last32 = max(s for s, got in enumerate(v1, 1) if 0 in got)
    assert exs["s_finish"].expected == ("at the same step" if last16 == last32 else
                                        "at an earlier step" if last16 < last32 else "at a later step")


def test_relations_between_the_answers(runs, exs):
    paper, v1, small = runs
    # the situation the questions need: the long prompt takes several chunks, the second arrives in the step
    # of its last chunk, and a smaller budget means more chunks
    assert 1 < exs["v_ttft"].expected < exs["s_ttft16"].expected
    row = exs["v_step"].expected
    assert sum(row) == l7.BUDGET and row[l7.SECOND] > 0 and all(x == 1 for x in row[:l7.SHORT])
    assert exs["p_stall"].expected == 2 and l7.stalled_steps(v1, v1.request_ids[0]) == []
    assert exs["s_finish"].expected == "at the same step"
    assert "mixed" in {r.kind for r in v1.records} and "mixed" not in {r.kind for r in paper.records}
    for r in v1.request_ids:  # exactness: scheduling never changes the tokens
        assert paper.outputs[r].output_token_ids == v1.outputs[r].output_token_ids == small.outputs[r].output_token_ids


def test_the_paper_run_prefills_each_prompt_whole_and_v1_caps_every_step(loaded, runs):
    paper, v1, small = runs
    prompts, _, arrivals = _workload(loaded)
    assert l7.largest_step(paper) == prompts[l7.LONG]
    assert l7.largest_step(v1) == l7.BUDGET and l7.largest_step(small) == l7.SMALL_BUDGET
    assert l7.steps_to_first_token(paper, l7.LONG) == 1
    assert [r.kind for r in paper.records][arrivals[l7.LONG] - 1] == "prefill"
    assert math.ceil(prompts[l7.LONG] / l7.BUDGET) < l7.steps_to_first_token(v1, l7.LONG)


def test_first_visit_is_quick(loaded):
    kept = {}  # an empty run cache, as on a server's first visit: each run computed once, as the app does

    def memo(fn, *args):
        return kept[(fn.key, args)] if (fn.key, args) in kept else kept.setdefault((fn.key, args), fn(*args))
    fresh = LessonContext(loaded=loaded, memo=memo)
    t0 = time.perf_counter()
    l7.exercises(fresh)
    l7.facts(fresh)
    elapsed = time.perf_counter() - t0
    print(f"lesson 7 first visit (exercises + facts, empty run cache): {elapsed:.2f} s")
    assert len(kept) == 3
    assert elapsed < 10  # about 1.5-2 s on 2 busy cores; a loose bound against a run grown by 5x


def test_the_figure_stacks_tokens_per_request_with_the_budget_line(runs):
    paper, v1, _ = runs
    fig = l7.step_figure(v1, "vLLM V1", l7.BUDGET)
    assert [t.name for t in fig.data if t.showlegend is not False] == v1.request_ids  # one legend entry each
    assert sorted({t.name for t in fig.data}) == sorted(v1.request_ids)
    totals = [sum(t.y[i] for t in fig.data) for i in range(len(v1.records))]
    assert totals == [r.num_tokens for r in v1.records]
    assert any(getattr(s, "y0", None) == l7.BUDGET for s in fig.layout.shapes)
    assert all("no token" not in a.text for a in fig.layout.annotations)
    marked = [a.x for a in l7.step_figure(paper, "paper").layout.annotations if "no token" in a.text]
    assert marked == l7.summary(paper)["stalls"] == [3, 6]


# ----------------------------------------------------------------------------------------------- the page
def _commit(at, key, ex, answer):
    if ex.kind == "choice":
        at.radio(key=f"in-{key}").set_value(answer)
    else:
        at.text_input(key=f"in-{key}").input(answer)
    next(b for b in at.button if b.label.startswith("Commit my answer") and key in b.form_id).click().run()
    assert not at.exception, [e.value for e in at.exception]


def test_the_page_end_to_end_wrong_once_then_right(ctx, exs):
    facts = l7.facts(ctx)
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    at.switch_page(LESSON.page_path).run()
    assert not at.exception, [e.value for e in at.exception]
    assert "vLLM V1" in at.title[0].value or "Lesson 7" in at.title[0].value
    for ex_id, ex in exs.items():
        key = f"{SLUG}:{ex_id}"
        slip = ex.slips[0]
        wrong = slip.answer if ex.kind == "choice" else _text(slip.answer)
        _commit(at, key, ex, wrong)
        assert any(slip.message[:40] in e.value for e in at.error), ex_id  # the slip's own feedback
        next(b for b in at.button if b.key == f"again-{key}").click().run()
        _commit(at, key, ex, ex.expected if ex.kind == "choice" else _typed(ex))
        assert any("engine agrees" in s.value for s in at.success), ex_id
    n = len(exs)
    assert f"{n} of {n} predictions made, {n} right (0 at the first try)" in at.caption[0].value
    assert not any("to go on" in i.value for i in at.info)  # no gate left closed
    assert not at.error
    assert any(b.label == "Open this in the Playground" for b in at.button)
    links = [e.proto.label for e in at.get("page_link")]
    assert any(label.startswith("Next:") or label == "All lessons" for label in links), links
    text = " ".join(m.value for m in at.markdown)
    assert "mixed steps of its run" in text  # the text after the last question is shown
    # the recap at the end: every takeaway, filled with the engine's figures
    for line in l7.RECAP:
        assert fill(line, facts) in text
    # the explore widget: another budget runs and draws without error
    at.radio(key="keep_l7_run").set_value(f"vLLM V1, budget {l7.WIDGET_BUDGETS[0]}").run()
    assert not at.exception, [e.value for e in at.exception]


def _text(answer) -> str:
    return ", ".join(map(str, answer)) if isinstance(answer, list) else str(answer)


def test_open_in_the_playground_loads_the_preset_in_v1():
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    at.switch_page(LESSON.page_path).run()
    next(b for b in at.button if b.label == "Open this in the Playground").click().run()
    assert not at.exception, [e.value for e in at.exception]
    lab = at.session_state["lab"]
    assert lab.run.settings.preset == LESSON.playground["preset"] and lab.run.semantics_note is None
    assert lab.run.paged.semantics == "v1"
    assert lab.run.paged.max_num_batched_tokens == LESSON.playground["max_num_batched_tokens"]
    assert re.search(r"vLLM V1", " ".join(m.value for m in at.markdown))
