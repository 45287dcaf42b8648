"""Lessons: structure, checkers, the figures the lessons state (LESSON_BRIEF), and the pages in AppTest."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from engine.scenarios.presets import LESSON_LENGTHS
from lessons import catalog, kv_math, parse_front_matter
from lessons.common import LessonContext
from lessons.exercise import Exercise, format_value, parse_int_list
from lessons.text import MARKER, fields, fill, split_body

APP = str(Path(__file__).resolve().parent.parent / "app.py")
LESSONS = catalog()


@pytest.fixture(scope="module")
def ctx():
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"))


def module(slug):
    return importlib.import_module(f"lessons.{slug}")


def exercises(ctx, slug) -> dict[str, Exercise]:
    return module(slug).exercises(ctx)


# ------------------------------------------------------------------------------------------ structure
def test_catalog_numbers_every_lesson_in_order():
    """The catalog is every ``l<n>_<name>.md`` under lessons/, numbered 1 to its length with no gap (the count
    is the catalog's: no test or doc writes it)."""
    files = sorted(Path(APP).parent.joinpath("lessons").glob("l*_*.md"))
    assert len(LESSONS) == len(files) >= 1
    assert [l.number for l in LESSONS] == list(range(1, len(LESSONS) + 1))
    assert len({l.url_path for l in LESSONS}) == len(LESSONS)
    for lesson in LESSONS:
        assert Path(APP).parent.joinpath(lesson.page_path).is_file()


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_every_marker_and_field_resolves(ctx, lesson):
    mod = module(lesson.slug)
    exs = mod.exercises(ctx)
    parts = split_body(lesson.body)
    used = [v for k, v in parts if k == "exercise"]
    assert sorted(used) == sorted(exs), "each exercise appears in the text exactly once"
    for kind, value in parts:
        if kind == "widget":
            assert callable(getattr(mod, f"widget_{value}"))
    facts = mod.facts(ctx)
    assert fields(lesson.body) <= set(facts)
    assert "{{" not in fill(lesson.body, facts)
    for name in dir(mod):
        if name.startswith("reveal_"):
            assert name[len("reveal_"):] in exs, f"{name} reveals no exercise"


def _wrong(ex: Exercise):
    if ex.kind == "number":
        step = max(10, 2 * ex.tolerance, abs(ex.expected) * (ex.rel_tolerance * 2 + 0.5))
        wrong = ex.expected - step if ex.unit == "%" and ex.expected + step > 100 else ex.expected + step
        return round(wrong) if isinstance(ex.expected, int) else wrong
    if ex.kind == "choice":
        return next(o for o in ex.options if o != ex.expected)
    return list(ex.expected) + [99 if ex.pool_blocks is None else ex.pool_blocks - 1]  # a block of the pool


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_each_checker_accepts_the_engine_answer_and_rejects_a_wrong_one(ctx, lesson):
    for ex in exercises(ctx, lesson.slug).values():
        assert ex.check(ex.expected).correct, ex.id
        text = ", ".join(map(str, ex.expected)) if isinstance(ex.expected, list) else str(ex.expected)
        assert ex.check(text).correct, f"{ex.id}: the answer typed as text"
        verdict = ex.check(_wrong(ex))
        # The verdict names who gave the answer: the engine, or the measurement the exercise quotes.
        assert not verdict.correct and f"{ex.source} says".lower() in verdict.message.lower(), (ex.id, verdict.message)


def test_answer_parsing_and_errors():
    assert parse_int_list("[0, 2]") == [0, 2] == parse_int_list("0 2") == parse_int_list((0, 2))
    assert parse_int_list("none") == []
    with pytest.raises(ValueError, match="'x'"):
        parse_int_list("1, x")
    number = Exercise("n", "q", "number", 512.0, unit="KiB")
    assert number.check("512").correct and number.check("512 KiB").correct and number.check(" 512.0 ").correct
    assert Exercise("big", "q", "number", 5126).check("5,126").correct  # thousands separators
    assert Exercise("pct", "q", "number", 68.7, unit="%").check("68.7%").correct
    for bad in ("lots", "1,2,,3", "5,12", "nan", "inf", "1e400", "2x", "--3", "68.7%"):
        with pytest.raises(ValueError, match="not a"):
            number.check(bad)
    with pytest.raises(ValueError, match="negative"):
        number.check("-5")
    with pytest.raises(ValueError, match="whole"):
        Exercise("w", "q", "number", 38, unit="blocks").check("2.5 blocks")
    with pytest.raises(ValueError, match="empty item"):
        parse_int_list("1,2,,3")
    with pytest.raises(ValueError, match="kind"):
        Exercise("k", "q", "essay", 1)
    with pytest.raises(ValueError, match="not among the options"):
        Exercise("c", "q", "choice", "maybe", options=["yes", "no"])
    s = Exercise("s", "q", "set", [2, 5])
    assert s.check("5, 2").correct and not s.check("2, 5, 5").correct and not s.check("2").correct
    tol = Exercise("t", "q", "number", 27, rel_tolerance=0.1)
    assert tol.check(29).correct and not tol.check(31).correct


def test_front_matter_errors_name_the_file():
    with pytest.raises(ValueError, match="x.md"):
        parse_front_matter("no header", "x.md")
    with pytest.raises(ValueError, match="not closed"):
        parse_front_matter("---\ntitle: a\n", "y.md")
    assert MARKER.search("<!-- exercise: a_b -->")


# ---------------------------------------------------------------------------- the figures the lessons state
def test_lesson1_bytes_per_token_from_the_configs(ctx):
    presets = kv_math.model_presets()
    kib = {k: kv_math.bytes_per_token(p.config, p.dtype) / 1024 for k, p in presets.items()}
    assert kib["llama-2-7b"] == 512 and kib["llama-3-8b"] == 128
    assert kib["qwen2.5-7b"] == 56 and kib["smollm2-135m"] == 22.5
    assert kv_math.parameter_count(presets["llama-2-7b"]) == 6_738_415_616  # the published 6.74B
    assert all(p.source.startswith("https://huggingface.co/") for p in presets.values())
    ex = exercises(ctx, "l1_kv_cache")
    assert ex["llama3_kib"].expected == 128
    assert ex["rounding"].expected == "about twice the exact value"
    fit = kv_math.gpu_fit(80 * 10**9, 6_738_415_616 * 2, 524_288, 4096)
    assert ex["h100_fit"].expected == fit.requests == (72 * 10**9 - 13_476_831_232) // 524_288 // 4096
    assert {g.memory_gb for g in kv_math.gpus()} == {80, 141, 40, 24}
    with pytest.raises(ValueError, match="utilization"):
        kv_math.gpu_fit(10, 1, 1, 1, utilization=1.5)


def test_lesson2_reproduces_the_reference_run(ctx):
    l2 = module("l2_contiguous_waste")
    assert l2.draw_lengths(7, 8) == LESSON_LENGTHS
    run = l2.reference_run()
    assert (run.reserved, run.used, round(run.contig_pct, 1)) == (16_384, 5_126, 68.7)
    assert (run.paged_blocks, run.paged_slots, round(run.paged_pct, 1)) == (325, 5_200, 1.4)
    facts = l2.facts(ctx)
    assert facts["contig_pct"] == "68.7%" and facts["paged_pct"] == "1.4%"
    # the three kinds of waste are told apart while requests still run
    mid = l2.waste_run(LESSON_LENGTHS, 2048, 16, progress=300)
    assert mid.not_yet_used == sum(min(L, 2048) - min(L, 300) for L in LESSON_LENGTHS)
    assert mid.internal == 8 * 2048 - sum(LESSON_LENGTHS)
    assert mid.used + mid.not_yet_used + mid.internal == mid.reserved
    ex = exercises(ctx, "l2_contiguous_waste")
    assert ex["frag_admit"].expected == "no" and ex["frag_free"].expected == 2 * 1280
    with pytest.raises(ValueError, match="3000"):
        l2.waste_run([3000], 2048, 16)


def test_lesson3_block_figures(ctx):
    ex = exercises(ctx, "l3_block_tables")
    assert ex["prefill_blocks"].expected == 3 and ex["last_fill"].expected == 8
    assert ex["fourth_block"].expected == 48
    assert ex["trade_256"].expected == 21.9  # % of a 600-token request's slots left empty at B = 256
    rows = {r["block size"]: r for r in module("l3_block_tables").tradeoff(600, 512 * 1024)}
    assert [(rows[b]["blocks"], rows[b]["empty slots"]) for b in (1, 16, 64, 256)] == [(600, 0), (38, 8), (10, 40),
                                                                                      (3, 168)]
    assert rows[16]["empty bytes"] == "4 MiB" and rows[256]["empty bytes"] == "84 MiB"
    assert round(rows[256]["empty %"]) == 22
    l3 = module("l3_block_tables")
    bm, new = l3.busy_pool()
    table = bm.block_tables[new]
    assert ex["where_block"].expected == table[l3.WHERE_T // 16]
    assert ex["where_slot"].expected == table[l3.WHERE_T // 16] * 16 + l3.WHERE_T % 16


def test_lesson4_practice_tables_and_counts(ctx):
    l4 = module("l4_sharing")
    main = l4.practice(*l4.MAIN)
    assert main[1].tables == {"A": [0, 1], "B": [0, 1]} and main[1].counts[:2] == [2, 2]
    assert main[2].tables == {"A": [0, 2], "B": [0, 1]} and main[2].counts[:3] == [2, 1, 1]
    assert main[3].tables == main[2].tables and main[3].counts == main[2].counts  # B wrote in place
    assert main[3].bm.num_used_blocks == 3
    ex = exercises(ctx, "l4_sharing")
    assert ex["p_a_table"].expected == [0, 2] and ex["p_a_counts"].expected == [2, 1, 1]
    assert ex["p_b_copy"].expected.startswith("no")
    assert ex["v1_blocks"].expected == [2, 3] and not any(e.kind == "cow" for s in l4.practice(*l4.V1) for e in s.events)
    assert ex["v2_counts"].expected == [3, 1, 2]  # counts of blocks 0 and 1, then the copies
    assert sum(e.kind == "cow" for s in l4.practice(*l4.V2) for e in s.events) == 2
    assert ex["v3_free"].expected == [2]
    chat = l4.chat_example()
    assert len(chat["shared"]) == 100 and chat["freed_shared"] == [] and (chat["count_before"],
                                                                          chat["count_after"]) == (50, 49)
    assert l4.serving_example() == {"shared": 31, "partial": 32} and l4.ordinal(32) == "32nd"
    assert ex["ps_blocks"].expected == 2 + 3  # 2 prompt blocks + 3 copies (n=4: the last sample writes in place)


def test_lesson5_and_6_answers_come_from_runs(ctx):
    ex = exercises(ctx, "l5_out_of_memory")
    assert ex["m_admit"].expected == 4 and ex["m_victim"].expected == "R4"
    assert ex["m_same"].expected == "yes, token for token"
    q = exercises(ctx, "l6_when_paging_matters")
    assert [q[k].expected for k in ("q_bytes", "q_outputs", "q_cpu", "q_no_queue", "q_chunked", "q_short",
                                    "q_batch1")] == ["true", "true", "false", "false", "false", "true", "true"]


# ----------------------------------------------------------------------------------------------- pages
def new_app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    assert not at.exception
    return at


@pytest.mark.parametrize("page", ["ui/lessons.py"] + [l.page_path for l in LESSONS])
def test_every_lesson_page_runs(page):
    at = new_app()
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title
    assert not at.error


def answered_app(slug: str, ctx) -> AppTest:
    """The app with every exercise of lesson ``slug`` already answered right (all gates open)."""
    at = new_app()
    at.session_state["lesson_progress"] = {f"{slug}:{i}": {"raw": ex.expected, "correct": True}
                                           for i, ex in exercises(ctx, slug).items()}
    return at


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_every_lesson_page_runs_to_the_end_once_answered(ctx, lesson):
    at = answered_app(lesson.slug, ctx)
    at.switch_page(lesson.page_path).run()
    assert not at.exception, [e.value for e in at.exception]
    n = len(exercises(ctx, lesson.slug))
    assert f"{n} of {n} predictions made, {n} right" in at.caption[0].value
    assert len(at.success) == n and not at.error  # every reveal is shown
    assert not any("to go on" in i.value for i in at.info)  # no gate left closed
    assert any(b.label == "Open this in the Playground" for b in at.button)


def test_one_question_at_a_time_hides_what_would_give_the_answer_away(ctx):
    at = new_app()
    at.switch_page("lessons/l2_contiguous_waste.py").run()
    assert not at.metric and any("to go on" in i.value for i in at.info)
    assert len([b for b in at.button if b.label.startswith("Commit my answer")]) == 1  # only the first question
    _commit(at, "l2_contiguous_waste:contig_waste", "70")
    assert len([b for b in at.button if b.label.startswith("Commit my answer")]) == 1  # now the second one
    assert not at.metric
    next(b for b in at.button if b.label == "Show the whole lesson without predicting").click().run()
    assert {m.label for m in at.metric} >= {"contiguous: empty", "paged: empty"}
    assert len([b for b in at.button if b.label.startswith("Commit my answer")]) == 5  # all open questions


def _commit(at, key, answer):
    at.text_input(key=f"in-{key}").input(answer)
    next(b for b in at.button if b.label.startswith("Commit my answer") and key in b.form_id).click().run()
    assert not at.exception


def test_predict_then_reveal_and_progress():
    at = new_app()
    at.switch_page("lessons/l3_block_tables.py").run()
    assert "0 of 9 predictions made" in at.caption[0].value
    _commit(at, "l3_block_tables:prefill_blocks", "3")
    assert any("You said **3 blocks**" in s.value and "engine agrees" in s.value for s in at.success)
    assert "1 of 9 predictions made, 1 right" in at.caption[0].value
    _commit(at, "l3_block_tables:last_fill", "12")
    assert any("Not quite" in e.value and "engine says 8 tokens" in e.value for e in at.error)
    assert "2 of 9 predictions made, 1 right" in at.caption[0].value
    _commit(at, "l3_block_tables:fourth_block", "forty")
    assert any("'forty'" in e.value for e in at.error)
    assert "2 of 9 predictions made" in at.caption[0].value  # an unreadable answer is not counted
    next(b for b in at.button if b.key == "again-l3_block_tables:last_fill").click().run()
    assert "1 of 9 predictions made" in at.caption[0].value
    _commit(at, "l3_block_tables:last_fill", "8")  # right at the second try
    assert "2 of 9 predictions made, 2 right (1 at the first try)" in at.caption[0].value
    at.switch_page("ui/lessons.py").run()
    assert any("2/9, 2 right (1 at the first try)" in p.proto.text for p in at.get("progress"))


def test_lesson2_widget_reports_bad_lengths_and_keeps_running(ctx):
    at = answered_app("l2_contiguous_waste", ctx)
    at.switch_page("lessons/l2_contiguous_waste.py").run()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["contiguous: empty"] == "68.7%" and metrics["paged: empty"] == "1.4%"
    # the widget's key shows the strips' own colours: purple reserved (not the paged side's slack grey)
    from viz.colors import INTERNAL, RESERVED, SLACK

    key = next(m.value for m in at.markdown if "reserved, not yet used" in m.value)
    assert f'color:{RESERVED}">■</span> reserved, not yet used' in key
    assert f'color:{INTERNAL}">■</span> internal fragmentation' in key
    assert f'Paged: <span style="color:{SLACK}">■</span> light grey' in key
    at.text_input(key="keep_l2_lengths").input("100, x").run()
    assert not at.exception and any("'x'" in e.value for e in at.error)
    at.text_input(key="keep_l2_lengths").input("100, 5000").run()
    assert any("5000" in e.value for e in at.error)
    at.number_input(key="keep_l2_seed").set_value(8).run()  # a new seed draws new lengths
    assert at.text_input(key="keep_l2_lengths").value != ", ".join(map(str, LESSON_LENGTHS))
    assert not at.exception


def test_open_in_playground_loads_the_lesson_preset():
    at = new_app()
    at.switch_page("lessons/l5_out_of_memory.py").run()
    next(b for b in at.button if b.label == "Open this in the Playground").click().run()
    assert not at.exception
    lab = at.session_state["lab"]
    assert lab.run.settings.preset == "memory-pressure" and lab.run.paged.num_blocks == 10
    assert at.title[0].value == "Playground"
    at.switch_page("ui/playground.py").run()  # AppTest keeps its own page for later runs; follow the switch
    next(b for b in at.button if b.label == "Step").click().run()
    assert not at.exception
    # the lesson's first question, seen in the Playground: four admitted, the long prompt waits
    assert len(lab.run.history[0][0].snapshot.running) == 4 and lab.run.history[0][0].snapshot.waiting == ["R5"]


def test_try_again_forgets_the_answers_after_it_and_forget_locks_everything(ctx):
    at = answered_app("l1_kv_cache", ctx)
    at.switch_page("lessons/l1_kv_cache.py").run()
    assert any(s.label == "Model config" for s in at.selectbox)  # the calculator, after the last question
    next(b for b in at.button if b.key == "again-l1_kv_cache:rounding").click().run()
    # the later answers are forgotten too (their explanations would give this one away) and the page stops here
    assert "1 of 5 predictions made" in at.caption[0].value
    assert not any(s.label == "Model config" for s in at.selectbox)
    assert len([b for b in at.button if b.label.startswith("Commit my answer")]) == 1
    at.switch_page("ui/lessons.py").run()
    next(b for b in at.button if b.label == "Forget my answers").click().run()
    at.switch_page("lessons/l1_kv_cache.py").run()
    assert "0 of 5 predictions made" in at.caption[0].value


def test_lesson_scenarios_are_the_playground_presets(ctx):
    l3, l5 = module("l3_block_tables"), module("l5_out_of_memory")
    life = l3.life_run(ctx.loaded)
    assert life.records[0].scheduled[0].num_tokens == 40 and life.block_size == 16 and life.num_blocks == 8
    for lesson, preset in ((LESSONS[2], "life-of-a-request"), (LESSONS[4], "memory-pressure")):
        assert lesson.playground["preset"] == preset
    tight = l5.pressure_run(ctx.loaded, "recompute")
    assert tight.num_blocks == 10 and len(tight.request_ids) == 5


def test_explore_widgets_keep_their_values_across_pages(ctx):
    at = answered_app("l1_kv_cache", ctx)
    at.switch_page("lessons/l1_kv_cache.py").run()
    at.selectbox(key="keep_l1_model").select("Qwen2.5-7B").run()
    at.number_input(key="keep_l1_batch").set_value(7).run()
    at.switch_page("ui/model_info.py").run()
    at.switch_page("lessons/l1_kv_cache.py").run()
    assert at.selectbox(key="keep_l1_model").value == "Qwen2.5-7B" and at.number_input(key="keep_l1_batch").value == 7
    assert not at.exception


def test_presenters_see_the_engine_answers_in_whole_lesson_mode():
    at = new_app()
    at.switch_page("lessons/l2_contiguous_waste.py").run()
    next(b for b in at.button if b.label == "Show the whole lesson without predicting").click().run()
    assert not at.exception
    assert len([e for e in at.expander if e.label.startswith("The engine's answer")]) == 6  # one per question
    assert "0 of 6 predictions made" in at.caption[0].value  # showing answers is not answering


def test_first_tries_count_only_answered_questions():
    at = new_app()
    at.switch_page("lessons/l3_block_tables.py").run()
    _commit(at, "l3_block_tables:prefill_blocks", "3")
    _commit(at, "l3_block_tables:last_fill", "8")
    next(b for b in at.button if b.key == "again-l3_block_tables:prefill_blocks").click().run()
    assert "0 of 9 predictions made, 0 right" in at.caption[0].value
    assert "first try" not in at.caption[0].value
    assert Exercise("s", "q", "set", [1]).parse("none") == [] and format_value([], "") == "none"
