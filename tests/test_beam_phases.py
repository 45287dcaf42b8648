"""A beam-search step in two phases (issue 23, item 17): the words and the picture show the same moment.

``viz.block_table.selection_phases`` rebuilds the moment of the copies (each live beam on its own table, before
beam selection) from the step's snapshot and events; here it is checked against the real block manager just
before ``Scheduler._beam_continue`` runs (wrapped, its behaviour unchanged), on every beam step of the
"beam-search" preset. Then the presenter's key step: every block the key sentence names is drawn in the phase
the sentence describes, and the beam-selection sentence's blocks in the selection's phase."""

from __future__ import annotations

import re

import pytest

from engine import EngineConfig, LLMEngine
from engine.scenarios.presets import SCENARIOS
from engine.scenarios.workloads import run_workload
from viz.block_table import block_table_figure, block_table_picture, selection_events, selection_phases


@pytest.fixture(scope="module")
def beam_run(model_path):
    """(records, {step: the block manager's state when ``_beam_continue`` was called}) of the preset."""
    import torch

    from engine.model_loader import load_model

    loaded = load_model(model_path, torch.device("cpu"), "float32")
    sc = SCENARIOS["beam-search"]
    engine = LLMEngine(EngineConfig(device="cpu", semantics="paper", **sc.engine_defaults), loaded=loaded)
    tokenize = lambda t: engine.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    seen: dict[int, dict] = {}
    real = engine.scheduler._beam_continue

    def spy(req, live, cands, out):
        bm = engine.block_manager
        state = seen.setdefault(engine.step_count, {"tables": {}, "tokens": {}, "pool": None})
        if state["pool"] is None:  # the first selection of the step: the state every later one is undone to
            state["pool"] = bm.pool_fields()
        for s in live:
            table, n = bm.table_of(s.seq_id)
            state["tables"][s.seq_id] = (list(table), n)
            state["tokens"][s.seq_id] = list(s.token_ids)
        return real(req, live, cands, out)

    engine.scheduler._beam_continue = spy
    records = []
    run_workload(engine, sc.make(0, tokenize), on_step=records.append)
    return records, seen


def test_copies_phase_is_the_block_managers_state_before_beam_selection(beam_run):
    records, seen = beam_run
    checked = 0
    for i, record in enumerate(records):
        phases = selection_phases(record, records[i - 1] if i else None)
        forks, pruned = selection_events(record.events, record.snapshot)
        if record.step not in seen or not pruned:
            assert not pruned and not phases, record.step
            continue
        state = seen[record.step]
        copies = phases[0]["snapshot"]
        assert [p["phase"] for p in phases] == ["copies", "beam selection"]
        assert phases[1]["snapshot"] is record.snapshot
        tables = {s.seq_id: (list(s.block_table), s.num_tokens) for s in copies.sequences
                  if s.request_id == "R1"}
        assert tables == state["tables"], record.step
        assert {s.seq_id: list(s.token_ids) for s in copies.sequences} == state["tokens"], record.step
        pool = state["pool"]
        assert copies.ref_counts == pool["ref_counts"], record.step
        assert copies.fills == pool["fills"], record.step
        assert [sorted(o) for o in copies.owners] == [sorted(o) for o in pool["owners"]], record.step
        assert copies.num_free_blocks == pool["num_free_blocks"], record.step
        checked += 1
    assert checked >= 2  # the preset selects beams on several steps


def key_step(records):
    """The presenter's key step of the preset (the first copy-on-write) and the record before it."""
    i = next(i for i, r in enumerate(records) if any(e.kind == "cow" for e in r.events))
    return records[i], records[i - 1]


def drawn_blocks(fig) -> set[int]:
    """Physical blocks the visible arrows of ``fig`` point at (a phase's traces hidden are skipped)."""
    out = set()
    for t in fig.data:
        if (t.meta or {}).get("role") == "arrows" and t.visible is not False:
            out.update(c[2] for c in t.customdata if c is not None)
    return out


def test_key_sentence_and_picture_show_the_same_moment(beam_run):
    from ui.presenter import few_sentences, projector_tables
    from viz.stage import stage_step

    records, _ = beam_run
    record, previous = key_step(records)
    # what the presenter view (``ui.presenter.views``) says and draws: the step in the phase it opens on (0,
    # the copies), then in its selection's phase (1)
    opening = stage_step(record, None, previous, order=["R1"], phase=0)
    said = few_sentences(opening)
    assert said[0].startswith("copy-on-write"), said
    named = {int(b) for pair in re.findall(r"(\d+)->(\d+)", said[0]) for b in pair}
    assert named, said[0]
    # the picture the presenter draws for this step, in the phase it opens on (the key sentence's)
    fig = projector_tables(opening, {"font": 18, "pool": 291}, 600)
    assert named <= drawn_blocks(fig), (said[0], sorted(drawn_blocks(fig)))
    # the beam selection is said, and the blocks it names are in its own phase's picture
    said = few_sentences(stage_step(record, None, previous, order=["R1"], phase=1))
    selection = next(s for s in said if s.startswith("beam selection"))
    phases = selection_phases(record, previous)
    after = block_table_picture(phases[1]["snapshot"], phases[1]["events"], ["R1"])
    kept = {a["physical"] for a in after["arrows"]}
    m = re.search(r"forked from R1\.b\d+ on blocks \[([\d, ]+)\]", selection)
    assert m and {int(b) for b in m.group(1).split(",")} <= kept, selection
    m = re.search(r"pruned, blocks \[([\d, ]+)\] freed", selection)
    freed = {int(b) for b in m.group(1).split(",")}
    assert freed and not freed & kept and all(phases[1]["snapshot"].ref_counts[b] == 0 for b in freed), selection
    before = block_table_picture(phases[0]["snapshot"], phases[0]["events"], ["R1"])
    assert freed <= {a["physical"] for a in before["arrows"]}, selection


def test_a_step_without_selection_has_no_phases(beam_run):
    records, _ = beam_run
    assert selection_phases(records[0]) == []  # the prefill
    fig = block_table_figure(records[0])
    assert all(t.visible is not False for t in fig.data)


def test_phases_figure_opens_on_the_copies_with_a_labelled_button_per_phase(beam_run):
    from viz.presenter import phased, phases_figure

    records, _ = beam_run
    record, previous = key_step(records)
    fig = phased(record, previous, lambda s, ev: block_table_figure(s, ["R1"], events=ev, font_px=18), font=18)
    menu = fig.layout.updatemenus[0]
    assert [b.label for b in menu.buttons] == ["1 copies", "2 selection"] and menu.active == 0
    assert menu.font.size >= 18
    copies = selection_phases(record, previous)[0]
    shown = drawn_blocks(fig)
    assert shown == {a["physical"] for a in block_table_picture(copies["snapshot"], copies["events"], ["R1"])["arrows"]}
    # the second button shows the selection's traces only
    second = menu.buttons[1].args[0]["visible"]
    assert len(second) == len(fig.data) and any(second) and not any(v and t.visible for v, t in zip(second, fig.data))
    with pytest.raises(ValueError, match="none"):
        phases_figure([])
    # the Playground's narrow columns: the buttons in a band of their own under the figure, which grows by it
    low = phased(record, previous, lambda s, ev: block_table_figure(s, ["R1"], events=ev), font=14, where="bottom")
    alone = block_table_figure(selection_phases(record, previous)[0]["snapshot"], ["R1"])
    assert low.layout.updatemenus[0].y < 0 and low.layout.height > alone.layout.height
    with pytest.raises(ValueError, match="'left'"):
        phases_figure([("a", alone), ("b", alone)], where="left")


@pytest.mark.parametrize("present", [False, True])
def test_the_playground_and_the_stage_draw_the_key_step_in_two_phases(present):
    """The Playground's pool and block-table picture, and the presenter view's, at the beam-search preset's
    key step (``?scenario=beam-search&step=2``): each opens on the copies (5 blocks in use, every block the
    copy-on-write sentence names drawn). One phase choice (the lab's, ``Lab.phase_of``) drives every figure
    (no buttons of their own, which switched one figure only: issue 23's second trial): the Playground shows
    it as a control with a button per phase, the presenter's Step button says the next press shows the
    selection."""
    import json
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=240)
    at.query_params["scenario"] = "beam-search"
    at.query_params["step"] = "2"
    if present:
        at.query_params["present"] = "1"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    tables = next(c for c in charts if "block tables" in c["layout"]["title"]["text"].lower())
    pool = next(c for c in charts if "blocks in use" in c["layout"]["title"]["text"] and c is not tables)
    assert not any(c["layout"].get("updatemenus") for c in charts)
    if present:
        assert at.button(key="stage_step").label == "Selection"
    else:
        control = at.get("button_group")[0]  # st.segmented_control: one button per phase, the copies chosen
        assert list(control.options) == ["1 the copies", "2 after beam selection"], control.options
        assert control.value == 0
    assert "5/64 blocks in use" in pool["layout"]["title"]["text"]
    shown = {c[2] for t in tables["data"] if t.get("meta", {}).get("role") == "arrows" and t.get("visible") is not False
             for c in t["customdata"] if c is not None}
    assert {1, 2, 3, 4} <= shown, shown
