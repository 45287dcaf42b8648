"""Lessons 1-3 to the "Lessons 2.0" standard: every answer and every usual slip checked, transfer and
allocator questions counted, no answer given away above its question, the expected answers recomputed
independently of the lesson modules, the kernel figures of lesson 3 equal to the benchmark's JSON, and each
page answered end to end in Streamlit's AppTest (a slip first, then the right answer)."""

from __future__ import annotations

import importlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from engine.scenarios.presets import LESSON_LENGTHS
from lessons import catalog
from lessons.common import LessonContext
from lessons.exercise import TAGS, Exercise, format_value
from lessons.text import fields, fill

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
SLUGS = ["l1_kv_cache", "l2_contiguous_waste", "l3_block_tables"]
LESSONS = {l.slug: l for l in catalog() if l.slug in SLUGS}
# formulas the text states, which must not sit in the section right above a question that plugs into them
FORMULAS = {"l1_kv_cache": ["bytes per token ="], "l2_contiguous_waste": [],
            "l3_block_tables": ["*t* // *B*", "physical block × B + offset"]}


@pytest.fixture(scope="module")
def ctx():
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"))


@pytest.fixture(scope="module")
def exs(ctx) -> dict[str, dict[str, Exercise]]:
    return {slug: module(slug).exercises(ctx) for slug in SLUGS}


@pytest.fixture(scope="module")
def facts(ctx) -> dict[str, dict]:
    return {slug: module(slug).facts(ctx) for slug in SLUGS}


def module(slug):
    return importlib.import_module(f"lessons.{slug}")


def typed(value) -> str:
    """An answer as a learner types it."""
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) if value else "none"
    return str(value)


# ------------------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("slug", SLUGS)
def test_markers_match_the_exercises_in_reading_order(exs, slug):
    assert LESSONS[slug].exercise_ids == list(exs[slug])
    for ex_id, ex in exs[slug].items():
        assert ex.id == ex_id


@pytest.mark.parametrize("slug", SLUGS)
def test_transfer_and_allocator_questions(exs, slug):
    tags = [t for ex in exs[slug].values() for t in ex.tags]
    assert tags.count("transfer") >= 2, slug
    assert tags.count("allocator") >= 1, slug
    assert set(tags) <= set(TAGS)


@pytest.mark.parametrize("slug", SLUGS)
def test_recap_is_three_to_five_sentences_with_known_figures(facts, slug):
    recap = module(slug).RECAP
    assert 3 <= len(recap) <= 5
    for line in recap:
        assert fields(line) <= set(facts[slug]), line
        text = fill(line, facts[slug])
        assert "{{" not in text and text.endswith("."), text


# --------------------------------------------------------------------------------------- the checkers
@pytest.mark.parametrize("slug", SLUGS)
def test_the_engine_answer_is_accepted_also_typed(exs, slug):
    for ex in exs[slug].values():
        assert ex.check(ex.expected).correct, ex.id
        assert ex.check(typed(ex.expected)).correct, f"{ex.id}: the answer typed as text"
        if ex.kind == "list":
            assert not ex.check(typed(list(reversed(ex.expected)))).correct or ex.expected == ex.expected[::-1]


@pytest.mark.parametrize("slug", SLUGS)
def test_every_slip_is_named_with_its_message(exs, slug):
    for ex in exs[slug].values():
        if ex.kind == "choice":
            wrong = [o for o in ex.options if o != ex.expected]
            assert sorted(s.answer for s in ex.slips) == sorted(wrong), f"{ex.id}: a slip for every wrong option"
        else:
            assert ex.slips, f"{ex.id}: a number, list or set question names its usual slips"
        names = [s.name for s in ex.slips]
        assert len(set(names)) == len(names), ex.id
        for slip in ex.slips:
            for answer in (slip.answer, typed(slip.answer)):
                verdict = ex.check(answer)
                assert not verdict.correct, (ex.id, slip.name)
                assert verdict.slip == slip.name, f"{ex.id}: {slip.name} is shadowed by {verdict.slip}"
                says = f"{ex.source[:1].upper()}{ex.source[1:]} says"  # "The engine says", or the measurement
                assert slip.message in verdict.message and says in verdict.message
            assert len(slip.message) > 20 and slip.message.rstrip().endswith((".", ")")), (ex.id, slip.name)


def test_a_slip_equal_to_the_answer_is_refused():
    from lessons.exercise import Slip

    with pytest.raises(ValueError, match="slip"):
        Exercise("x", "q", "list", [5, 4, 3], slips=[Slip("same", [5, 4, 3], "no")])


# ------------------------------------------------------------------------------------------- no leaks
def _sections_above(body: str, ex_id: str) -> tuple[str, str]:
    """(all the text above the marker of ``ex_id``, the part since the last heading)."""
    above = body[: body.index(f"<!-- exercise: {ex_id} -->")]
    return above, above[above.rfind("\n###"):] if "\n###" in above else above


@pytest.mark.parametrize("slug", SLUGS)
def test_no_text_above_a_question_gives_its_answer(exs, facts, slug):
    body = LESSONS[slug].body
    order = list(exs[slug])
    for i, (ex_id, ex) in enumerate(exs[slug].items()):
        above, section = _sections_above(body, ex_id)
        shown = fill(above, facts[slug]) + "\n" + ex.question
        shown += "\n" + "\n".join(e.explanation for e in list(exs[slug].values())[:i])  # earlier reveals
        if ex.kind in ("list", "set"):
            for form in (str(ex.expected), typed(ex.expected), format_value(ex.expected)):
                assert form not in shown, f"{ex_id}: {form} is shown above the question"
        for formula in FORMULAS[slug]:
            assert formula not in section, f"{ex_id}: the formula {formula!r} sits right above the question"
        for other in order[i + 1:]:  # nothing later is drawn before its turn
            assert f"exercise: {other}" not in above


# ------------------------------------------------------------- the answers, recomputed independently
def test_lesson1_config_figures_and_the_run(ctx, exs, facts):
    ex = exs["l1_kv_cache"]
    assert ex["llama3_kib"].expected == 2 * 32 * 8 * (4096 // 32) * 2 / 1024 == 128
    assert {s.name: s.answer for s in ex["llama3_kib"].slips} == {"query-heads": 512, "no-k-and-v": 64,
                                                                    "hidden-size": 4096, "four-bytes": 256}
    assert ex["rounding"].expected == "about twice the exact value"
    # what one step stores: every token of the run but the last one picked
    run = module("l3_block_tables").life_run(ctx.loaded)
    prompt = len(run.outputs[run.request_ids[0]].prompt_token_ids)
    new = len(run.outputs[run.request_ids[0]].output_token_ids)
    bpt = 2 * 4 * 2 * 32 * 4  # the embedded model in float32: 4 layers, 2 KV heads, head_dim 32
    assert facts["l1_kv_cache"]["tiny_bytes_per_token"] == bpt
    assert ex["run_bytes"].expected == (prompt + new - 1) * bpt
    assert [s.answer for s in ex["run_bytes"].slips][:2] == [(prompt + new) * bpt, prompt * bpt]
    # the GPU fit: the question's own numbers
    fit = (72 * 10**9 - 6_738_415_616 * 2) // 524_288 // 4096
    assert ex["h100_fit"].expected == fit
    assert {s.name: s.answer for s in ex["h100_fit"].slips} == {
        "gib": (int(80 * 2**30 * 0.9) - 6_738_415_616 * 2) // 524_288 // 4096,
        "all-memory": (80 * 10**9 - 6_738_415_616 * 2) // 524_288 // 4096,
        "no-weights": 72 * 10**9 // 524_288 // 4096,
        "one-mib": (72 * 10**9 - 6_738_415_616 * 2) // 2**20 // 4096}


def _fcfs(sizes: list[int], room: int, overtake: bool = False) -> list[int]:
    admitted, used = [], 0
    for i, size in enumerate(sizes, start=1):
        if used + size <= room:
            admitted.append(i)
            used += size
        elif not overtake:
            break
    return admitted


def test_lesson1_scheduler_question_recomputed(exs):
    l1 = module("l1_kv_cache")
    ex = exs["l1_kv_cache"]["admit_batch"]
    lengths = l1.ADMIT["lengths"]
    room = l1.ADMIT["budget_bytes"] // (2 * 32 * 8 * 128 * 2)  # Llama-3-8B: 128 KiB per token
    assert ex.expected == _fcfs(lengths, room)
    slips = {s.name: s.answer for s in ex.slips}
    assert slips["overtake"] == _fcfs(lengths, room, overtake=True)
    assert slips["query-heads"] == _fcfs(lengths, l1.ADMIT["budget_bytes"] // (2 * 32 * 32 * 128 * 2))
    assert ex.expected == [1, 2, 3]  # the situation is chosen so that each slip differs


def test_lesson2_policy_and_first_fit_recomputed(exs):
    l2 = module("l2_contiguous_waste")
    ex = exs["l2_contiguous_waste"]
    cap = l2.POLICY["capacity"]
    pow2 = [1 << (L - 1).bit_length() for L in LESSON_LENGTHS]
    assert ex["pow2_fit"].expected == len(_fcfs(pow2, cap)) == 6
    slips = {s.name: s.answer for s in ex["pow2_fit"].slips}
    assert slips == {"max-length": len(_fcfs([2048] * 8, cap)), "exact-length": len(_fcfs(LESSON_LENGTHS, cap)),
                     "overtake": len(_fcfs(pow2, cap, overtake=True))}
    # first-fit by hand: the reservations lie end to end; the finished ones leave gaps
    starts = [sum(l2.FRAG_SIZES[:i]) for i in range(len(l2.FRAG_SIZES))]
    gaps = [(starts[i], l2.FRAG_SIZES[i]) for i in range(len(starts)) if f"R{i + 1}" in l2.FIRST_FIT["finished"]]
    fit = next(s for s, n in gaps if n >= l2.FIRST_FIT["need"])
    assert ex["place_first_fit"].expected == fit == 2048 + 1280 + 2048 + 1280
    assert ex["frag_free"].expected == 2 * min(l2.FRAG_SIZES) and ex["frag_admit"].expected == "no"
    assert ex["contig_waste"].expected == 68.7 and ex["paged_waste"].expected == "under 2%"


def test_lesson3_free_list_table_recomputed(exs):
    l3 = module("l3_block_tables")
    ex = exs["l3_block_tables"]
    B, n = l3.BUSY["block_size"], l3.BUSY["tokens"]
    tables, nxt = {}, 0
    for i, tokens in enumerate(n):
        k = math.ceil(tokens / B)
        tables[f"R{i + 1}"] = list(range(nxt, nxt + k))
        nxt += k
    queue = [b for rid in l3.BUSY["freed"] for b in reversed(tables[rid])]  # the pool was full
    want = queue[: math.ceil(l3.BUSY["new"] / B)]
    assert ex["free_list_table"].expected == want == [5, 4, 3, 11, 10]
    t = l3.WHERE_T
    assert ex["where_block"].expected == want[t // B]
    assert ex["where_slot"].expected == want[t // B] * B + t % B
    assert {s.name: s.answer for s in ex["where_block"].slips} == {"logical-block": t // B,
                                                                  "counted-from-1": want[t // B - 1]}


def test_lesson3_block_size_questions_recomputed(exs):
    l3 = module("l3_block_tables")
    ex = exs["l3_block_tables"]
    pool, tokens = l3.PICK["pool_slots"], l3.PICK["tokens"]
    fit = {B: (pool // B) // math.ceil(tokens / B) for B in l3.PICK["sizes"]}
    assert fit == {8: 42, 32: 42, 128: 32}
    assert ex["trade_pick"].expected == "8 and 32 fit the same number"
    slots = math.ceil(600 / 256) * 256
    assert ex["trade_256"].expected == round(100 * (slots - 600) / slots, 1)
    assert ex["prefill_blocks"].expected == 3 and ex["last_fill"].expected == 8 and ex["fourth_block"].expected == 48


# --------------------------------------------------------------------------------- the kernel figures
def _json():
    l3 = module("l3_block_tables")
    return json.loads((ROOT / l3.KERNEL_RUN["json"]).read_text())


def test_lesson3_shows_the_benchmark_json_figures(facts, exs):
    l3 = module("l3_block_tables")
    data = _json()
    times = {r["block_size"]: r["paged_us"] for r in data["sweep"]}
    f = facts["l3_block_tables"]
    assert f["kernel_gpu"] == data["env"]["gpu"] == "NVIDIA H200"
    assert f["kernel_batch"] == data["sweep"][0]["batch"] and f["kernel_context"] == f"{data['sweep'][0]['context']:,}"
    rows = [line for line in f["kernel_table"].splitlines() if re.match(r"\| \d", line)]
    assert len(rows) == len(times)
    for line in rows:
        size, us, rel = [c.strip() for c in line.strip("|").split("|")]
        B = int(size)
        assert float(us) == round(times[B], 1)
        if B != 16:
            assert float(rel.rstrip("%")) == round(100 * (times[B] / times[16] - 1), 1)
    ratio = 100 * (times[1] / times[16] - 1)
    ex = exs["l3_block_tables"]["kernel_speed"]
    assert ex.expected == next(label for lo, hi, label in l3.KERNEL_BANDS if lo <= ratio < hi)
    assert f"{times[1]:.1f} µs" in ex.explanation and f"{times[16]:.1f} µs" in ex.explanation
    spread = [100 * (t / times[16] - 1) for B, t in times.items() if B != 16]
    assert f["kernel_spread"] == f"{min(spread):+.1f}% to {max(spread):+.1f}%"
    big = [r["graph_overhead_vs_sdpa_pct"] for r in data["decode"] if r["block_size"] == 16 and r["batch"] >= 64
           and r["context"] >= 1024]
    assert f["kernel_overhead_big"] == f"{min(big):+.1f}% to {max(big):+.1f}%"


def test_the_cited_run_is_the_one_docs_benchmarks_shows():
    """The lesson cites a run by file and date; docs/benchmarks.md's section gpu-kernels must show the same
    sweep (to its 0.1 us) and name that date, or the citation points at another run."""
    l3 = module("l3_block_tables")
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = doc[doc.index("<!-- gpu-kernels:start -->"):doc.index("<!-- gpu-kernels:end -->")]
    sweep = section[section.index("### Block-size sweep"):]
    shown = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^\| (\d+) \| ([\d.]+) \|", sweep, re.M)}
    assert shown == {r["block_size"]: round(r["paged_us"], 1) for r in _json()["sweep"]}
    assert f"section `gpu-kernels`, run of {l3.KERNEL_RUN['date']}" in doc


# ------------------------------------------------------------------------------------- the pages
def _commit(at, key: str, ex: Exercise, answer) -> None:
    if ex.kind == "choice":
        at.radio(key=f"in-{key}").set_value(answer)
    else:
        at.text_input(key=f"in-{key}").input(typed(answer))
    next(b for b in at.button if b.label.startswith("Commit my answer") and key in b.form_id).click().run()
    assert not at.exception, [e.value for e in at.exception]


@pytest.mark.parametrize("slug", SLUGS)
def test_page_answered_in_order_a_slip_then_the_right_answer(exs, facts, slug):
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    lesson = LESSONS[slug]
    at.switch_page(lesson.page_path).run()
    assert not at.exception
    n = len(exs[slug])
    for i, (ex_id, ex) in enumerate(exs[slug].items()):
        key = f"{slug}:{ex_id}"
        slip = ex.slips[0]
        _commit(at, key, ex, slip.answer)
        assert any(slip.message in e.value for e in at.error), f"{ex_id}: the slip's message is shown"
        assert f"{i + 1} of {n} predictions made, {i} right" in at.caption[0].value
        next(b for b in at.button if b.key == f"again-{key}").click().run()
        _commit(at, key, ex, ex.expected)
        assert any(f"{ex.source} agrees" in s.value for s in at.success)
    assert f"{n} of {n} predictions made, {n} right (0 at the first try)" in at.caption[0].value
    assert not at.error and not any("to go on" in i.value for i in at.info)
    nxt = catalog()[catalog().index(lesson) + 1]
    assert any(p.value == f"Next: {nxt.nav_title}" for p in at.page_link)
    # the recap at the end: the lesson's takeaways, with its figures filled in
    shown = "\n".join(m.value for m in at.markdown)
    recap = [fill(line, facts[slug]) for line in module(slug).RECAP]
    assert all(line in shown for line in recap)
