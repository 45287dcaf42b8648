"""On stage, what the second speaker trial found (issue 24): a presenter with a clicker at 1280x720.

2. a beam step's moment 1 (the copies) said the beam selection already, and both moments said the same
   sentences: each moment's sentences are of that moment;
3. the block tables' rows moved between a beam step's two moments and the next step (b0, b5, b7, b8 then
   b8, b7, b0, b9): a request's sequences keep their order (by id), surviving rows keep their places;
4. N at a run's end, staying on its step: "all requests finished" beside "2 running", a toast counting the
   answer as an ignored press, and the figures shrunk by the long line beside the step (the block tables
   dropped logical blocks on the same step): every number on screen is of the step shown.
"""

from __future__ import annotations

import pytest

from engine import EMBEDDED_MODEL, SamplingParams
from engine.model_loader import load_shared
from engine.scenarios.run_spec import RunSpec
from ui.lab import Lab
from ui.state import preset_settings
from viz.block_table import block_table_picture, selection_phases


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def beam_run(loaded):
    """The beam-search preset run to its end (every step recorded)."""
    lab = Lab.create(preset_settings("beam-search"), loaded)
    lab.press("end")
    return lab


# ------------------------------------------------------------------ 2. each moment says its own sentences
def test_each_moment_of_a_beam_step_says_that_moment(beam_run):
    from ui.presenter import few_sentences
    from viz.stage import stage_step

    beams = [(i, p) for i, (p, _) in enumerate(beam_run.run.history) if beam_run.phases(p) == 2]
    assert beams
    for i, record in beams:
        previous = beam_run.run.history[i - 1][0] if i else None
        copies = few_sentences(stage_step(record, None, previous, order=beam_run.run.order, phase=0))
        selection = few_sentences(stage_step(record, None, previous, order=beam_run.run.order, phase=1))
        assert not any("beam selection" in x for x in copies), copies  # moment 1: the copies and writes only
        assert selection[0].startswith("beam selection"), selection  # moment 2: the selection first
        assert copies != selection


# ---------------------------------------------------------------------- 3. rows keep their places
def _rows(snapshot, events, order):
    return [r["seq_id"] for r in block_table_picture(snapshot, events, order)["rows"]]


def _same_relative_order(a: list[str], b: list[str]) -> bool:
    return [x for x in a if x in b] == [x for x in b if x in a]


def test_block_table_rows_keep_their_places_across_moments_and_steps(beam_run):
    moments = []  # every moment on stage in order: a beam step's copies, its selection, then the next step
    history = beam_run.run.history
    for i, (record, _) in enumerate(history):
        phases = selection_phases(record, history[i - 1][0] if i else None)
        for m in phases or [{"snapshot": record.snapshot, "events": record.events}]:
            moments.append(_rows(m["snapshot"], m["events"], beam_run.run.order))
    assert len(moments) > len(history)  # beam steps were seen
    for before, after in zip(moments, moments[1:]):
        assert _same_relative_order(before, after), (before, after)


# ------------------------------------------------------------------ 4. N at the end: one true state
@pytest.fixture()
def stayed(loaded):
    """N pressed on step 2 of a request with many steps left: the rest ran to the end, step 2 still shown."""
    lab = Lab.create(RunSpec(model=EMBEDDED_MODEL, preset="custom", num_blocks=16), loaded)
    lab.add_request("ROMEO. " * 20, SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True))
    lab.step()
    lab.step()
    assert lab.press("next") == "none-left" and not lab.has_work()
    return lab


def test_the_answer_to_n_at_the_end_is_not_an_ignored_press(stayed):
    notices = stayed.protocol.notices
    assert stayed.press("next") == "ignored"  # nothing moved: N again, looking back at the finished run
    assert stayed.protocol.ignored == 0  # ... but it was answered (beside the step), not ignored
    assert stayed.protocol.notices == notices + 1 and "the run has finished" in stayed.protocol.notice


def test_all_requests_finished_is_said_of_the_step_shown_only(stayed):
    from ui.presenter import column_lines, finished_on

    history, index, has_work = stayed.frame()
    paged = history[index][0]
    assert paged.step == 2 and paged.snapshot.running and not has_work
    assert not finished_on(history, index, has_work)  # the request on screen is running
    lines = [t for _, t in column_lines(stayed, paged, None, None, history[-1][0].step,
                                        not finished_on(history, index, has_work))]
    assert not any("all requests finished" in t for t in lines) and "1 running" in " ".join(lines)
    assert finished_on(history, len(history) - 1, has_work) and finished_on(history, -1, has_work)


def test_the_line_beside_the_step_leaves_the_figures_their_size(stayed):
    """The stage's line is short: the pool row (the pool and the block tables) keeps its height at 1280x720
    with it, so the block tables show the same logical blocks of the same step."""
    from ui.presenter import column_lines, few_sentences, sized_column
    from viz.presenter import presenter_sizes
    from viz.stage import stage_step

    history, index, has_work = stayed.frame()
    paged, contiguous = history[index]
    column = column_lines(stayed, paged, contiguous, None, history[-1][0].step, True)
    assert any("Next event" in t for _, t in column)
    words = few_sentences(stage_step(paged, contiguous, history[index - 1][0] if index else None,
                                     order=stayed.run.order, phase=stayed.phase_of(paged)))
    said = presenter_sizes(720, 1280, words, sized_column(stayed, paged, column))
    stayed.protocol.next_said = None  # the same step before N answered
    column = column_lines(stayed, paged, contiguous, None, history[-1][0].step, True)
    assert not any("Next event" in t for _, t in column)
    assert presenter_sizes(720, 1280, words, sized_column(stayed, paged, column)) == said


# --------------------------------------------------------------- 6. nothing of the controls over the stage
@pytest.mark.slow
def test_the_stage_has_no_play_tooltip_and_a_one_line_toggle():
    """On stage the Play button's tooltip "(P)" covered the first sentence, and at 1280 the toggle's label
    wrapped over the frame's border: no tooltip there, the label on one line in a wider column."""
    from streamlit.testing.v1 import AppTest

    from test_app import APP

    at = AppTest.from_file(APP, default_timeout=300)
    at.query_params["present"] = "1"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.button(key="stage_play").help
    css = next(m.value for m in at.markdown if "st-key-present_toggle" in m.value)
    assert "white-space: nowrap" in css.split("st-key-present_toggle")[1].split("}")[0]
    assert at.toggle(key="present_toggle").value
    at2 = AppTest.from_file(APP, default_timeout=300)
    at2.run()
    assert "(P)" in at2.button(key="stage_play").help  # the Playground's view keeps it


# -------------------------------------------------------------- 1. no blank pictures between two steps
@pytest.mark.slow
def test_a_step_keeps_the_last_pictures_mounted_below_the_new_ones():
    """The stage's pictures went blank (white) on 3 of ~33 screenshots during Play: Streamlit hashes a chart's
    figure into its element id and the browser keys the chart by it, so every step mounted new, empty charts.
    Now each picture of a step is drawn over the previous step's, which keeps its id (the browser keeps that
    chart, drawn; measured in Chromium): after a step, every picture on top before is still on the page, with
    the same id, below the new one."""
    import json

    from streamlit.testing.v1 import AppTest

    from test_app import APP

    at = AppTest.from_file(APP, default_timeout=300)
    at.query_params["scenario"] = "batch"
    at.query_params["step"] = "3"
    at.query_params["present"] = "1"
    at.run()
    assert not at.exception, [e.value for e in at.exception]

    def charts():
        return [(c.proto.id, json.loads(c.proto.spec)["layout"]["title"]["text"]) for c in at.get("plotly_chart")]

    before = charts()
    assert len(before) == 3 and "step" not in before[0][1]  # the pool, the block tables, the strip
    at.button(key="stage_step").click().run()
    assert not at.exception, [e.value for e in at.exception]
    after = charts()
    assert len(after) == 6
    assert set(before) <= set(after)  # the last step's pictures, same ids: kept drawn below the new ones
    on_top = after[0::2]
    assert not set(on_top) & set(before)  # the new step's on top (first), its figures changed
    at.run()  # a rerun with nothing new (Play's timer, the window's size): the same ids, nothing mounts
    assert charts() == after
