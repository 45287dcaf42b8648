"""Figures restyled for a projector: bigger type, a fixed height, no toolbar clutter (pure: Plotly only).

The presenter view (``ui/presenter.py``) draws the same figures as the Playground, then passes each through
``projector_style`` so that labels read from the back of a room: every font in the figure (title, cell
labels, ticks, legend, annotations) is scaled to at least ``min_font`` px, the size the README promises
(18 px at 720 lines, 27 at 1080: ``presenter_sizes``); no text is smaller. Sizes in px; the figure is
changed in place and returned.
"""

from __future__ import annotations

import plotly.graph_objects as go

from .colors import TEXT

PROJECTOR_FONT = 18  # px: the smallest type a presenter view draws (the Playground's labels are 10-13 px)


def _bigger(size: float | None, min_font: int, scale: float) -> float:
    return max(min_font, round((size or min_font) * scale))


def projector_style(fig: go.Figure, height: int | None = None, min_font: int = PROJECTOR_FONT,
                    scale: float = 1.4) -> go.Figure:
    """Scale every font of ``fig`` by ``scale`` to at least ``min_font`` px and set its ``height`` (px).

    Raises ValueError for a non-positive height or font."""
    if height is not None and (not isinstance(height, int) or height <= 0):
        raise ValueError(f"height must be a positive number of pixels, got {height!r}")
    if min_font <= 0 or scale <= 0:
        raise ValueError(f"min_font and scale must be positive, got {min_font!r}, {scale!r}")
    layout = fig.layout
    fig.update_layout(font={"size": _bigger(layout.font.size, min_font, scale)})
    if layout.title.text:  # a title stays a label, not a headline: the figure's own type, a little bigger
        fig.update_layout(title_font_size=min_font + 2)
    for trace in fig.data:
        if "textfont" in trace and trace.textfont is not None:
            trace.textfont.size = _bigger(trace.textfont.size, min_font, scale)
    for ann in layout.annotations or ():
        ann.font.size = _bigger(ann.font.size, min_font, scale)
    for axis in ("xaxis", "yaxis"):
        ax = layout[axis]
        if ax is not None and ax.tickfont is not None:
            ax.tickfont.size = _bigger(ax.tickfont.size, min_font, scale)
    fig.update_layout(legend_font_size=_bigger(layout.legend.font.size, min_font, scale))
    if height is not None:
        fig.update_layout(height=height)
    if layout.title.text:  # room for every line of the title at its new size
        lines = layout.title.text.count("<br>") + 1
        fig.update_layout(margin_t=max(layout.margin.t or 0, lines * (min_font + 10) + 12))
    return fig


def one_line_cells(fig: go.Figure, row_px: float, min_font: int = PROJECTOR_FONT,
                   col_px: float | None = None) -> go.Figure:
    """A pool heatmap's cell labels cut to their first line ("3: R2", not its fill below) and sized to fit
    a cell ``row_px`` px high and ``col_px`` px wide (a character is about 0.6 of the font size wide; at most
    ``min_font`` x 1.4). Never under ``min_font``: where "3: R2" does not fit at that size the cells say only
    the block id ("3"), and where that does not fit either they say nothing (the hover still does), so a big
    pool stays legible at a distance instead of shrinking or overflowing its cells. In place; returns ``fig``."""
    for trace in fig.data:
        if trace.type != "heatmap" or trace.text is None:
            continue
        text = [[str(t).split("<br>")[0] for t in row] for row in trace.text]
        for cut in (lambda t: t, lambda t: t.split(":")[0], lambda t: ""):
            text = [[cut(t) for t in row] for row in text]
            size = min(round(min_font * 1.4), int(row_px * 0.7))
            widest = max((len(t) for row in text for t in row), default=0)
            if col_px and widest:
                size = min(size, int(col_px * 0.9 / (0.6 * widest)))
            if size >= min_font or not widest:
                break
        trace.text = text
        trace.textfont.size = max(min_font, size)
    return fig


def smallest_font(fig: go.Figure) -> float:
    """The smallest font size set anywhere in ``fig`` (px; Plotly's default 12 where none is set)."""
    sizes = [fig.layout.font.size or 12]
    sizes += [t.textfont.size for t in fig.data if "textfont" in t and t.textfont is not None and t.textfont.size]
    sizes += [a.font.size for a in fig.layout.annotations or () if a.font.size]
    sizes += [fig.layout[ax].tickfont.size for ax in ("xaxis", "yaxis") if fig.layout[ax].tickfont.size]
    if fig.layout.title.text:
        sizes.append(fig.layout.title.font.size or fig.layout.font.size or 12)
    return min(sizes)


# The presenter view's vertical budget (px). Without the text on screen (``presenter_sizes(h)``): the controls
# row, two one-line sentences and the gaps between rows take about CHROME_PX, the rest is shared by the pool
# row (POOL_SHARE) and the contiguous strip. With the text (``presenter_sizes(h, w, words, numbers)``): the
# rows are measured from the lines the text wraps to at the window's width.
CHROME_PX = 250
POOL_SHARE = 0.62
BASE_VIEWPORT_H = 720  # the smallest screen the view is laid out for (1280x720)
POOL_MIN_PX, STRIP_MIN_PX = 150, 110  # the figures never shrink below these (then the page scrolls)
# Measured in Chromium at 1280x720 (tests/test_browser_stage_trial.py): the page's padding above and below,
# the gap between two rows, the main column's side padding (5rem each side: the words are 1,120 px wide in a
# 1,280 px window), a Markdown list's margin below.
PAGE_PAD_PX, ROW_GAP_PX, SIDE_PAD_PX, LIST_MARGIN_PX = 18, 16, 160, 8
TEXT_EM = 0.52  # a character's mean width in Source Sans (Streamlit's font), in font sizes: wide (measured ~0.45)


def _controls_px(font: int) -> int:
    """The controls row's height (px) at ``font`` px type: a button's two padded lines at most."""
    return round(font * 2.4 + 20)


def text_lines(texts, width_px: float, font_px: float, indent_px: float = 0.0) -> int:
    """How many lines ``texts`` (each its own paragraph or list item; Markdown's ``**`` not counted) wrap to
    in a column ``width_px`` wide at ``font_px`` type (a character ``TEXT_EM`` of the font wide, words kept
    whole, ``indent_px`` for a bullet)."""
    import textwrap

    chars = max(8, int((width_px - indent_px) / (TEXT_EM * font_px)))
    return sum(max(1, len(textwrap.wrap(str(t).replace("**", ""), chars, break_on_hyphens=False))) for t in texts)


def presenter_sizes(viewport_h: int | None, viewport_w: int | None = None, words=None, numbers=None,
                    numbers_full_width: bool = False) -> dict:
    """Figure heights and the smallest font (px) for a window ``viewport_h`` CSS px high (None: 720).

    Without ``words``: at 720 px pool row 291, strip 151, type 18; at 1080 px: 514, 268, 27 (type grows with
    the screen, so it reads the same from the back of the room), the text above assumed to take two lines.
    With ``words`` (the step's sentences, a list item each) and ``numbers`` (the lines of the column beside
    the strip, first the "step N of M" caption), in a window ``viewport_w`` wide (None: 1280): the sentences'
    height is counted from the lines they wrap to, and the pool row and the strip share what is left, the
    strip at least as high as the numbers column, so its first line ("step N of M") and the rest stay in the
    window (issue 23: a four-line sentence during Play pushed it off a 1280x720 screen). Also returned:
    ``chrome`` (px above the pool row) and ``numbers_px`` (the numbers column's height). Windows under 720 px
    get the 720 layout (scrolls); the figures never shrink below ``POOL_MIN_PX`` / ``STRIP_MIN_PX``.

    ``numbers_full_width``: no contiguous strip (a hybrid model's run, which has no baseline): the numbers
    take the whole lower row, which is as high as they wrap to there, and the pool row takes the rest (the
    hybrid preset's four block-table rows need it: at 1280x720 a strip-sized row showed one request of two)."""
    h = max(BASE_VIEWPORT_H, viewport_h or BASE_VIEWPORT_H)
    font = round(PROJECTOR_FONT * min(h / BASE_VIEWPORT_H, 2.0))
    if words is None:
        room = h - CHROME_PX
        return {"pool": max(290, int(room * POOL_SHARE)), "strip": max(150, int(room * (1 - POOL_SHARE) * 0.85)),
                "font": font}
    w = max(640, viewport_w or 1280)
    words_font, numbers_font = round(font * 1.15), round(font * 1.05)
    words_px = text_lines(words, w - SIDE_PAD_PX, words_font, indent_px=words_font * 1.6) * words_font * 1.3
    chrome = PAGE_PAD_PX + _controls_px(font) + ROW_GAP_PX + words_px + LIST_MARGIN_PX + ROW_GAP_PX
    # the numbers column: two fifths of the main column; its lines at their font (1.65 lines apart, measured),
    # each caption a paragraph of its own
    column = (w - SIDE_PAD_PX) * (1 if numbers_full_width else 2 / 5) - 8
    numbers_px = text_lines(numbers or (), column, numbers_font) * numbers_font * 1.65
    room = h - chrome - ROW_GAP_PX - PAGE_PAD_PX  # the pool row and the lower row, with the gap between them
    if numbers_full_width:
        strip = int(numbers_px) + 4
        pool = max(POOL_MIN_PX, int(room - strip))
        return {"pool": pool, "strip": strip, "font": font, "chrome": round(chrome), "numbers_px": round(numbers_px)}
    strip = max(STRIP_MIN_PX, int(room * (1 - POOL_SHARE) * 0.85), int(numbers_px) + 4)
    pool = max(POOL_MIN_PX, min(int(room * POOL_SHARE), int(room - strip)))
    return {"pool": pool, "strip": strip, "font": font, "chrome": round(chrome), "numbers_px": round(numbers_px)}


def phases_figure(phases: list[tuple[str, go.Figure]], font: int = PROJECTOR_FONT, where: str = "top") -> go.Figure:
    """One figure showing one of several moments of a step (``viz.block_table.selection_phases``: the copies,
    then the beam selection), with a button per phase named by its label in the title's line, right-aligned;
    the first phase shown (the one the step's key sentence says). Each phase's traces, title, axes and
    annotations are its own figure's; every button's text is ``font`` px. ``where``: "top" (in the title's
    line, right-aligned: the presenter's wide, fixed-height figures) or "bottom" (a band of their own under the
    figure, left-aligned, the figure that much taller: the Playground's narrower columns, where a title fills
    its line). Raises ValueError for no phase or another ``where``."""
    if not phases:
        raise ValueError("phases_figure needs at least one (label, figure) phase, got none")
    if where not in ("top", "bottom"):
        raise ValueError(f"where must be 'top' or 'bottom', got {where!r}")
    if len(phases) == 1:
        return phases[0][1]
    first = phases[0][1]
    fig = go.Figure(first)
    fig.data = ()
    visible, data = [], []
    for k, (_, f) in enumerate(phases):
        for t in f.data:
            data.append(t)
            visible.append(k)
    fig.add_traces(data)
    for t, k in zip(fig.data, visible):
        t.visible = k == 0
    buttons = []
    for k, (label, f) in enumerate(phases):
        lay = f.layout
        # each phase's whole title and axes, not a few of their fields: a range of None with no autorange
        # undid the pool's ``autorange: reversed`` (phase 2 drew the grid upside down) and a bare title text
        # lost the title's font
        buttons.append({"label": label, "method": "update",
                        "args": [{"visible": [v == k for v in visible]},
                                 {"title": lay.title.to_plotly_json(), "annotations": lay.annotations or [],
                                  "shapes": lay.shapes or [], "xaxis": lay.xaxis.to_plotly_json(),
                                  "yaxis": lay.yaxis.to_plotly_json()}]})
    top, bottom = first.layout.margin.t or 0, first.layout.margin.b or 0
    height = first.layout.height or 450
    plot_h = max(1, height - top - bottom)
    place = {"x": 1, "xanchor": "right", "y": 1 + (top - 2) / plot_h, "yanchor": "top"}
    if where == "bottom":
        band = round(font * 1.5 + 16)  # a button's height at this type, and a gap
        place = {"x": 0, "xanchor": "left", "y": -(bottom + 4) / plot_h, "yanchor": "top"}
        fig.update_layout(margin_b=bottom + band, height=height + band)
    fig.update_layout(updatemenus=[{"type": "buttons", "direction": "right", "active": 0, "buttons": buttons,
                                    **place, "pad": {"r": 4, "t": 0}, "showactive": True,
                                    "font": {"size": font, "color": TEXT}, "bgcolor": "#FFFFFF",
                                    "bordercolor": "#555555"}])
    return fig


def phased(record, previous, draw, font: int = PROJECTOR_FONT, where: str = "top", phase: int | None = None) -> go.Figure:
    """``draw(snapshot, events)`` for a step; for a beam step, of one of its phases
    (``viz.block_table.selection_phases``: 0 the copies, 1 the selection). ``phase``: that phase (the stage's
    one phase choice, ``ui.lab.Lab.phase_of``: every view of the step draws the same moment); None: every phase,
    joined by ``phases_figure`` (a button each, ``where`` they go). ``previous``: the record before (the pruned
    beams' tokens, for the hover; may be None). Raises ValueError for a phase the step does not have."""
    from .block_table import selection_phases

    phases = selection_phases(record, previous)
    if phase is not None and not 0 <= phase < max(1, len(phases)):
        raise ValueError(f"phase must be 0..{max(1, len(phases)) - 1} for step {record.step}, got {phase!r}")
    if not phases:
        return draw(record.snapshot, record.events)
    if phase is not None:
        return draw(phases[phase]["snapshot"], phases[phase]["events"])
    return phases_figure([(p["label"], draw(p["snapshot"], p["events"])) for p in phases], font, where)


def phase_moment(record, previous, phase: int) -> dict:
    """The snapshot and events of phase ``phase`` of ``record`` (``selection_phases``; a step without phases:
    its own, phase 0), with ``label`` ("" for a step without phases, else e.g. "1/2 the copies"): what the
    numbers and titles beside the step's pictures read, so they are of the moment the pictures show. Raises
    ValueError naming ``phase`` when the step has no such phase."""
    from .block_table import selection_phases

    phases = selection_phases(record, previous)
    if isinstance(phase, bool) or not isinstance(phase, int) or not 0 <= phase < max(1, len(phases)):
        raise ValueError(f"phase must be 0..{max(1, len(phases)) - 1} for step {record.step}, got {phase!r}")
    if not phases:
        return {"snapshot": record.snapshot, "events": record.events, "label": ""}
    p = phases[phase]
    return {"snapshot": p["snapshot"], "events": p["events"],
            "label": f"{phase + 1}/{len(phases)} " + ("the copies" if p["phase"] == "copies" else "after beam selection")}
