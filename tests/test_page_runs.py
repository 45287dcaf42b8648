"""Engine work on the pages: runs kept once per process and shared (never another setting's run, never changed
by a page), and the progress shown while they run, then removed (``infra/runs.py``)."""

from __future__ import annotations

import copy
import importlib
import threading
import time

import pytest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from lessons import catalog
from lessons.common import LessonContext
from lessons.l5_out_of_memory import pressure_run
from lessons.render import memo_for
from infra.runs import COMPARE_RUNS, LESSON_RUNS, Progress, ProgressBox, RunCache

from test_app import button, new_app

LESSONS = {lesson.number: lesson for lesson in catalog()}


@pytest.fixture
def shown(monkeypatch):
    """Every progress update a page's ``ProgressBox`` receives (the page runs in AppTest's script thread, in
    this process), with whether the box was drawn on the page then."""
    seen: list[tuple[str, float, bool]] = []
    draw = ProgressBox.__call__

    def spy(self, progress):
        draw(self, progress)
        seen.append((progress.line, progress.fraction, self.shown))
    monkeypatch.setattr(ProgressBox, "__call__", spy)
    return seen


@pytest.fixture
def slow_steps(monkeypatch):
    """Every engine step 10 ms longer, so a run lasts long enough for progress to be drawn, however fast
    the engine gets."""
    from engine.llm_engine import LLMEngine

    step = LLMEngine.step

    def slow(self):
        time.sleep(0.01)
        return step(self)
    monkeypatch.setattr(LLMEngine, "step", slow)


# ------------------------------------------------------------------------------------------- RunCache
def test_a_value_is_computed_once_per_key_and_again_for_another_key():
    cache, calls = RunCache(max_entries=2), []

    def compute(key):
        return lambda report: calls.append(key) or {"key": key}
    a = cache.get("a", compute("a"))
    assert cache.get("a", compute("a")) is a and calls == ["a"]
    b = cache.get("b", compute("b"))
    assert b == {"key": "b"} and b is not a and calls == ["a", "b"]
    cache.get("c", compute("c"))  # at most two: "a", the least recently used, goes
    assert "a" not in cache and "b" in cache and "c" in cache
    assert cache.computed == 3


def test_a_failure_is_not_kept_and_reaches_the_caller():
    cache = RunCache(max_entries=2)

    def fail(report):
        raise ValueError("no")
    with pytest.raises(ValueError, match="no"):
        cache.get("k", fail)
    assert "k" not in cache
    assert cache.get("k", lambda report: 1) == 1


def test_callers_at_the_same_time_share_one_computation_and_its_progress():
    cache = RunCache(max_entries=2)
    started, release, computed = threading.Event(), threading.Event(), []

    def compute(report):
        computed.append(1)
        report("Running the paged engine", 0.5, "step 4, 40 of 80 tokens")
        started.set()
        release.wait(5)
        return object()
    results, followed = {}, []
    first = threading.Thread(target=lambda: results.setdefault("first", cache.get("k", compute)), daemon=True)
    first.start()
    started.wait(5)
    second = threading.Thread(target=lambda: results.setdefault(
        "second", cache.get("k", compute, on_progress=followed.append)), daemon=True)
    second.start()
    time.sleep(0.3)
    release.set()
    first.join(5)
    second.join(5)
    assert len(computed) == 1 and results["first"] is results["second"]
    assert followed and followed[0].fraction == 0.5
    assert followed[0].line == "Running the paged engine (already under way): step 4, 40 of 80 tokens"


# -------------------------------------------------------------------------------------------- lessons
def test_a_lesson_run_is_kept_for_its_arguments_and_computed_for_others(slow_steps):
    reports: list[Progress] = []
    ctx = LessonContext(loaded=load_shared(EMBEDDED_MODEL), memo=memo_for(reports.append))
    LESSON_RUNS.clear()
    before = LESSON_RUNS.computed
    recompute = ctx.run(pressure_run, "recompute")
    reports_ = lambda: [r for r in reports if r.what != "Starting"]  # noqa: E731  (before the first step)
    assert reports_() and all(r.line.startswith("Running memory-pressure (preemption_mode=recompute): step ")
                              for r in reports_())
    reports.clear()
    swap = ctx.run(pressure_run, "swap")
    assert swap is not recompute and LESSON_RUNS.computed == before + 2
    assert swap.events("swap_out") and not recompute.events("swap_out")  # each its own setting's run
    assert ctx.run(pressure_run, "recompute") is recompute  # kept: no engine step, no progress
    assert LESSON_RUNS.computed == before + 2 and all("swap" in r.line for r in reports_())
    # what the page computes from a kept run is what a plain, uncached run gives
    plain = LessonContext(loaded=load_shared(EMBEDDED_MODEL))
    for number in (3, 4, 5, 6):
        module = importlib.import_module(LESSONS[number].module_name)
        # wall-clock times (lesson 5's cost of each preemption mode: *_time) differ from run to run
        same = lambda facts: {k: v for k, v in facts.items() if not k.endswith("_time")}  # noqa: E731
        assert same(module.facts(ctx)) == same(module.facts(plain))
        cached, fresh = module.exercises(ctx), module.exercises(plain)
        assert {k: (e.question, e.expected, e.explanation) for k, e in cached.items()} == \
               {k: (e.question, e.expected, e.explanation) for k, e in fresh.items()}


def test_a_lesson_page_shows_its_runs_progress_then_removes_it(shown, slow_steps):
    load_shared(EMBEDDED_MODEL)
    LESSON_RUNS.clear()
    at = new_app()
    at.switch_page(LESSONS[5].page_path).run()
    assert not at.exception
    lines = [line for line, _, _ in shown]
    assert any(line.startswith("Running memory-pressure (num_blocks=64): step ") for line in lines)
    assert all(drawn for _, _, drawn in shown)  # each update was on the page while the engine ran
    steps = [int(line.split("step ")[1].split(",")[0]) for line in lines if "preemption_mode=recompute" in line]
    assert steps == sorted(steps) and steps[-1] > 10  # updated as it went
    assert not at.status  # and gone once the page is drawn
    assert at.title[0].value.startswith("Lesson 5")

    shown.clear()  # another session: the runs are kept, nothing runs and no progress appears
    computed = LESSON_RUNS.computed
    other = new_app()
    other.switch_page(LESSONS[5].page_path).run()
    assert not other.exception and not shown and LESSON_RUNS.computed == computed
    assert [m.value for m in other.markdown] == [m.value for m in at.markdown]


def test_lesson_pages_leave_their_kept_runs_unchanged():
    """Every lesson drawn whole (every question answered: every reveal and widget), twice: the runs the
    sessions share are as they were computed."""
    load_shared(EMBEDDED_MODEL)
    at = new_app()
    for lesson in LESSONS.values():
        at.switch_page(lesson.page_path).run()
    kept = {key: copy.deepcopy(value) for key, value in LESSON_RUNS.items()}
    assert kept
    ctx = LessonContext(loaded=load_shared(EMBEDDED_MODEL))
    answers = {}
    for lesson in LESSONS.values():
        exercises = importlib.import_module(lesson.module_name).exercises(ctx)
        answers.update({f"{lesson.slug}:{i}": {"raw": ex.expected, "correct": True} for i, ex in exercises.items()})
    at.session_state["lesson_progress"] = answers
    for lesson in LESSONS.values():
        at.switch_page(lesson.page_path).run()
        assert not at.exception, lesson.slug
    at.switch_page(LESSONS[5].page_path).run()
    at.radio(key="keep_l5_policy").set_value("swap (tight pool)").run()
    at.slider(key="l5_step_swap").set_value(20).run()
    at.switch_page(LESSONS[4].page_path).run()
    at.radio(key="keep_l4_run").set_value("shared system prompt (prefix caching)").run()
    assert not at.exception
    now = dict(LESSON_RUNS.items())
    for key, value in kept.items():
        assert now[key] == value, key


# -------------------------------------------------------------------------------------------- Compare
def run_compare(at, name: str, seed: int = 0) -> dict:
    at.switch_page("ui/compare.py").run()
    next(s for s in at.selectbox if s.label == "Workload").set_value(name)
    next(n for n in at.number_input if n.label == "Seed").set_value(seed)
    button(at, "Run all").click().run()
    assert not at.exception
    return at.session_state["compare"]


def test_compare_shows_each_runs_progress_then_removes_it(shown, slow_steps):
    COMPARE_RUNS.clear()
    at = new_app()
    result = run_compare(at, "batch")
    # what comes before the first step ("Starting", the imports of a fresh process) is drawn only when it
    # takes a while (a loaded machine, a test run alone): the runs' own lines are the ones checked here
    lines = [line for line, _, _ in shown if line.startswith("Running")]
    assert lines[0].startswith("Running 6 requests of batch on the paged engine (Paper (vLLM V0)) (run 1 of 5): step ")
    for i, policy in enumerate(("Orca (Max)", "prompt + max_tokens", "Orca (Pow2)", "Orca (Oracle)")):
        assert any(line.startswith(f"Running the same requests on the contiguous baseline, {policy}") and
                   f"(run {i + 2} of 5): step " in line for line in lines), policy
    fractions = [f for line, f, _ in shown if line.startswith("Running")]
    assert fractions == sorted(fractions) and fractions[-1] > 0.8 and all(drawn for _, _, drawn in shown)
    assert not at.status  # removed once the runs are done
    assert any(c.value.startswith("Ran now: 5 runs, ") for c in at.caption)
    assert result["seconds"]["total"] > 0 and set(result["seconds"]["contiguous"]) == set(result["policies"])


def test_compare_keeps_a_run_for_its_settings_and_runs_other_settings_anew(shown):
    COMPARE_RUNS.clear()
    first = run_compare(new_app(), "batch", seed=0)
    computed = COMPARE_RUNS.computed
    shown.clear()
    other = new_app()  # another session, the same settings: the same run, no engine step, no progress
    again = run_compare(other, "batch", seed=0)
    assert again is first and COMPARE_RUNS.computed == computed and not shown
    assert any(c.value.startswith("Kept from an earlier run with the same settings") for c in other.caption)
    table = other.table[0].value

    seed1 = run_compare(other, "batch", seed=1)  # another seed: run anew, never the kept one
    assert seed1 is not first and COMPARE_RUNS.computed == computed + 1 and shown
    assert seed1["seed"] == seed1["settings"].seed == 1 and first["settings"].seed == 0
    assert [r.new_tokens for r in seed1["paged"][0]] != [r.new_tokens for r in first["paged"][0]]  # sampled anew
    other.radio(key="compare_semantics").set_value("v1").run()  # another semantics: run anew too
    button(other, "Run all").click().run()
    v1 = other.session_state["compare"]
    assert v1["semantics"] == "v1" and all(r.semantics == "v1" for r in v1["paged"][0])
    assert COMPARE_RUNS.computed == computed + 2
    other.radio(key="compare_semantics").set_value("paper").run()
    next(n for n in other.number_input if n.label == "Seed").set_value(0)
    button(other, "Run all").click().run()
    assert other.session_state["compare"] is first and other.table[0].value.equals(table)


def test_the_compare_page_leaves_a_kept_run_unchanged():
    at = new_app()
    result = run_compare(at, "batch")
    kept = copy.deepcopy(result)
    at.selectbox(key="compare_policy").set_value("oracle").run()
    at.slider[0].set_value(3).run()
    at.selectbox(key="compare_policy").set_value("pow2").run()
    assert not at.exception
    assert at.session_state["compare"] is result and result == kept


def test_no_bare_spinner_around_engine_work():
    """The pages that run the engine show a ProgressBox instead (the Server page's spinners wait on a
    network, not the engine)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for path in [root / "ui" / "compare.py", root / "ui" / "state.py", root / "ui" / "playground.py",
                 *sorted((root / "lessons").glob("*.py"))]:
        text = path.read_text(encoding="utf-8")
        assert "st.spinner" not in text and "show_spinner" not in text, path.name
