"""Lesson 8 (prefix caching in depth): structure, the engine's answers recomputed independently, every slip,
and the page end to end in AppTest."""

from __future__ import annotations

import importlib
import re
import time
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from lessons import catalog, load_lesson
from lessons.common import LessonContext
from lessons.exercise import Exercise, format_value
from lessons.text import fields, fill, split_body

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
SLUG = "l8_prefix_caching"
LESSON = load_lesson(ROOT / "lessons" / f"{SLUG}.md")
l8 = importlib.import_module(f"lessons.{SLUG}")


def memo():
    """A run cache like the app's (``lessons.render.memo_for``): each (function, arguments) computed once."""
    cache: dict = {}

    def run(fn, *args):
        key = (getattr(fn, "key", None) or f"{fn.__module__}.{fn.__qualname__}", args)
        if key not in cache:
            cache[key] = fn(*args)
        return cache[key]
    return run


@pytest.fixture(scope="module")
def ctx():
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"), memo=memo())


@pytest.fixture(scope="module")
def exs(ctx) -> dict[str, Exercise]:
    return l8.exercises(ctx)


@pytest.fixture(scope="module")
def facts(ctx) -> dict:
    return l8.facts(ctx)


# ------------------------------------------------------------------------------------------ structure
def test_lesson_is_in_the_catalog_with_an_existing_playground_preset():
    from engine.scenarios.presets import SCENARIOS
    from ui.state import preset_settings

    assert any(l.slug == SLUG and l.number == 8 for l in catalog())
    assert LESSON.playground["preset"] in SCENARIOS
    settings = preset_settings(**LESSON.playground)
    assert settings.semantics == "v1" and settings.block_size == LESSON.playground["block_size"]


def test_markers_fields_widgets_and_recap_resolve(exs, facts):
    parts = split_body(LESSON.body)
    assert LESSON.exercise_ids == [v for k, v in parts if k == "exercise"]
    assert sorted(LESSON.exercise_ids) == sorted(exs), "each exercise appears in the text exactly once"
    assert len(set(LESSON.exercise_ids)) == len(LESSON.exercise_ids)
    for kind, value in parts:
        if kind == "widget":
            assert callable(getattr(l8, f"widget_{value}")), value
    assert fields(LESSON.body) <= set(facts)
    assert "{{" not in fill(LESSON.body, facts)
    for name in dir(l8):
        if name.startswith("reveal_"):
            assert name[len("reveal_"):] in exs, f"{name} reveals no exercise"
    assert 3 <= len(l8.RECAP) <= 5
    for line in l8.RECAP:
        assert fields(line) <= set(facts) and "{{" not in fill(line, facts)


def test_tags_two_transfer_and_one_allocator(exs):
    transfer = [e.id for e in exs.values() if "transfer" in e.tags]
    allocator = [e.id for e in exs.values() if "allocator" in e.tags]
    assert len(transfer) >= 2 and len(allocator) >= 1, (transfer, allocator)


def _typed(ex: Exercise) -> str:
    return ", ".join(map(str, ex.expected)) if isinstance(ex.expected, list) else str(ex.expected)


def test_every_right_answer_is_accepted_also_as_text(exs):
    for ex in exs.values():
        assert ex.check(ex.expected).correct, ex.id
        assert ex.check(_typed(ex)).correct, ex.id


def test_every_exercise_has_slips_and_each_slip_is_recognised(exs):
    for ex in exs.values():
        assert ex.slips, f"{ex.id} has no slips"
        if ex.kind == "choice":  # every wrong option says what choosing it reveals
            assert {s.answer for s in ex.slips} == set(ex.options) - {ex.expected}, ex.id
        answers = [repr(ex.parse(s.answer)) for s in ex.slips]
        assert len(set(answers)) == len(answers), f"{ex.id}: two slips give the same answer"
        for slip in ex.slips:
            verdict = ex.check(slip.answer)
            assert not verdict.correct and verdict.slip == slip.name, (ex.id, slip.name)
            assert slip.message in verdict.message and "The engine says" in verdict.message


def test_a_wrong_answer_that_is_no_slip_gets_the_plain_message(exs):
    verdict = exs["evict_table"].check([7, 7, 7, 7])
    assert not verdict.correct and verdict.slip is None and "Not quite" in verdict.message


def _needles(ex: Exercise) -> list[str]:
    """How a text that gives the answer away would write it."""
    if ex.kind == "number":
        return [format_value(ex.expected, ex.unit)] if ex.unit else [format_value(ex.expected)]
    if ex.kind in ("list", "set"):
        return ["[" + ", ".join(map(str, ex.expected)) + "]", ", ".join(map(str, ex.expected))]
    return [ex.expected]


def test_nothing_above_a_question_gives_its_answer_away(exs, facts):
    """The text up to a question, the earlier questions' explanations (shown by then) and the question itself
    never state its answer."""
    above = ""
    for kind, value in split_body(LESSON.body):
        if kind == "text":
            above += fill(value, facts)
        elif kind == "exercise":
            ex = exs[value]
            for needle in _needles(ex):
                hit = re.search(r"(?<![\w.,])" + re.escape(needle) + r"(?![\w]|[.,]\d)", above + "\n" + ex.question)
                assert hit is None, f"{ex.id}: {needle!r} is stated above it"
            above += "\n" + ex.explanation


# -------------------------------------------------------------------------- the answers, recomputed
def test_chained_hashes_recomputed_by_hand(exs):
    B = l8.BLOCK_SIZE
    a, b = l8.ids("A"), l8.ids("B")
    cached = set(l8.chain(a))
    found = 0
    for h in l8.chain(b)[: (len(b) - 1) // B]:
        if h not in cached:
            break
        found += B
    assert exs["chain_hit"].expected == found == 0  # the first block differs, so every later hash does
    # the block-alone slip is a real block of equal words after a different parent
    assert exs["chain_hit"].slips[0].answer > found


def test_last_token_rule_recomputes_the_whole_last_block(exs):
    B, c = l8.BLOCK_SIZE, l8.ids("C")
    assert len(c) % B == 0  # all full blocks: only the last-token rule keeps one out of the hit
    assert exs["last_token"].expected == len(c) - (len(c) - 1) // B * B == B


def test_duplicate_is_two_blocks_with_one_hash(exs):
    stage = l8.practice()["C"]
    last = stage.tables["C"][-1]
    holders = l8.hash_holders(stage)[stage.hashes[last]]
    assert len(holders) == 2 and last in holders
    assert exs["duplicate"].expected.startswith("both")
    assert stage.bm.invariant_violations() == []


def test_free_queue_worked_by_hand_matches_the_block_pool(exs):
    st = l8.practice()
    before, done = st["C"], st[f"{l8.FINISH_ORDER[-1]} done"]
    tables = [before.tables[r] for r in l8.FINISH_ORDER]
    by_hand = l8.queue_after_frees(before.queue, tables, before.counts, before.hashes)
    assert by_hand == done.queue
    d = exs["evict_table"].expected
    assert d == by_hand[: len(d)] == st["D"].tables["D"]
    # D evicts cached blocks (the question is about eviction, not a free pool)
    assert any(before.hashes[b] for b in d)


def test_e_finds_the_prefix_through_the_duplicate(exs):
    st = l8.practice()
    B, e = l8.BLOCK_SIZE, l8.ids("E")
    hashes_left = {h for h in st["D"].hashes if h}
    found = 0
    for h in l8.chain(e)[: (len(e) - 1) // B]:
        if h not in hashes_left:
            break
        found += B
    assert exs["evict_hit"].expected == found
    assert exs["evict_hit"].slips[0].answer < found  # A's own copy alone would have found less


def test_honest_rate_recomputed_from_the_records(ctx, exs):
    run = ctx.run(l8.tight_run)
    assert run.events("preempt"), "the tight pool must preempt someone"
    admits = run.events("admit")
    query = sum(e.data["num_tokens"] for e in admits if not e.data["readmission"])
    hits = sum(e.data["num_tokens"] for e in run.events("prefix_hit") if not e.data["readmission"])
    again = [e for e in run.events("prefix_hit") if e.data["readmission"]]
    assert again, "the re-admission finds its own blocks"
    s = l8.run_stats(run)
    assert (s["query_tokens"], s["hit_tokens"]) == (query, hits)
    assert exs["honest"].expected.startswith(l8._pct(round(100 * hits / query, 2)))
    assert s["mixed_rate_pct"] > s["hit_rate_pct"]
    # the honest figure is the one a roomy pool (no preemption) gives for the same requests
    roomy = l8.run_stats(ctx.run(l8.roomy_run, l8.TIGHT["block_size"]))
    assert roomy["readmissions"] == 0 and roomy["hit_rate_pct"] == s["hit_rate_pct"]


def test_block_size_sweep_recomputed_from_the_prompts(ctx, exs):
    prompts = [p for p, _ in l8.chat_requests(ctx.loaded[1])]
    shared, n, length = l8.common_prefix(prompts), len(prompts), len(prompts[0])
    assert all(len(p) == length for p in prompts)
    sw = l8.sweep(ctx)
    for B, v in sw.items():
        per_later = min(shared, length - 1) // B * B
        assert v["per_later"] == per_later, B
        assert v["rate"] == round(100 * (n - 1) * per_later / (n * length), 2), B
        assert v["preemptions"] == 0
    assert exs["bs_rate"].expected == sw[l8.SWEEP[-1]]["rate"]
    rates = [sw[B]["rate"] for B in l8.SWEEP]
    assert rates == sorted(rates, reverse=True) and rates[0] > rates[-1]


def test_first_visit_time(ctx):
    fresh = LessonContext(loaded=ctx.loaded, memo=memo())  # nothing cached yet: every run is made
    start = time.perf_counter()
    l8.exercises(fresh)
    l8.facts(fresh)
    assert time.perf_counter() - start < 30  # generous for a shared machine; the report gives the measured time


# ----------------------------------------------------------------------------------------------- page
def _commit(at: AppTest, ex: Exercise, answer) -> None:
    key = f"{SLUG}:{ex.id}"
    if ex.kind == "choice":
        at.radio(key=f"in-{key}").set_value(answer)
    else:
        at.text_input(key=f"in-{key}").input(answer if isinstance(answer, str) else _typed_value(answer))
    next(b for b in at.button if b.label.startswith("Commit my answer") and key in b.form_id).click().run()
    assert not at.exception, [e.value for e in at.exception]


def _typed_value(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def test_page_end_to_end_wrong_once_then_right(exs, facts):
    at = AppTest.from_file(APP, default_timeout=300)
    at.run()
    at.switch_page(f"lessons/{SLUG}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value.startswith("Lesson 8")
    n = len(exs)
    for i, ex_id in enumerate(LESSON.exercise_ids):
        ex = exs[ex_id]
        # only the current question is open
        assert len([b for b in at.button if b.label.startswith("Commit my answer")]) == 1
        slip = ex.slips[0]
        _commit(at, ex, slip.answer)
        assert any(slip.message in e.value for e in at.error), ex_id
        next(b for b in at.button if b.key == f"again-{SLUG}:{ex_id}").click().run()
        _commit(at, ex, ex.expected)
        assert any("engine agrees" in s.value for s in at.success), ex_id
        assert f"{i + 1} of {n} predictions made, {i + 1} right (0 at the first try)" in at.caption[0].value
    assert not at.error
    assert not any("to go on" in i.value for i in at.info)
    assert any(b.label == "Open this in the Playground" for b in at.button)
    labels = [p.proto.label for p in at.get("page_link")]
    assert any(l.startswith("Next:") or l == "All lessons" for l in labels), labels
    # the recap at the end: its heading and every takeaway, figures filled in
    assert any(h.value == "Recap" for h in at.subheader)
    shown = " ".join(m.value for m in at.markdown)
    for line in l8.RECAP:
        assert fill(line, facts) in shown
    assert "{{" not in shown
