"""Every figure the pages draw passes Plotly's validation, for every preset at several steps.

The figure builders write plain dicts and skip validation at run time (``viz.plain``: ~1 ms a figure instead of
~10-30 ms); a misspelt property would then be dropped silently by plotly.js. Here each figure of a real run is
rebuilt with validation on (``viz.plain.validated``), which raises naming the bad property."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from engine.scenarios.presets import SCENARIOS
from ui.lab import Lab
from ui.state import preset_settings, shared_model
from viz import (block_pool_figure, contiguous_region_figure, paged_slots_figure,
                 step_tokens_figure, swap_pool_figure, timeline_figure)
from viz.block_table import block_table_figure
from viz.plain import figure, validated
from viz.presenter import one_line_cells, presenter_sizes, projector_style

MAX_STEPS = 40  # steps run per preset (the first, key and last steps of short presets; enough for the rest)


def _figures(lab: Lab, history: list, index: int, decode) -> dict:
    """The figures the Playground and the presenter view draw for step ``index``, by name."""
    paged, contiguous = history[index]
    snap = paged.snapshot
    changed = sorted({b for e in paged.events if e.kind != "append" for b in e.blocks})
    first = lab.run.order[0] if lab.run.order else None
    running = [s for s in snap.sequences if s.status == "running" and s.block_table]
    token = (running[0].seq_id, running[0].num_tokens - 1) if running else None
    figs = {
        "pool": block_pool_figure(snap, lab.run.order, decode=decode, highlight=changed, selected=first,
                                  title="step<br><sub>label</sub>"),
        "paged slots": paged_slots_figure(snap, lab.run.order),
        "block tables": block_table_figure(paged, lab.run.order, selected=first, token=token, decode=decode),
        "timeline": timeline_figure({"paged": [p for p, _ in history[: index + 1]],
                                     "contiguous": [c for _, c in history[: index + 1] if c is not None]},
                                    current_step=paged.step),
        "step tokens": step_tokens_figure([p for p, _ in history[: index + 1]], budget=lab.step_budget(),
                                          current_step=paged.step, semantics=paged.semantics),
    }
    if snap.num_blocks <= 128:
        figs["pool, slot view"] = block_pool_figure(snap, lab.run.order, slot_mode=True, highlight=changed)
    if snap.num_swap_blocks:
        figs["swap pool"] = swap_pool_figure(snap, lab.run.order)
    if contiguous is not None:
        figs["contiguous"] = contiguous_region_figure(contiguous.snapshot.contiguous, lab.run.order,
                                                      lab.contiguous_final_lengths())
    size = presenter_sizes(720)
    figs["presenter pool"] = one_line_cells(projector_style(
        block_pool_figure(snap, lab.run.order, decode=decode, highlight=changed), height=size["pool"]),
        row_px=size["pool"] / 8)
    return figs


@pytest.mark.parametrize("preset, semantics", [(name, None) for name in sorted(SCENARIOS)] + [("batch", "v1")])
def test_every_figure_of_a_preset_validates(preset, semantics):
    # vLLM V1's semantics with a small token budget add the budget's line to the step-tokens figure
    v1 = {"semantics": "v1", "max_num_batched_tokens": 64} if semantics == "v1" else {}
    lab = Lab.create(preset_settings(preset, **v1))
    decode = shared_model(lab.run.settings.model)[1].decode
    for _ in range(MAX_STEPS):
        if not lab.has_work():
            break
        lab.step()
    history, _, _ = lab.frame()
    assert history, f"{preset}: no step ran"
    checked = 0
    for index in sorted({0, len(history) // 2, len(history) - 1}):
        for name, fig in _figures(lab, history, index, decode).items():
            # the plain copy st.plotly_chart sends is Plotly's own to_dict, exactly
            assert fig.to_dict() == go.Figure.to_dict(fig), f"{preset}, {name}: PlainFigure.to_dict differs"
            try:
                validated(fig)
            except ValueError as err:
                raise AssertionError(f"{preset}, step {history[index][0].step}, {name}: {err}") from None
            checked += 1
    assert checked >= 15


def test_to_dict_is_a_copy_that_follows_later_changes():
    fig = figure([{"type": "scatter", "x": [1, 2], "y": [3, 4]}], {"height": 100})
    fig.update_layout(height=200)  # as the presenter view restyles a figure after it is built
    d = fig.to_dict()
    assert d["layout"]["height"] == 200 and d == go.Figure.to_dict(fig)
    d["data"][0]["x"].append(3)  # the caller's copy: the figure is untouched
    assert list(fig.data[0].x) == [1, 2]


def test_validation_names_a_misspelt_property():
    fig = figure([{"type": "heatmap", "z": [[1]], "xgapp": 2}], {"height": 100})
    assert fig.data[0].z == ((1,),) or list(fig.data[0].z) == [[1]]  # built without complaint...
    with pytest.raises(ValueError, match="xgapp"):  # ...and caught by the check the tests run
        validated(fig)
