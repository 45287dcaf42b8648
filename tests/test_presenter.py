"""The presenter view's pure parts: type big enough for a room, sizes that grow with the screen, a request
palette that never runs out and never takes the outline colour, a step said in few grouped sentences."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from ui.lab import Lab
from ui.state import preset_settings
from viz import block_pool_figure, contiguous_region_figure
from viz.colors import (BASE_PALETTE, CACHED_FREE, FREE, OUTLINE, SELECTED, SHARED, SLACK, palette_color,
                        request_colors)
from viz.presenter import PROJECTOR_FONT, presenter_sizes, projector_style, smallest_font
from viz.steps import step_sentences


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


def run(loaded, preset: str, steps: int) -> Lab:
    lab = Lab.create(preset_settings(preset), loaded)
    for _ in range(steps):
        lab.step()
    return lab


def _rgb(c: str) -> tuple[int, ...]:
    return tuple(int(c[i:i + 2], 16) for i in (1, 3, 5))


def _distance(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(_rgb(a), _rgb(b))) ** 0.5


def test_the_palette_never_runs_out_and_never_takes_the_outline_or_a_grey():
    """300 requests: every colour is far from the outline black, the highlight magenta and the greys; the
    first 48 are all different (three rounds of 16: base, tint, shade)."""
    colors = [palette_color(i) for i in range(300)]
    for c in colors:
        for reserved in (OUTLINE, SELECTED, FREE, CACHED_FREE, SHARED, SLACK):
            assert _distance(c, reserved) >= 38, (c, reserved)
    assert len(set(colors[:48])) == 48
    assert colors[:16] == BASE_PALETTE and OUTLINE not in BASE_PALETTE
    assert list(request_colors([f"R{i}" for i in range(20)]).values()) == colors[:20]
    with pytest.raises(ValueError, match="palette index"):
        palette_color(-1)


def test_projector_style_makes_every_font_at_least_the_minimum():
    fig = go.Figure(go.Heatmap(z=[[1, 2]], text=[["a", "b"]], texttemplate="%{text}", textfont={"size": 10}))
    fig.update_layout(title="t", xaxis={"tickfont": {"size": 9}})
    fig.add_annotation(text="note", font={"size": 11})
    assert smallest_font(fig) == 9
    projector_style(fig, height=300, min_font=20)
    assert smallest_font(fig) >= 20 and fig.layout.height == 300  # every text, ticks and legend too
    assert fig.data[0].textfont.size >= 20 and fig.layout.annotations[0].font.size >= 20
    with pytest.raises(ValueError, match="height"):
        projector_style(fig, height=0)


def test_the_real_figures_styled_for_the_projector(loaded):
    lab = run(loaded, "batch", 12)
    paged, contiguous = lab.run.history[-1]
    for fig in (block_pool_figure(paged.snapshot, lab.run.order),
                contiguous_region_figure(contiguous.snapshot.contiguous, lab.run.order)):
        assert smallest_font(fig) < PROJECTOR_FONT  # the Playground's own sizes are small
        assert smallest_font(projector_style(fig, height=300)) >= PROJECTOR_FONT
        assert fig.layout.legend.font.size is None or fig.layout.legend.font.size >= PROJECTOR_FONT


def test_presenter_sizes_fit_the_screen_and_grow_with_it():
    small, big = presenter_sizes(720), presenter_sizes(1080)
    for h, s in ((720, small), (1080, big)):
        # controls, sentences and gaps (~250 px) plus the pool row and the strip fit in the window
        assert 250 + s["pool"] + s["strip"] <= h, (h, s)
    assert big["pool"] > small["pool"] and big["strip"] > small["strip"] and big["font"] > small["font"]
    assert small["font"] == PROJECTOR_FONT and presenter_sizes(None) == small == presenter_sizes(300)


def test_many_hits_are_one_sentence_and_the_moment_comes_first(loaded):
    """shared-prefix, step 1: seven requests hit the same cached blocks, said once, first; the sentence's
    numbers are the events' own."""
    lab = run(loaded, "shared-prefix", 1)
    paged, contiguous = lab.run.history[0]
    hits = [e for e in paged.events if e.kind == "prefix_hit" and not e.data.get("readmission")]
    assert len(hits) > 2
    said = step_sentences(paged, contiguous, key_first=True, group_from=2)
    blocks = sorted(set(hits[0].blocks))
    assert said[0].startswith(f"{len(hits)} sequences found the same {len(blocks)} cached blocks")
    assert sum(s.count("found the same") for s in said) == 1
    assert len(step_sentences(paged, contiguous, limit=3)) == 3


def test_copies_on_write_are_one_sentence_naming_each_copy(loaded):
    lab = run(loaded, "parallel-sampling", 2)
    paged, _ = lab.run.history[1]
    cows = [e for e in paged.events if e.kind == "cow"]
    assert len(cows) >= 2
    first = step_sentences(paged, key_first=True, group_from=2)[0]
    assert "copy-on-write: " not in step_sentences(paged)[1]  # the Playground's view: 3 copies said one by one
    assert first.startswith(f"copy-on-write: {len(cows)} sequences")
    for e in cows:
        assert f"{e.data['src']}->{e.data['dst']}" in first


def test_pool_labels_fit_their_cells(loaded):
    """One line per cell, sized to the cell and never under the projector's size: a 12-block pool gets big
    type; in cells too narrow for "3: R2" at that size the label is cut to the block id, in cells too narrow
    for that it is left out (the hover keeps it); the fill line is gone."""
    from viz.presenter import one_line_cells

    lab = run(loaded, "batch", 3)
    snap = lab.run.history[-1][0].snapshot
    roomy = one_line_cells(block_pool_figure(snap, lab.run.order), row_px=80, col_px=150)
    narrow = one_line_cells(block_pool_figure(snap, lab.run.order), row_px=80, col_px=50)
    tiny = one_line_cells(block_pool_figure(snap, lab.run.order), row_px=80, col_px=8)
    labels = [t for row in roomy.data[0].text for t in row if t]
    assert labels and not any("<br>" in t for t in labels)
    widest = max(len(t) for t in labels)
    assert roomy.data[0].textfont.size == min(round(PROJECTOR_FONT * 1.4), 56, int(150 * 0.9 / (0.6 * widest)))
    ids = [t for row in narrow.data[0].text for t in row if t]
    assert ids == [t.split(":")[0] for t in labels] and all(t.isdigit() for t in ids)
    assert narrow.data[0].textfont.size >= PROJECTOR_FONT
    assert not any(t for row in tiny.data[0].text for t in row) and tiny.data[0].textfont.size >= PROJECTOR_FONT
