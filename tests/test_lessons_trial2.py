"""Findings of the second learner trial (issue 23 follow-up: lessons 1-5 and 8 worked through with no
context): a reveal that answered the next question, slip messages that were not true or missing, and
wording and figures that did not agree with each other."""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path

import pytest
import torch

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from lessons.common import LessonContext

ROOT = Path(__file__).resolve().parent.parent
l8 = importlib.import_module("lessons.l8_prefix_caching")


from test_lesson_8 import memo as _memo  # noqa: E402  (a run cache like the app's)


@pytest.fixture(scope="module")
def ctx():
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"), memo=_memo())


@pytest.fixture(scope="module")
def l8_exs(ctx):
    return l8.exercises(ctx)


# ------------------------------------- finding 2: lesson 8's last-token reveal answered the next question
def test_lesson8_last_token_reveal_draws_nothing_the_duplicate_question_asks(monkeypatch):
    """The duplicate question asks what the pool holds after C's prefill (which blocks carry the hash of C's
    recomputed block). The last-token reveal, shown right above it, must not draw that pool, nor name hashes
    or physical blocks; the duplicate question's own reveal draws them."""
    drawn: list = []
    monkeypatch.setattr(l8, "_pool", lambda stage, title, **kw: drawn.append(("pool", title)))
    monkeypatch.setattr(l8, "_table", lambda rows: drawn.append(("table", rows)))
    l8.reveal_last_token(None)
    c = l8.practice()["C"]
    hashes = {h for h in c.hashes if h}
    assert not [d for d in drawn if d[0] == "pool"], drawn
    for _, rows in (d for d in drawn if d[0] == "table"):
        for row in rows:
            assert not any("hash" in k or "physical" in k for k in row), row
            assert not hashes & {str(v) for v in row.values()}, row
    # what the last-token question needs is still there: which blocks were found, and what is computed
    rows = l8.last_token_rows(c)
    assert sum(r["tokens computed"] for r in rows) == c.computed
    assert [r["found in the cache?"] for r in rows].count("yes") * l8.BLOCK_SIZE == c.cached
    drawn.clear()
    l8.reveal_duplicate(None)
    assert ("pool", "after C's prefill") in drawn


# --------------------------------- finding 3: lesson 8's "block-alone" slip named the wrong block
def test_lesson8_block_alone_slip_names_the_block_that_breaks_the_chain(l8_exs):
    a, b, B = l8.ids("A"), l8.ids("B"), l8.BLOCK_SIZE
    blocks = lambda t: [tuple(t[i * B:(i + 1) * B]) for i in range((len(b) - 1) // B)]  # noqa: E731
    differ = [i for i, (x, y) in enumerate(zip(blocks(a), blocks(b))) if x != y]
    same = [i for i in range(len(blocks(b))) if i not in differ]
    ordinal = ("first", "second", "third", "fourth")
    ex = l8_exs["chain_hit"]
    slip = next(s for s in ex.slips if s.name == "block-alone")
    assert slip.answer == B * len(same)
    msg = ex.check(slip.answer).message
    assert f"B's {ordinal[differ[0]]} block differs from A's" in msg, msg
    for i in same:  # the blocks with A's words are named as such, never as the one that differs
        assert ordinal[i] in msg and f"B's {ordinal[i]} block differs" not in msg, msg
        assert f"follows a different {ordinal[i]}" not in msg, msg


# ------------------------------------------------ finding 4: usual wrong answers get a named slip
def test_lesson4_variation2_every_write_copies_is_a_named_slip():
    l4 = importlib.import_module("lessons.l4_sharing")
    ex = l4._variation_exercises()["v2_counts"]
    writers = sum(op[0] == "append" for op in l4.V2[1])
    trial = ex.expected[:2] + [writers]  # the trial's "3, 1, 3": the counts right, one copy per write
    assert trial == [3, 1, 3] and ex.expected == [3, 1, 2]
    v = ex.check("3, 1, 3")
    assert not v.correct and v.slip == "every-write-copied", v
    assert "in place" in v.message and "Not quite" not in v.message


def test_lesson8_forgetting_the_uncached_block_exception_is_a_named_slip(l8_exs):
    ex = l8_exs["evict_table"]
    assert ex.expected == [6, 2, 5, 4]  # what the trial saw; the slip below is the trial's answer
    v = ex.check("2, 5, 4, 3")
    assert not v.correct and v.slip == "partial-block-forgotten", v
    c = l8.practice()["C"]
    unhashed = [b for b in c.tables["B"] if c.hashes[b] is None]
    assert unhashed and f"block {unhashed[0]}" in v.message and "front" in v.message


# ----------------------------------------- finding 5: a freed block keeps its hash until it is reused
def test_lesson8_preemption_sentence_says_freed_blocks_keep_their_hashes():
    from lessons import catalog

    body = " ".join(next(l for l in catalog() if l.slug == "l8_prefix_caching").body.split())
    assert "hashes and all" not in body
    assert "blocks are freed, each keeping its hash until the free queue hands it out again" in body


# ------------------------------------- finding 7: the batch-invariance figures say what they are over
def test_batch_invariance_names_seeded_and_greedy_and_the_bound_follows_the_shown_figure():
    from dataclasses import replace

    from lessons import batch_invariance as bi

    m = bi.load()
    for meas in (m, replace(m, max_logit_diff=2.7656e-05), replace(m, max_logit_diff=4.449e-06)):
        f = bi.facts(meas)
        for text in (f["bi_long"], f["bi_short"]):
            assert f"{meas.requests} seeded and {meas.requests} greedy replies" in text, text
            assert "a seeded sample's logits" not in text
        shown = float(f["bi_logit"])
        assert shown >= meas.max_logit_diff  # "up to" the shown figure is true
        assert f["bi_cdf_shift"] == f"{math.expm1(2 * shown / meas.temperature):.1e}"  # redone from the page
        assert float(f["bi_cdf_shift"]) >= bi.cdf_shift_bound(meas.max_logit_diff, meas.temperature)
        assert f"e^(2d) - 1 = {f['bi_cdf_shift']}" in f["bi_long"]


def test_round_up_keeps_an_upper_bound():
    from lessons.batch_invariance import round_up

    assert round_up(2.7656e-05) == 2.8e-05 and round_up(5.5e-05) == 5.5e-05 and round_up(2.71e-05) == 2.8e-05
    assert round_up(9.96e-06) == 1.0e-05 and round_up(0.0) == 0.0


# ------------------------------------------------------------------------- finding 8: small slips
def test_lesson3_half_as_long_again_feedback_does_not_say_double(ctx):
    l3 = importlib.import_module("lessons.l3_block_tables")
    ex = l3.exercises(ctx)["kernel_speed"]
    band = l3.KERNEL_BANDS[3][2]
    assert band != ex.expected
    msg = ex.check(band).message
    assert "double" not in msg and "half as long again" in msg, msg


def test_readme_paging_cost_is_the_lessons_measurement():
    l3 = importlib.import_module("lessons.l3_block_tables")
    f = l3.kernel_facts()
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "within 1-3%" not in readme
    claim = (f"paged decode attention took {f['kernel_overhead_big']} longer than contiguous SDPA at batches "
             f"{f['kernel_big_batches']} with {f['kernel_big_context']} tokens or more")
    assert claim in readme, claim


def test_lesson1_admission_speaks_lesson1s_terms():
    l1 = importlib.import_module("lessons.l1_kv_cache")
    admitted, lines = l1.admission([700, 800, 1500, 300], 2192)
    refused = [line for line in lines if "refused" in line]
    assert admitted == [1, 2] and refused, lines
    for line in refused:
        assert "gap" not in line and "<" not in line, line
    assert "R3: refused: it needs 1,500 token slots and only 692 of the 2,192 are free" in lines


def test_answers_are_shown_as_typed_and_counted_in_the_singular():
    from lessons.exercise import Exercise, format_answer
    from lessons.recap import answer_rows

    ex = Exercise("t", "q", "list", [1, 2, 3, 5])
    assert format_answer([1, 2, 3, 5]) == "1, 2, 3, 5" and format_answer([]) == "none"
    assert ex.check("1 2 3 5").message == "Correct: the engine agrees, 1, 2, 3, 5."
    one = Exercise("n", "q", "number", 1, unit="tokens")
    assert format_answer(1.0, "tokens") == "1 token" and format_answer(2, "tokens") == "2 tokens"
    assert format_answer(1, "KiB") == "1 KiB" and format_answer(1, "%") == "1%"
    assert one.check("2").message == "Not quite: the engine says 1 token."
    rows = answer_rows("s", {"t": ex, "n": one}, ["t", "n"], {"s:t": {"raw": "1, 2, 3, 4"}, "s:n": {"raw": "1"}})
    assert [r["yours"] for r in rows] == ["1, 2, 3, 4", "1 token"] and rows[0]["engine"] == "1, 2, 3, 5"


def test_the_render_shows_the_learners_answer_with_format_answer():
    src = (ROOT / "lessons" / "render.py").read_text(encoding="utf-8")
    assert 'shown = format_answer(ex.parse(entry["raw"]), ex.unit)' in src


def test_recap_question_text_drops_single_asterisk_emphasis(ctx):
    from lessons.recap import plain

    assert plain("At step 3 *R3 needs 1 free block, 0 are free*: which? 2 * 3") == \
        "At step 3 R3 needs 1 free block, 0 are free: which? 2 * 3"
    l5 = importlib.import_module("lessons.l5_out_of_memory")
    for ex in l5.exercises(ctx).values():
        assert not re.search(r"(?<![\w*])\*\S", plain(ex.question)), plain(ex.question)


# ----------------------- finding 6: lesson 2's strips: no request in a waste colour, the free gaps explained
def _rgb_distance(a: str, b: str) -> float:
    return sum((int(a[i:i + 2], 16) - int(b[i:i + 2], 16)) ** 2 for i in (1, 3, 5)) ** 0.5


@pytest.mark.parametrize("reveal", ["reveal_place_first_fit", "reveal_frag_admit"])
def test_lesson2_region_pictures_draw_no_request_in_a_waste_colour_and_explain_the_free_gaps(monkeypatch, reveal):
    import streamlit as st

    import viz
    from viz.colors import EXTERNAL, INTERNAL, request_color

    l2 = importlib.import_module("lessons.l2_contiguous_waste")
    drawn, captions = [], []
    monkeypatch.setattr(viz, "contiguous_region_figure", lambda layout, order, *a: drawn.append((layout, order)))
    monkeypatch.setattr(st, "plotly_chart", lambda *a, **k: None)
    monkeypatch.setattr(st, "caption", lambda text, **k: captions.append(text))
    getattr(l2, reveal)(None)
    (layout, order), = drawn
    for r in layout["regions"]:
        colour = request_color(r["seq_id"], order)
        assert min(_rgb_distance(colour, w) for w in (INTERNAL, EXTERNAL)) >= 100, (r["seq_id"], colour)
    caption = " ".join(captions)
    gaps = [g["length"] for g in layout["gaps"]]
    assert all(f"{g:,}" in caption for g in gaps), caption
    if layout["external_frag_slots"]:
        assert "Orange" in caption and "external fragmentation" in caption
    else:  # the trial's case: pale gaps while the legend says 0 external fragmentation
        assert gaps and "0 external fragmentation" in caption and "would not fit even if the gaps were joined" in caption


def test_lesson2_waste_widget_colours_keep_clear_of_the_waste_colours():
    from viz.colors import EXTERNAL, INTERNAL, RESERVED, request_color

    l2 = importlib.import_module("lessons.l2_contiguous_waste")
    ids = [f"R{i}" for i in range(1, 9)]  # the reference run's eight requests
    order = l2.picture_order(ids)
    colours = [request_color(r, order) for r in ids]
    assert len(set(colours)) == len(ids)
    for rid, c in zip(ids, colours):
        assert min(_rgb_distance(c, w) for w in (INTERNAL, EXTERNAL, RESERVED)) >= 100, (rid, c)
    assert len(l2.picture_order([f"R{i}" for i in range(1, 65)])) < 64 + 48  # no endless skipping


# ------------------------------------------------------------- finding 9: display at 1280 x 800
def test_lesson1_step_table_shows_every_row_and_bytes_with_separators(ctx, monkeypatch):
    import streamlit as st

    l1 = importlib.import_module("lessons.l1_kv_cache")
    rows = l1.run_bytes_rows(ctx)
    assert len(rows) >= 12
    g = l1._tiny(ctx)
    for r in rows:
        assert r["bytes of KV"] == f"{r['tokens stored so far'] * g.bytes_per_token:,}"
    assert any("," in r["bytes of KV"] for r in rows)
    heights = []
    monkeypatch.setattr(st, "dataframe", lambda df, **k: heights.append(k.get("height")))
    monkeypatch.setattr(st, "caption", lambda *a, **k: None)
    l1.reveal_run_bytes(ctx)
    assert heights and heights[0] is not None and heights[0] >= 35 * (len(rows) + 1), heights


def test_lesson5_cost_table_is_three_columns_with_every_figure(ctx):
    l5 = importlib.import_module("lessons.l5_out_of_memory")
    rows = l5.cost_rows(ctx)
    table = l5.cost_table(rows)
    assert all(len(r) == 1 + len(rows) for r in table)  # a label column and one per policy
    for r in rows:
        for key, value in r.items():
            if key == "policy":
                continue
            line = next(t for t in table if t[""] == key)
            assert line[r["policy"]] == (f"{value:,}" if isinstance(value, int) else str(value))
