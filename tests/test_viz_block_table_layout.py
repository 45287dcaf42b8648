"""The block-table picture's layout on the presenter's screens (issue 23, item 18), read back from the figure:
arrows rarely cross (physical blocks ordered by the rows that use them, the column folded in two instead of
wrapped into 2-3 columns), every label readable (WCAG contrast >= 4.5:1 against the box it sits on), every text
at the size asked for, and the physical column's header inside the figure.

Crossings are counted on the arrows as drawn: each arrow's 4 points (the spline passes through them) as a
polyline; two arrows cross when their polylines properly intersect (touching at a shared end, two arrows into
one block, is not a crossing). Measured at the key step of each preset (the first ``Next event``) at 1280x720
(18 px type) and 1920x1080 (27 px): beam-search 6 / 6 (7 / 7 before ``_fewer_crossings``; the old layout,
blocks sorted by id in 2-3 columns: 9), batch 1 / 1 (old: 18), swap 0 / 0 (old: 20), shared-prefix 115 / 347
(old: 89, but 4 of 8 sequences drawn;
the new picture draws 6 and 8, and every arrow into the shared prefix from a lower row must pass the arrows of
the rows above it: those crossings are forced by the sharing, whatever the order)."""

from __future__ import annotations

import pytest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from ui.lab import Lab
from ui.state import preset_settings
from viz import block_table as bt
from viz.colors import TEXT, contrast_ratio
from viz.presenter import presenter_sizes

PRESETS = ("beam-search", "batch", "swap", "shared-prefix")
SCREENS = ((1280, 720), (1920, 1080))


@pytest.fixture(scope="module")
def key_steps():
    """preset -> (its key step's paged record, request order): the step ``Next event`` stops at."""
    loaded = load_shared(EMBEDDED_MODEL)
    out = {}
    for preset in PRESETS:
        lab = Lab.create(preset_settings(preset), loaded)
        assert lab.press("next") == "next"
        out[preset] = (lab.run.history[-1][0], lab.run.order)
    return out


def presenter_figure(record, order, w: int, h: int, reorder=None):
    """The picture as the presenter draws it on a ``w`` x ``h`` screen; ``reorder`` replaces the physical
    blocks' order (the old layout's: by id) to compare."""
    size = presenter_sizes(h)
    if reorder is None:
        return bt.block_table_figure(record, order, compact=True, font_px=size["font"], height_px=size["pool"],
                                     width_px=w // 2 - 40, captions=False)
    real, search = bt._order_physical, bt._fewer_crossings
    bt._order_physical = lambda rows, arrows: sorted({a["physical"] for a in arrows})
    bt._fewer_crossings = lambda pic, g: False  # the old layout had no search either
    try:
        return presenter_figure(record, order, w, h)
    finally:
        bt._order_physical, bt._fewer_crossings = real, search


def arrows(fig) -> list[tuple[tuple, list]]:
    """((seq_id, logical, physical), polyline points) per drawn arrow."""
    out = []
    for t in fig.data:
        if (t.meta or {}).get("role") != "arrows":
            continue
        points, key = [], None
        for x, y, c in zip(list(t.x) + [None], list(t.y) + [None], list(t.customdata) + [None]):
            if x is None:
                if points:
                    out.append((key, points))
                points = []
            else:
                points.append((x, y))
                key = tuple(c[:3])
    return out


def _orient(a, b, c) -> int:
    v = (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])
    return 0 if abs(v) < 1e-9 else 1 if v > 0 else -1


def _cross(p, q) -> bool:
    for k in range(len(p) - 1):
        for m in range(len(q) - 1):
            a, b, c, d = p[k], p[k + 1], q[m], q[m + 1]
            if _orient(a, b, c) * _orient(a, b, d) < 0 and _orient(c, d, a) * _orient(c, d, b) < 0:
                return True
    return False


def crossing_pairs(fig) -> list[tuple[tuple, tuple]]:
    drawn = arrows(fig)
    return [(drawn[i][0], drawn[j][0]) for i in range(len(drawn)) for j in range(i + 1, len(drawn))
            if _cross(drawn[i][1], drawn[j][1])]


def shared(record) -> set[int]:
    return {b for b, n in enumerate(record.snapshot.ref_counts) if n > 1} | \
        {e.data["src"] for e in record.events if e.kind == "cow"}


def test_the_crossing_count_itself():
    """Two arrows that swap places cross once; two side by side or meeting at one block do not."""
    assert _cross([(0, 0), (1, 1)], [(0, 1), (1, 0)])
    assert not _cross([(0, 0), (1, 0)], [(0, 1), (1, 1)])
    assert not _cross([(0, 0), (1, 1)], [(0, 2), (1, 1)])


@pytest.mark.parametrize("w,h", SCREENS)
@pytest.mark.parametrize("preset", PRESETS)
def test_arrows_rarely_cross(key_steps, preset, w, h):
    """Bound: no two arrows into blocks that only one sequence uses cross, except where one of them leaves a
    row towards a block level with it (at most one such pair a row: the row's first and second private
    blocks); every other crossing involves a shared block (a prefix, a fork, a copy's source), forced by the
    sharing. And fewer crossings than the same picture with the blocks in id order (the old layout's)."""
    record, order = key_steps[preset]
    fig = presenter_figure(record, order, w, h)
    pairs = crossing_pairs(fig)
    many = shared(record)
    private = [(a, b) for a, b in pairs if a[2] not in many and b[2] not in many]
    rows = {a[0] for a, _ in arrows(fig)} if arrows(fig) else set()
    assert len(private) <= len(rows), (preset, private)
    assert all(a[0] == b[0] for a, b in private), (preset, private)  # never between two sequences' own blocks
    old = crossing_pairs(presenter_figure(record, order, w, h, reorder="id"))
    assert len(pairs) < len(old) or (len(pairs) == len(old) == 0), (preset, len(pairs), len(old))


@pytest.mark.parametrize("w,h", SCREENS)
@pytest.mark.parametrize("preset", PRESETS)
def test_labels_contrast_and_size(key_steps, preset, w, h):
    """Every label on a box: near-black on the box's fill, contrast >= 4.5:1 (WCAG 2.1 AA); every text of the
    figure at least the screen's promised size; the figure exactly the pool row's height; one title line."""
    record, order = key_steps[preset]
    size = presenter_sizes(h)
    fig = presenter_figure(record, order, w, h)
    fills = [(t.fillcolor, list(zip(t.x, t.y))) for t in fig.data if (t.meta or {}).get("role") == "boxes"]
    checked = 0
    for t in fig.data:
        if (t.meta or {}).get("role") not in ("logical_labels", "physical_labels"):
            continue
        assert t.textfont.color == TEXT and t.textfont.size >= size["font"]
        for x, y in zip(t.x, t.y):
            fill = next(f for f, pts in fills if any(
                p[0] is not None and abs(p[0] - x) < 1.0 and abs(p[1] - y) < size["font"] * 2 for p in pts))
            assert contrast_ratio(t.textfont.color, fill) >= 4.5, (preset, x, y, fill)
            checked += 1
    assert checked
    fonts = [fig.layout.font.size, fig.layout.xaxis.tickfont.size, fig.layout.yaxis.tickfont.size,
             fig.layout.title.font.size] + [a.font.size for a in fig.layout.annotations]
    assert min(fonts) >= size["font"]
    assert fig.layout.height == size["pool"] and "<br>" not in fig.layout.title.text


def test_contrast_of_every_fill_the_picture_can_use():
    """Every request colour's tint (the first 48 requests), the shared grey's and the free block's, against
    the label colour."""
    from viz.colors import FREE, SHARED, palette_color

    for color in [palette_color(i) for i in range(48)] + [SHARED, FREE]:
        assert contrast_ratio(TEXT, bt._tint(color)) >= 4.5, color
    assert round(contrast_ratio("#000000", "#FFFFFF"), 1) == 21.0 and contrast_ratio("#777777", "#FFFFFF") < 4.5


@pytest.mark.parametrize("w,h", SCREENS)
def test_the_header_fits_over_the_physical_column(key_steps, w, h):
    """The header is right-aligned to the physical column's right edge (inside the x range), and its
    estimated width fits the room from the last logical block to that edge."""
    for preset in PRESETS:
        record, order = key_steps[preset]
        fig = presenter_figure(record, order, w, h)
        head = next(a for a in fig.layout.annotations if a.name == "header")
        assert head.xanchor == "right" and head.x <= fig.layout.xaxis.range[1]
        assert head.text in bt.HEADERS


def test_bad_sizes_are_named(key_steps):
    record, order = key_steps["batch"]
    with pytest.raises(ValueError, match="font_px must be a positive number of pixels, got 0"):
        bt.block_table_figure(record, order, font_px=0)
    with pytest.raises(ValueError, match="height_px 40"):
        bt.block_table_figure(record, order, font_px=18, height_px=40)
