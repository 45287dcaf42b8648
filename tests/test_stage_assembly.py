"""The stage is assembled once (``viz.stage.stage_step``) and "changed blocks" defined once
(``engine.records.changed_blocks``; the block tables' refinement ``blocks_new_in_tables``): the Playground,
the presenter view and the exports outline the same blocks of a step (issue 24, item 4)."""

from __future__ import annotations

import json

import pytest

from engine.records import Event, EventKind, blocks_new_in_tables, changed_blocks

OUTLINE = "#000000"  # viz.colors.OUTLINE: what a step changed


def test_changed_blocks_are_every_block_a_structural_event_names():
    """A step that allocated blocks 1 and 2 (1 found in the prefix cache), appended into 2, copied 2 to 5,
    forked over 3 and freed 7: the pool outlines every block an event other than an append names; the block
    tables only the blocks a table took anew (2, the copy's destination 5), a subset."""
    events = [Event(EventKind("allocate"), "R1", [1, 2]), Event(EventKind("prefix_hit"), "R1", [1]),
              Event(EventKind("append"), "R1", [2, 6]), Event(EventKind("cow"), "R1.1", [2, 5], data={"dst": 5}),
              Event(EventKind("fork"), "R1.2", [3]), Event(EventKind("free"), "R2", [7])]
    assert changed_blocks(events) == [1, 2, 3, 5, 7]  # not 6: a plain append
    assert blocks_new_in_tables(events) == {2, 5}
    assert blocks_new_in_tables(events) <= set(changed_blocks(events))
    assert changed_blocks([]) == [] and blocks_new_in_tables([]) == set()


def pool_outlines(fig: dict, xref: str = "x") -> set[int]:
    """The blocks a pool figure (a figure dict) frames in the changed-block colour: each frame's cell, read
    back through the heatmap's columns (``viz.pool``: block = row x columns + column)."""
    heat = next(t for t in fig["data"] if t.get("type") == "heatmap" and t.get("xaxis", "x") == xref)
    ncols = len(heat["z"][0])
    out = set()
    for s in fig["layout"].get("shapes", []):
        if s.get("line", {}).get("color") == OUTLINE and s.get("xref", "x") == xref:
            row, col = round((s["y0"] + s["y1"]) / 2), round((s["x0"] + s["x1"]) / 2)
            out.add(row * ncols + col)
    return out


def table_outlines(fig: dict, xaxis: str = "x") -> set[int]:
    """The physical blocks a block-table figure (a figure dict) outlines as changed: the physical boxes whose
    centre is the centre of an ``outline_changed`` rectangle."""
    traces = [t for t in fig["data"] if t.get("xaxis", "x") == xaxis]
    outline = next((t for t in traces if (t.get("meta") or {}).get("role") == "outline_changed"), None)
    if outline is None:
        return set()
    boxes = next(t for t in traces if (t.get("meta") or {}).get("role") == "physical_labels")
    centres = [((outline["x"][i] + outline["x"][i + 1]) / 2, (outline["y"][i] + outline["y"][i + 2]) / 2)
               for i in range(0, len(outline["x"]), 6)]
    return {int(str(text).removeprefix("<b>").split(" ")[0]) for x, y, text in zip(boxes["x"], boxes["y"], boxes["text"])
            for cx, cy in centres if abs(x - cx) < 1e-6 and abs(y - cy) < 1e-6}


def charts(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def titled(figs: list[dict], start: str) -> dict:
    return next(f for f in figs if str(f["layout"]["title"]["text"]).startswith(start))


@pytest.mark.parametrize("preset, step", [("parallel-sampling", 2), ("memory-pressure", 14)])
def test_playground_presenter_and_export_outline_the_same_changed_blocks(preset, step):
    """At a copy-on-write (parallel sampling, step 2) and a preemption (memory pressure, step 14), the pool on
    the Playground, in the presenter view and in the exported frame frames exactly the step's changed blocks
    (``changed_blocks``), and the block tables outline the same blocks on the Playground and in the export
    (the presenter's, sized for the projector, a part of them), all within ``blocks_new_in_tables``."""
    from streamlit.testing.v1 import AppTest

    from test_app import APP
    from viz import export

    def opened(present: bool) -> AppTest:
        at = AppTest.from_file(APP, default_timeout=300)
        at.query_params["scenario"] = preset
        at.query_params["step"] = str(step)
        if present:
            at.query_params["present"] = "1"
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    at = opened(present=False)
    lab = at.session_state["lab"]
    history, index, _ = lab.frame()
    record = history[index][0]
    assert record.step == step
    changed = set(changed_blocks(record.events))
    new = blocks_new_in_tables(record.events)
    assert changed and new, (preset, step, [str(e.kind) for e in record.events])
    playground = charts(at)
    assert pool_outlines(titled(playground, f"step {step}")) == changed
    playground_tables = table_outlines(titled(playground, f"Block tables after step {step}"))
    assert playground_tables and playground_tables <= new

    presenter = charts(opened(present=True))
    assert pool_outlines(titled(presenter, "paged pool")) == changed
    assert table_outlines(titled(presenter, "block tables")) <= playground_tables

    frame = export.step_figure(history, index, lab.run.order)  # the PNG's figure: the panels stacked
    assert pool_outlines(frame, "x") == changed
    tables_axis = f"x{export.PANELS.index(next(p for p in export.PANELS if p.name == 'block tables')) + 1}"
    assert table_outlines(frame, tables_axis) == playground_tables
