"""Lessons 4-6 to the "Lessons 2.0" standard: every right answer accepted (typed too), every usual slip named
with its own message, transfer and act-as-the-allocator questions, takeaways for the recap, balanced
true/false questions, answers checked against the engine's records independently, and each page answered
end to end in AppTest (a slip first, then the right answer)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL, BlockManager
from engine.metrics import blocks_for, preemption_cost
from engine.model_loader import load_model
from lessons import catalog
from lessons.common import LessonContext
from lessons.exercise import Exercise
from lessons.text import fields, fill, split_body

APP = str(Path(__file__).resolve().parent.parent / "app.py")
SLUGS = ["l4_sharing", "l5_out_of_memory", "l6_when_paging_matters"]
LESSONS = {l.slug: l for l in catalog() if l.slug in SLUGS}


@pytest.fixture(scope="module")
def ctx():
    """The embedded model with a memo that keeps each run once for the module (as the app's run cache)."""
    kept: dict = {}

    def memo(fn, *args):
        key = (getattr(fn, "key", None) or fn.__qualname__, args)
        if key not in kept:
            kept[key] = fn(*args)
        return kept[key]
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"), memo=memo)


@pytest.fixture(scope="module")
def built(ctx):
    """slug -> (module, facts, exercises)."""
    out = {}
    for slug in SLUGS:
        mod = importlib.import_module(f"lessons.{slug}")
        out[slug] = (mod, mod.facts(ctx), mod.exercises(ctx))
    return out


def _text(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


# ------------------------------------------------------------------------------------------ structure
@pytest.mark.parametrize("slug", SLUGS)
def test_markers_match_the_exercises_and_every_field_resolves(built, slug):
    mod, facts, exs = built[slug]
    lesson = LESSONS[slug]
    assert lesson.exercise_ids and sorted(lesson.exercise_ids) == sorted(exs)
    assert len(set(lesson.exercise_ids)) == len(lesson.exercise_ids)
    assert all(ex.id == key for key, ex in exs.items())
    assert fields(lesson.body) <= set(facts) and "{{" not in fill(lesson.body, facts)
    for kind, value in split_body(lesson.body):
        if kind == "widget":
            assert callable(getattr(mod, f"widget_{value}"))
    for name in dir(mod):
        if name.startswith("reveal_"):
            assert name[len("reveal_"):] in exs, f"{name} reveals no exercise"


@pytest.mark.parametrize("slug", SLUGS)
def test_transfer_and_allocator_questions(built, slug):
    exs = built[slug][2]
    transfer = [e.id for e in exs.values() if "transfer" in e.tags]
    allocator = [e.id for e in exs.values() if "allocator" in e.tags]
    assert len(transfer) >= 2, transfer
    assert len(allocator) >= 1, allocator


@pytest.mark.parametrize("slug", SLUGS)
def test_recap_has_three_to_five_takeaways_filled_from_the_facts(built, slug):
    mod, facts, _ = built[slug]
    assert 3 <= len(mod.RECAP) <= 5
    for line in mod.RECAP:
        assert isinstance(line, str) and fields(line) <= set(facts)
        assert "{{" not in fill(line, facts)


# --------------------------------------------------------------------------------- answers and slips
@pytest.mark.parametrize("slug", SLUGS)
def test_the_right_answer_is_accepted_also_typed_as_text(built, slug):
    for ex in built[slug][2].values():
        assert ex.check(ex.expected).correct, ex.id
        assert ex.check(_text(ex.expected)).correct, f"{ex.id}: typed as text"
        if ex.unit and ex.kind == "number":
            assert ex.check(f"{_text(ex.expected)} {ex.unit}").correct, f"{ex.id}: with its unit"


@pytest.mark.parametrize("slug", SLUGS)
def test_every_slip_is_named_with_its_own_message(built, slug):
    for ex in built[slug][2].values():
        if ex.kind == "choice":  # each wrong option says what choosing it reveals
            assert sorted(s.answer for s in ex.slips) == sorted(o for o in ex.options if o != ex.expected), ex.id
        else:
            assert ex.slips, f"{ex.id}: a typed answer without usual slips"
        answers, names = [], []
        for slip in ex.slips:
            for given in (slip.answer, _text(slip.answer)):
                verdict = ex.check(given)
                assert not verdict.correct and verdict.slip == slip.name, (ex.id, slip.name, verdict)
                assert verdict.message.startswith(slip.message), (ex.id, slip.name)
            assert slip.message.strip() and len(slip.message) < 400
            answers.append(repr(ex.parse(slip.answer)))
            names.append(slip.name)
        assert len(set(answers)) == len(answers), f"{ex.id}: two slips give the same answer"
        assert len(set(names)) == len(names), f"{ex.id}: two slips share a name"


def test_true_false_questions_are_balanced_and_not_framed_as_beliefs(built):
    exs = built["l6_when_paging_matters"][2]
    tf = [e for e in exs.values() if e.kind == "choice" and set(e.options) == {"true", "false"}]
    true = sum(e.expected == "true" for e in tf)
    assert len(tf) >= 6 and len(tf) / 3 <= true <= 2 * len(tf) / 3, f"{true} of {len(tf)} true"
    assert "belief" not in LESSONS["l6_when_paging_matters"].body.lower()


def test_lesson5_does_not_state_the_victim_rule_above_the_question():
    body = LESSONS["l5_out_of_memory"].body
    above = body.split("<!-- exercise: m_victim -->")[0].lower()
    for giveaway in ("newest", "arrived last", "admitted last", "most recent", "came last"):
        assert giveaway not in above, giveaway


def test_no_answer_is_stated_above_its_question_or_in_an_earlier_reveal(built):
    """Neither the text above a question, nor the question, nor an earlier question's explanation (shown once
    that one is answered) states the answer in the form a learner would type it."""
    import re

    from lessons.exercise import format_value

    for slug in SLUGS:
        _, facts, exs = built[slug]
        above = ""
        for kind, value in split_body(LESSONS[slug].body):
            if kind == "text":
                above += fill(value, facts)
            elif kind == "exercise":
                ex = exs[value]
                seen = above + "\n" + ex.question
                above += "\n" + ex.explanation
                if ex.kind == "number" and ex.unit:
                    needle = format_value(ex.expected, ex.unit)
                elif ex.kind in ("list", "set") and len(ex.expected) >= 2:
                    needle = "[" + ", ".join(map(str, ex.expected)) + "]"
                else:
                    continue
                assert not re.search(r"(?<![\w.,])" + re.escape(needle) + r"(?![\w]|[.,]\d)", seen), (slug, ex.id)


# ------------------------------------------------------------------ the engine's answers, checked apart
def test_lesson4_answers_follow_from_the_block_manager(ctx, built):
    l4, _, ex = built["l4_sharing"]
    # variation 1: A's and B's new tokens take the first two free blocks after the fork, A's first
    bm = BlockManager(l4.NUM_BLOCKS, l4.BLOCK_SIZE)
    bm.allocate("A", l4.V1[0])
    bm.fork("A", "B")
    assert ex["v1_blocks"].expected == list(bm.free_block_queue)[:2]
    # variation 2: each copy takes one owner off the shared last block: count + copies = its owners before
    counts = ex["v2_counts"].expected
    owners = 1 + sum(op[0] == "fork" for op in l4.V2[1])
    assert counts[0] == owners and counts[1] + counts[2] == owners and counts[1] == 1
    # practice: A copies the shared block into the first free block; B then writes in place
    assert ex["p_fork"].expected == [2, 2] and ex["p_a_table"].expected == [0, 2]
    assert ex["p_a_counts"].expected == [2, 1, 1] and ex["p_b_copy"].expected.startswith("no")
    assert ex["v3_free"].expected == [2] and ex["chat_free"].expected == 0
    # parallel sampling: blocks in use after the first decode = distinct blocks in the samples' tables
    par = ctx.run(l4.parallel_run)
    snap = par.records[1].snapshot
    assert ex["ps_blocks"].expected == len({b for s in snap.sequences for b in s.block_table})
    n, prompt = len(snap.sequences), par.records[0].scheduled[0].num_tokens
    assert ex["ps_blocks"].expected == blocks_for(prompt, par.block_size) + (n - 1) * bool(prompt % par.block_size)
    # prefix caching: the hit is the full blocks the second prompt has in common with the first
    pre = ctx.run(l4.prefix_run, True)
    p1, p2 = (s.token_ids[:s.prompt_len] for s in pre.records[0].snapshot.sequences[:2])
    common = next(i for i, (a, b) in enumerate(zip(p1, p2)) if a != b)
    assert ex["sp_hit"].expected == common // pre.block_size * pre.block_size


def test_lesson5_answers_follow_from_the_records(ctx, built):
    l5, facts, ex = built["l5_out_of_memory"]
    run = ctx.run(l5.pressure_run, "recompute")
    B, pool = run.block_size, run.num_blocks
    prompts = [len(p) for p, _ in l5.requests(ctx.loaded[1])]
    # admission: requests in arrival order while their prompts' blocks fit
    used, admitted = 0, 0
    for n in prompts:
        if used + blocks_for(n, B) > pool:
            break
        used, admitted = used + blocks_for(n, B), admitted + 1
    assert ex["m_admit"].expected == admitted
    # the first step where every running request needs a new block and too few are free
    first_new = blocks_for(prompts[0], B) * B
    assert ex["m_step"].expected == first_new - prompts[0] + 2
    i, preempt = run.first("preempt")
    assert run.records[i].step == ex["m_step"].expected
    running = run.records[i - 1].snapshot.running
    assert ex["m_victim"].expected == running[-1] == preempt.request_id
    # recompute: the victim's prompt plus every token it had generated by then
    victim = preempt.request_id
    before = next(s for s in run.records[i - 1].snapshot.sequences if s.seq_id == victim)
    assert ex["m_recompute"].expected == len(before.token_ids) == before.num_tokens + 1
    # swap: the blocks it held; bytes from the model's own config
    cfg = ctx.loaded[0].config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # float32
    assert facts["kv_token_bytes"] == per_token
    assert ex["m_swap"].expected == len(before.block_table) == blocks_for(before.num_tokens, B)
    assert ex["m_bytes"].expected == pytest.approx(2 * ex["m_swap"].expected * B * per_token / 1024)
    # the other order: the answer is the first victim of that run, the newest running request then
    other = ctx.run(l5.ordered_run, tuple(reversed(run.request_ids)))
    assert other.request_ids == list(reversed(run.request_ids))
    j, e = other.first("preempt")
    if e is None:
        assert ex["m_order"].expected == l5.NOBODY
    else:
        assert ex["m_order"].expected == e.request_id == other.records[j - 1].snapshot.running[-1]
    # the swap pool too small: the preemption is by recompute
    tiny = ctx.run(l5.fallback_run)
    modes = {e.data["mode"] for e in tiny.events("preempt")}
    assert modes == {"recompute"} and ex["m_fallback"].expected == l5.FALLBACK_OPTIONS["recompute"]
    # outputs: identical in every run
    swap, roomy = ctx.run(l5.pressure_run, "swap"), ctx.run(l5.pressure_run, "roomy")
    assert all(run.outputs[r].output_token_ids == swap.outputs[r].output_token_ids
               == roomy.outputs[r].output_token_ids for r in run.request_ids)
    assert ex["m_same"].expected == l5.SAME_OPTIONS[0]


def test_lesson5_cost_table_agrees_with_the_events(ctx, built):
    l5, facts, _ = built["l5_out_of_memory"]
    per_block = ctx.run(l5.block_bytes)
    rec, swp = ctx.run(l5.pressure_run, "recompute"), ctx.run(l5.pressure_run, "swap")
    c_rec, c_swp = preemption_cost(rec.records, per_block), preemption_cost(swp.records, per_block)
    # recompute: each re-admission computes the victim's whole sequence again
    again = [e for r in rec.records for e in r.events if e.kind == "admit" and e.data["readmission"]]
    assert c_rec["recomputed_tokens"] == sum(e.data["num_tokens"] for e in again) > 0
    assert c_rec["swap_bytes"] == 0 and c_swp["recomputed_tokens"] == 0
    # swap: every block that goes out comes back
    assert c_swp["swap_out_blocks"] == c_swp["swap_in_blocks"] > 0
    assert c_swp["swap_bytes"] == 2 * c_swp["swap_out_blocks"] * per_block
    assert c_rec["recompute_s"] > 0 and c_swp["swap_s"] > 0 and c_rec["plain_decode_s"] > 0
    assert facts["recomputed"] == c_rec["recomputed_tokens"]
    rows = {r["policy"]: r for r in l5.cost_rows(ctx)}
    assert rows["recompute"]["tokens computed again"] == c_rec["recomputed_tokens"]
    assert rows["swap"]["KiB over the bus"] == round(c_swp["swap_bytes"] / 1024)


def test_lesson6_answers_follow_from_the_allocators(built):
    l6, _, ex = built["l6_when_paging_matters"]
    bm, new, free_before = l6.pool_after_frees(l6.TABLE)
    need = -(-l6.TABLE["new"] // l6.TABLE["block_size"])
    assert ex["q_table"].expected == free_before[:need] == bm.block_tables[new]
    assert ex["q_table"].expected != sorted(ex["q_table"].expected)  # scattered: the point of the question
    # waste by hand: contiguous reserves max_len each, paged rounds each length up to whole blocks
    loads = l6.workload_waste()
    M, B = l6.SHORT["max_len"], l6.SHORT["block_size"]
    saved = {}
    for key, w in loads.items():
        L = w["lengths"]
        contig = 100 * (1 - sum(L) / (len(L) * M))
        paged = 100 * (1 - sum(L) / (sum(-(-x // B) for x in L) * B))
        assert w["contig_pct"] == pytest.approx(contig) and w["paged_pct"] == pytest.approx(paged)
        saved[key] = contig - paged
    assert ex["q_workload"].expected == l6.WORKLOADS[max(saved, key=saved.get)]["label"]
    assert ex["q_cpu"].expected == "false" and ex["q_no_queue"].expected == "false"
    assert ex["q_bytes"].expected == "true" and ex["q_outputs"].expected == "true"


# ----------------------------------------------------------------------------------------------- pages
def _commit(at: AppTest, key: str, ex: Exercise, answer) -> None:
    if ex.kind == "choice":
        at.radio(key=f"in-{key}").set_value(answer)
    else:
        at.text_input(key=f"in-{key}").input(_text(answer) or "none")
    next(b for b in at.button if b.label.startswith("Commit my answer") and key in b.form_id).click().run()
    assert not at.exception, [e.value for e in at.exception]


@pytest.mark.parametrize("slug", SLUGS)
def test_the_page_answered_in_order_wrong_once_then_right(built, slug):
    """Every question in reading order: the first slip's answer (its message shown), "Try again", then the
    engine's answer; at the end every answer is right (not all at the first try) and the page goes on."""
    exs = built[slug][2]
    lesson = LESSONS[slug]
    order = lesson.exercise_ids
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page(lesson.page_path).run()
    assert not at.exception, [e.value for e in at.exception]
    for ex_id in order:
        ex, key = exs[ex_id], f"{slug}:{ex_id}"
        if ex.slips:
            slip = ex.slips[0]
            _commit(at, key, ex, slip.answer)
            assert any(slip.message in e.value for e in at.error), (ex_id, slip.name)
            next(b for b in at.button if b.key == f"again-{key}").click().run()
            assert not at.exception
        _commit(at, key, ex, ex.expected)
        assert any("engine agrees" in s.value for s in at.success), ex_id
    n = len(order)
    wrong_first = sum(bool(exs[i].slips) for i in order)
    caption = at.caption[0].value
    assert f"{n} of {n} predictions made, {n} right" in caption
    assert f"({n - wrong_first} at the first try)" in caption
    assert not any("to go on" in i.value for i in at.info)
    assert any(b.label == "Open this in the Playground" for b in at.button)
    from lessons import render
    if hasattr(render, "show_recap"):  # the recap, where the page shows one
        assert any(h.value == "Recap" for h in at.subheader)
