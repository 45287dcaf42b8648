"""A recorded run as files for slides and hand-outs: one self-contained interactive HTML file, a GIF or MP4,
and one step's view as PNG. Pure: plotly (and, for images, kaleido + imageio); no Streamlit, no torch.

What a step shows (the same in every format): a header naming the step, its kind and the semantics; one
panel per figure of ``PANELS`` (the paged block pool, the contiguous baseline's strip when there is one,
the block-table picture), each drawn by the stage's one assembly (``viz.stage.stage_step``: the step as
recorded, the blocks it changed outlined as on the Playground); and the step in words (the sentences the
Playground says).

How the panels become one figure (``_stack``): every panel is a complete Plotly figure of its own; its traces
move onto their own pair of axes (``x2``/``y2``, ...), its axes keep their settings with a new ``domain``
(a band of the page, in paper coordinates), its title becomes an annotation at the top of its band, and its
shapes and annotations follow their axes (paper-referenced ``y`` is mapped into the band). A panel's band is
as high as its tallest step (each figure sets ``layout.height`` and margins in pixels), so every step has the
same layout and the bands never move while the run plays.

HTML (``run_html``): one figure with one Plotly frame per step (``go.Frame``: the traces, shapes,
annotations and axes of that step), a slider and Play / Pause (``updatemenus``); plotly.js is inlined, so
the file works from disk with no network. Plotly's ``animate`` merges a frame into the traces already drawn
rather than replacing them, so every panel has as many traces in every frame (the most any step draws):
missing ones are invisible placeholders of the same type, and every real trace says ``visible=True``.

Images (``figure_png``, ``run_gif``, ``run_mp4``): each step's figure rendered by kaleido 1.x, which drives a
headless Chrome or Chromium it finds on ``PATH`` (Debian's ``/usr/bin/chromium``) or at ``BROWSER_PATH``; it
never downloads one (``kaleido_get_chrome`` would; nothing here calls it). MathJax is off (it would load
from a CDN). One browser renders all frames of a run (~0.25 s a frame after ~4 s to start, 2 CPU cores).

Sizes (the presets, see the tests / README): plotly.js is ~4.7 MB of every HTML file; each step adds its
figures' JSON (tens of KB for a 64-block pool). Long runs are sampled: at most ``MAX_HTML_STEPS`` steps in
HTML and ``MAX_VIDEO_STEPS`` in a GIF / MP4, evenly spaced, first and last always kept, and the header says
which steps are shown.
"""

from __future__ import annotations

import asyncio
import html
import os
import queue
import shutil
import tempfile
import textwrap
import threading
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Callable

import plotly.graph_objects as go
import plotly.io as pio

from .stage import StageStep, stage_step
from .steps import SEMANTICS_SHORT, step_label

MAX_HTML_STEPS = 400   # steps in one HTML file; more are sampled (plotly.js ~4.7 MB + each step's JSON)
MAX_VIDEO_STEPS = 240  # frames in one GIF / MP4 (~0.25 s each to render, ~100 KB each in a GIF)
IMAGE_WIDTH = 1200     # px of a PNG / GIF / MP4 frame (a multiple of 16, as H.264 wants)
HEADER_PX = 64         # the run's title and the step's header line
SLIDER_PX = 120        # below the figure in HTML: the slider and Play / Pause
GAP_PX = 16            # between two panels
LEFT_PX = 140          # left margin: the block tables' row labels ("R12.3 (swapped)"); fixed, see _stack
WRAP_CHARS = 130       # a sentence line wraps here (13 px text in a 1200 px figure)
LINE_PX = 19           # one line of the sentences
HTML_DIV_ID = "paged-attention-run"
PLAY_MS = 900          # a step on screen while the HTML plays


class ExportError(RuntimeError):
    """An image export cannot run here: kaleido, imageio or a Chrome/Chromium is missing (the message says
    which and how to get it)."""


# ------------------------------------------------------------------------------------------------ panels
@dataclass(frozen=True)
class Panel:
    """One figure of an exported step: ``build(step)`` returns it from the step as the stage shows it
    (``viz.stage.StageStep``), or None when the step has nothing to show in it (no contiguous baseline).
    Adding a figure to every export is one ``Panel`` line in ``PANELS``."""

    name: str
    build: Callable[[StageStep], go.Figure | None]


PANELS: list[Panel] = [Panel("paged block pool", lambda s: s.pool_figure()),
                       Panel("contiguous baseline", lambda s: s.region_figure()),
                       Panel("block tables", lambda s: s.tables_figure())]


# ------------------------------------------------------------------------------------------------ steps
def sample_steps(total: int, limit: int) -> list[int]:
    """Indices of the steps an export shows: all ``total``, or ``limit`` evenly spaced (first and last kept).
    Raises ValueError when ``limit`` < 2 or ``total`` < 1."""
    if total < 1:
        raise ValueError("nothing to export: the run has no recorded steps (press Step first)")
    if limit < 2:
        raise ValueError(f"max_steps {limit}: an export shows at least 2 steps")
    if total <= limit:
        return list(range(total))
    return sorted({round(i * (total - 1) / (limit - 1)) for i in range(limit)})


def step_header(step: StageStep, last: int) -> str:
    """The line above a step: "step 7 of 42: decode - paper (vLLM V0)"; ``last`` is the number of the run's
    last recorded step (not the count of records: a class server keeps only the latest steps)."""
    p = step.record
    return f"step {p.step} of {last}: {html.escape(step_label(p), quote=False)} - {SEMANTICS_SHORT[p.semantics]}"


def sentences_text(sentences: list[str]) -> str:
    """The step in words as annotation text: one bullet per sentence, wrapped at ``WRAP_CHARS``, escaped
    (a sentence may say "900 < 2,048", and Plotly reads ``<`` as markup)."""
    lines = ["<b>This step, in words</b>"]
    for s in sentences:
        wrapped = textwrap.wrap(s, WRAP_CHARS - 2) or [""]
        lines += ["\u2022 " + html.escape(wrapped[0], quote=False)]
        lines += ["   " + html.escape(w, quote=False) for w in wrapped[1:]]
    return "<br>".join(lines)


@dataclass
class _Step:
    """One step's parts, before stacking: its header, its panels' figures (None: nothing this step) and the
    step in words."""

    header: str
    figures: list[dict | None]  # each panel's figure as a dict (``go.Figure.to_dict``: data, layout)
    words: str


def _steps(history, order, decode, budget, indices: list[int], on_step=None) -> list[_Step]:
    """The parts of the steps at ``indices``; ``on_step(done, total)`` after each (a progress bar: drawing the
    panels is most of an export's time, ~0.1-0.4 s a step)."""
    last = history[-1][0].step
    out = []
    for i in indices:
        paged, contiguous = history[i]
        step = stage_step(paged, contiguous, history[i - 1][0] if i > 0 else None, order=order, decode=decode,
                          budget=budget)  # the step as recorded (a beam step: after its selection)
        figures = [panel.build(step) for panel in PANELS]
        out.append(_Step(step_header(step, last), [f.to_dict() if f is not None else None for f in figures],
                         sentences_text(step.sentences())))
        if on_step is not None:
            on_step(len(out), len(indices))
    return out


# ------------------------------------------------------------------------------------------------ stacking
_DEFAULT_MARGIN = {"t": 100, "b": 80}  # plotly's defaults, for a figure that sets none
_DEFAULT_HEIGHT = 450


def _bands(fig: dict) -> tuple[int, int, int]:
    """(title px, plot px, bottom px) of a panel figure: its margins and the plot area between them."""
    layout = fig.get("layout", {})
    m = layout.get("margin", {})
    t, b = int(m.get("t", _DEFAULT_MARGIN["t"])), int(m.get("b", _DEFAULT_MARGIN["b"]))
    h = int(layout.get("height") or _DEFAULT_HEIGHT)
    return t, max(40, h - t - b), b


@dataclass
class _Plan:
    """The layout every step of a run shares: per panel its bands (the most any step needs) and its trace
    types (the most traces any step draws), and the height of the sentences."""

    bands: list[tuple[int, int, int] | None]  # None: no step shows this panel
    types: list[list[str]]
    ranges: list[dict[str, list]]  # per panel: axis ("xaxis", "yaxis") -> the range covering every step's
    words_px: int

    @property
    def plot_px(self) -> int:
        panels = sum(t + p + b + GAP_PX for t, p, b in filter(None, self.bands))
        return panels + self.words_px


def _plan(steps: list[_Step]) -> _Plan:
    n = len(PANELS)
    bands: list[tuple[int, int, int] | None] = [None] * n
    types: list[list[str]] = [[] for _ in range(n)]
    ranges: list[dict[str, list]] = [{} for _ in range(n)]
    for s in steps:
        for k, fig in enumerate(s.figures):
            if fig is None:
                continue
            for axis in ("xaxis", "yaxis"):
                _cover(ranges[k], axis, fig["layout"].get(axis, {}).get("range"))
            t, p, b = _bands(fig)
            old = bands[k] or (0, 0, 0)
            bands[k] = (max(old[0], t), max(old[1], p), max(old[2], b))
            mine = [tr.get("type", "scatter") for tr in fig.get("data", [])]
            if mine[:len(types[k])] == types[k][:len(mine)]:
                types[k] = max(types[k], mine, key=len)
            else:  # animate merges frame i's trace j into trace j: types must line up
                raise ValueError(f"panel {PANELS[k].name!r}: step traces {mine} do not line up with {types[k]}; "
                                 "a panel must draw the same trace types in the same order every step")
    lines = max(s.words.count("<br>") + 1 for s in steps)
    return _Plan(bands, types, ranges, lines * LINE_PX + 16)


def _cover(ranges: dict[str, list], axis: str, r: list | None) -> None:
    """Widen ``ranges[axis]`` to cover the range ``r`` (kept in its direction: [high, low] is reversed).
    A fixed range per run, because Plotly's ``animate`` drops a frame's axis ranges (and so a panel whose
    range follows its content, like the block tables' pixel rows, keeps one scale while the run plays)."""
    if not r or None in r:
        return
    old = ranges.get(axis)
    if old is None:
        ranges[axis] = list(r)
        return
    lo, hi = min(*old, *r), max(*old, *r)
    ranges[axis] = [hi, lo] if old[0] > old[1] else [lo, hi]


def _ref(ref: str | None, axis: str, letter: str) -> str:
    """A panel's reference to its own axis ("x", "x domain") moved to ``axis`` ("x2"); "paper" stays."""
    if ref is None:
        return axis
    if ref.startswith(letter):
        return ref.replace(letter, axis, 1) if ref in (letter, f"{letter} domain") else ref
    return ref


def _stack(step: _Step, plan: _Plan, title: str) -> tuple[list[dict], dict]:
    """One step as (traces, layout): every panel on its own axes in its own band of the page."""
    total = plan.plot_px
    traces, shapes, annotations, axes = [], [], [], {}
    top = total  # px from the bottom of the plot area, going down
    for k, (panel, fig) in enumerate(zip(PANELS, step.figures)):
        band = plan.bands[k]
        if band is None:
            continue
        t, p, b = band
        y1, y0 = (top - t) / total, (top - t - p) / total
        n = len(axes) // 2 + 1
        xa, ya = ("x", "y") if n == 1 else (f"x{n}", f"y{n}")
        real = fig["data"] if fig is not None else []
        for j, kind in enumerate(plan.types[k]):
            trace = dict(real[j]) if j < len(real) else {"type": kind}
            trace.update(xaxis=xa, yaxis=ya, visible=j < len(real))
            traces.append(trace)
        lay = fig["layout"] if fig is not None else {}
        axes["xaxis" + xa[1:]] = {**lay.get("xaxis", {}), "domain": [0, 1], "anchor": ya}
        axes["yaxis" + ya[1:]] = {**lay.get("yaxis", {}), "domain": [y0, y1], "anchor": xa}
        for axis, r in plan.ranges[k].items():
            axes[axis + (xa if axis == "xaxis" else ya)[1:]]["range"] = r
        for axis in (xa, ya):  # margins that follow tick labels would move every panel while the run plays
            axes[axis[0] + "axis" + axis[1:]]["automargin"] = False
        if fig is None:
            axes["xaxis" + xa[1:]]["visible"] = axes["yaxis" + ya[1:]]["visible"] = False
        heading = lay.get("title", {})
        heading = {"text": heading} if isinstance(heading, str) else heading
        annotations.append({"text": heading.get("text") or (panel.name if fig is not None else
                                                             f"{panel.name}: nothing in this step"),
                            "xref": "paper", "yref": "paper", "x": 0, "y": top / total, "xanchor": "left",
                            "yanchor": "top", "showarrow": False, "align": "left",
                            "font": {"size": heading.get("font", {}).get("size", 14)}, "name": f"title: {panel.name}"})
        for shape in lay.get("shapes", []):
            s = {**shape, "xref": _ref(shape.get("xref"), xa, "x"), "yref": _ref(shape.get("yref"), ya, "y")}
            if s["yref"] == "paper":
                s["y0"], s["y1"] = y0 + s.get("y0", 0) * (y1 - y0), y0 + s.get("y1", 0) * (y1 - y0)
            shapes.append(s)
        for note in lay.get("annotations", []):
            a = {**note, "xref": _ref(note.get("xref"), xa, "x"), "yref": _ref(note.get("yref"), ya, "y")}
            if a["yref"] == "paper":
                a["y"] = y0 + a.get("y", 0.5) * (y1 - y0)
            annotations.append(a)
        top -= t + p + b + GAP_PX
    annotations.append({"text": step.words, "xref": "paper", "yref": "paper", "x": 0, "y": plan.words_px / total,
                        "xanchor": "left", "yanchor": "top", "showarrow": False, "align": "left",
                        "font": {"size": 13}, "name": "sentences"})
    layout = {"title": {"text": f"{html.escape(title, quote=False)}<br><sub>{step.header}</sub>", "x": 0,
                        "xanchor": "left", "pad": {"l": 12}, "font": {"size": 18}},
              "shapes": shapes, "annotations": annotations, **axes}
    return traces, layout


def _padded(parts: list[tuple[list[dict], dict]]) -> list[tuple[list[dict], dict]]:
    """The frames made safe for Plotly's ``animate``, which MERGES a frame into what is on screen: a trace
    keeps every attribute the new frame does not set (a box's ``fill`` stays on the arrow drawn in its place
    next), and a layout array a frame leaves shorter or empty keeps its old items (a step's outlines would
    stay). So every frame gets as many shapes and annotations as the most any step has (the padding
    invisible; every real one ``visible=True``), and every attribute any frame sets at a place (trace j,
    shape i, axis) is set in every frame, to None (Plotly's default) where that frame has none."""
    for key, blank in (("shapes", {"type": "rect", "xref": "paper", "yref": "paper", "x0": 0, "x1": 0, "y0": 0,
                                   "y1": 0}), ("annotations", {"text": "", "xref": "paper", "yref": "paper",
                                                               "x": 0, "y": 0, "showarrow": False})):
        most = max(len(layout[key]) for _, layout in parts)
        for _, layout in parts:
            layout[key] = [{**item, "visible": True} for item in layout[key]] + \
                [{**blank, "visible": False} for _ in range(most - len(layout[key]))]
    _complete([{"data": traces, "layout": layout} for traces, layout in parts])
    return parts


def _complete(items: list) -> None:
    """Give every dict in ``items`` (the same place in each frame) every key any of them has, recursively
    (through dicts, and lists of dicts of one length); a missing key is set in place to None (the default),
    or to {} where the others hold an object (plotly.js reads into ``marker`` or ``line`` without a check)."""
    dicts = [d for d in items if isinstance(d, dict)]
    if len(dicts) < 2:
        return
    keys = dict.fromkeys(k for d in dicts for k in d)
    for key in keys:
        present = [d[key] for d in dicts if d.get(key) is not None]
        if present and all(isinstance(v, dict) for v in present):
            for d in dicts:  # an object attribute (marker, line) must stay an object: plotly.js reads into it
                if d.get(key) is None:
                    d[key] = {}
            _complete([d[key] for d in dicts])
            continue
        for d in dicts:
            d.setdefault(key, None)
        if all(isinstance(v, list) for v in present) and len({len(v) for v in present}) == 1 and \
                any(isinstance(x, dict) for v in present for x in v):
            for column in zip(*present):
                _complete(list(column))


def _base_layout(plan: _Plan, bottom_px: int) -> dict:
    return {"height": HEADER_PX + plan.plot_px + bottom_px, "plot_bgcolor": "white", "paper_bgcolor": "white",
            "showlegend": False, "hovermode": "closest",
            "margin": {"t": HEADER_PX, "b": bottom_px, "l": LEFT_PX, "r": 20}}


# ------------------------------------------------------------------------------------------------ HTML
def run_figure(history, order: list[str], decode: Callable | None = None, budget: int | None = None,
               title: str = "Paged Attention Lab: a recorded run", max_steps: int = MAX_HTML_STEPS,
               on_step: Callable[[int, int], None] | None = None) -> dict:
    """The recorded run as one animated figure, as a plain figure dict (``data``, ``layout``, ``frames``: what
    ``go.Figure`` would hold; a dict because validating hundreds of frames in plotly.py takes seconds): one
    frame per step shown (``name``: its step number), a slider over them and Play / Pause buttons.

    Args:
        history: ``Lab.run.history``: a list of (paged StepRecord, contiguous StepRecord or None), in step order.
        order: request ids in first-seen order (``Lab.run.order``; fixes each request's colour).
        decode: token ids -> text, for the pool's and tables' hovers (optional; larger file).
        budget: vLLM V1's token budget per step, named in the sentences (None: the paper's semantics).
        title: the first line of the figure's title.
        max_steps: most steps shown; a longer run is sampled (``sample_steps``) and the title says so.
        on_step: called as ``on_step(done, total)`` after each step is drawn (a progress bar).

    Raises:
        ValueError: an empty history, ``max_steps`` < 2, or a panel whose traces change type between steps.
    """
    indices = sample_steps(len(history), max_steps)
    if len(indices) < len(history):
        title += f" ({len(indices)} of {len(history)} steps shown, evenly spaced)"
    steps = _steps(history, order, decode, budget, indices, on_step)
    plan = _plan(steps)
    parts = _padded([_stack(s, plan, title) for s in steps])
    names = [str(history[i][0].step) for i in indices]
    still = {"frame": {"duration": 0, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}
    play = {**still, "frame": {"duration": PLAY_MS, "redraw": True}, "fromcurrent": True}
    controls = {
        "updatemenus": [{"type": "buttons", "direction": "left", "x": 0, "xanchor": "left", "y": 0, "yanchor": "top",
                         "pad": {"t": 40, "r": 10}, "showactive": False, "buttons": [
                             {"label": "\u25b6 Play", "method": "animate", "args": [None, play]},
                             {"label": "\u275a\u275a Pause", "method": "animate", "args": [[None], still]}]}],
        "sliders": [{"active": 0, "x": 0.17, "len": 0.83, "y": 0, "yanchor": "top", "pad": {"t": 30},
                     "currentvalue": {"prefix": "step ", "font": {"size": 14}},
                     "steps": [{"label": name, "method": "animate", "args": [[name], still]} for name in names]}]}
    return {"data": parts[0][0], "layout": {**_base_layout(plan, SLIDER_PX), **parts[0][1], **controls},
            "frames": [{"name": name, "data": traces, "layout": layout}
                       for (traces, layout), name in zip(parts, names)]}


def run_html(history, order: list[str], decode: Callable | None = None, budget: int | None = None,
             title: str = "Paged Attention Lab: a recorded run", max_steps: int = MAX_HTML_STEPS,
             on_step: Callable[[int, int], None] | None = None) -> str:
    """The recorded run (``run_figure``) as ONE self-contained HTML page (str): plotly.js inlined, no CDN, no
    MathJax, nothing loaded from the network; open it from disk and press Play or drag the slider.

    Size: ~4.7 MB of plotly.js plus each step's figures (see the module docstring). Raises as ``run_figure``.
    """
    fig = run_figure(history, order, decode, budget, title, max_steps, on_step)
    page = pio.to_html(fig, include_plotlyjs=True, include_mathjax=False, full_html=True, auto_play=False,
                       validate=False, div_id=HTML_DIV_ID, config={"displaylogo": False, "responsive": True},
                       post_script=QUIET_PAUSE)
    # a tab title; plotly writes a bare <head>
    return page.replace("<head>", f"<head><title>{html.escape(title)}</title>", 1)


# Pause interrupts Play's Plotly.animate, whose promise then rejects with no reason: an "Uncaught (in promise)
# undefined" in the console on every Pause. That rejection alone is expected here; any other still shows.
QUIET_PAUSE = ("window.addEventListener('unhandledrejection', function (e) { "
               "if (e.reason === undefined) { e.preventDefault(); } });")


class _Loads(HTMLParser):
    """Collects every URL a page would fetch (src / href / data of its elements, CSS url() and @import in
    style attributes and <style> blocks); the inside of a <script> is text to this parser, so strings within
    plotly.js do not count."""

    ATTRS = {"src", "href", "data", "srcset", "poster"}

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.tag = ""

    def handle_data(self, data):
        if self.tag == "style" and ("url(" in data or "@import" in data):
            self.urls.append(f"<style>{data.strip()[:200]}</style>")

    def handle_endtag(self, tag):
        self.tag = ""

    def handle_starttag(self, tag, attrs):
        self.tag = tag
        for name, value in attrs:
            if name in self.ATTRS and value and not value.startswith(("#", "data:", "javascript:")):
                if tag != "a":  # a plain link loads nothing until clicked
                    self.urls.append(f"<{tag} {name}={value}>")
            if name == "style" and value and "url(" in value:
                self.urls.append(f"<{tag} style={value}>")


def external_loads(page: str) -> list[str]:
    """What an HTML page would fetch when opened (scripts, style sheets, images, frames), as "<tag attr=url>";
    [] for a page that works offline."""
    parser = _Loads()
    parser.feed(page)
    return parser.urls


# ------------------------------------------------------------------------------------------------ images
def step_figures(history, order: list[str], decode: Callable | None = None, budget: int | None = None,
                 title: str = "Paged Attention Lab", indices: list[int] | None = None,
                 width: int = IMAGE_WIDTH) -> list[dict]:
    """Static figures (figure dicts) of the steps at ``indices`` (default all), one layout for all (what a GIF
    needs): the header, the panels and the step in words, ``width`` px wide, a height a multiple of 16 px.
    Raises ValueError when ``indices`` is empty."""
    indices = list(range(len(history))) if indices is None else indices
    if not indices:
        raise ValueError("nothing to export: no steps chosen")
    steps = _steps(history, order, decode, budget, indices)
    plan = _plan(steps)
    base = _base_layout(plan, 16)
    base["height"] += -base["height"] % 16
    base["width"] = width
    figs = []
    for s in steps:
        traces, layout = _stack(s, plan, title)
        figs.append({"data": traces, "layout": {**base, **layout}})
    return figs


def step_figure(history, index: int, order: list[str], decode: Callable | None = None, budget: int | None = None,
                title: str = "Paged Attention Lab") -> dict:
    """The view of recorded step ``index`` (0-based) as one static figure dict (for ``figure_png``). Raises
    IndexError naming ``index`` when no such step was recorded."""
    if not 0 <= index < len(history):
        raise IndexError(f"step index {index}: the run has {len(history)} recorded steps (0..{len(history) - 1})")
    return step_figures(history, order, decode, budget, title, [index])[0]


def chromium_path() -> str | None:
    """The browser kaleido will drive: ``BROWSER_PATH`` if set, else the first Chrome / Chromium on ``PATH``."""
    if os.environ.get("BROWSER_PATH"):
        return os.environ["BROWSER_PATH"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        if found := shutil.which(name):
            return found
    return None


def _kaleido():
    try:
        import kaleido
    except ImportError as exc:
        raise ExportError("PNG / GIF / MP4 export needs kaleido (pip install 'kaleido>=1'): " + str(exc)) from exc
    path = chromium_path()
    if path is None or not os.access(path, os.X_OK):
        raise ExportError(f"PNG / GIF / MP4 export needs Chrome or Chromium for kaleido: "
                          f"{'BROWSER_PATH=' + repr(path) + ' is not executable' if path else 'none on PATH'} "
                          f"(install chromium, or set BROWSER_PATH to its executable)")
    return kaleido


def figures_png(figs: list[dict | go.Figure], scale: float = 1.0,
                on_frame: Callable[[int, int], None] | None = None) -> list[bytes]:
    """PNG bytes of each figure (a figure dict or ``go.Figure``), at its layout's width and height (default
    ``IMAGE_WIDTH`` x 600 px) times ``scale``, all rendered by ONE headless browser (kaleido).
    ``on_frame(done, total)`` is called after each, in the caller's thread (a progress bar). Raises ExportError
    when kaleido or Chromium is missing or the browser fails."""
    kaleido = _kaleido()
    # kaleido is asyncio: it runs in a thread of its own (the caller, a Streamlit script run, may have a loop),
    # which reports each frame here; ``on_frame`` runs in the caller's thread (Streamlit calls work only there)
    done: queue.Queue = queue.Queue()

    async def render() -> list[bytes]:
        out = []
        async with kaleido.Kaleido(n=1, mathjax=False, timeout=120) as k:
            for fig in figs:
                fig = fig.to_dict() if isinstance(fig, go.Figure) else fig
                layout = fig.get("layout", {})
                opts = {"format": "png", "width": layout.get("width") or IMAGE_WIDTH,
                        "height": layout.get("height") or 600, "scale": scale}
                out.append(await k.calc_fig(fig, opts=opts))
                done.put(len(out))
        return out

    result: dict = {}

    def run() -> None:
        try:
            result["pngs"] = asyncio.run(render())
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread below
            result["error"] = exc
        done.put(None)

    threading.Thread(target=run, name="kaleido-export", daemon=True).start()
    while (count := done.get()) is not None:
        if on_frame is not None:
            on_frame(count, len(figs))
    if "error" in result:
        exc = result["error"]
        raise ExportError(f"rendering with kaleido / Chromium ({chromium_path()}) failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    return result["pngs"]


def figure_png(fig: dict | go.Figure, scale: float = 2.0) -> bytes:
    """One figure as PNG bytes (``scale`` 2: sharp on a slide). Raises ExportError (see ``figures_png``)."""
    return figures_png([fig], scale)[0]


def _frames(history, order, decode, budget, title, max_steps, on_frame):
    """The RGB pixel arrays of the steps a video shows: ``[H, W, 3]`` uint8 each, one size for all."""
    try:
        import imageio.v3 as iio
    except ImportError as exc:
        raise ExportError("GIF / MP4 export needs imageio (pip install imageio): " + str(exc)) from exc
    indices = sample_steps(len(history), max_steps)
    if len(indices) < len(history):
        title += f" ({len(indices)} of {len(history)} steps shown)"
    pngs = figures_png(step_figures(history, order, decode, budget, title, indices), on_frame=on_frame)
    return iio, [iio.imread(p)[..., :3] for p in pngs]


def run_gif(history, order: list[str], decode: Callable | None = None, budget: int | None = None,
            title: str = "Paged Attention Lab", fps: float = 1.0, max_steps: int = MAX_VIDEO_STEPS,
            on_frame: Callable[[int, int], None] | None = None) -> bytes:
    """The run as an endless-loop GIF (bytes), one frame per step shown (``max_steps`` at most, sampled as
    ``sample_steps``), ``fps`` frames a second. Raises ValueError (empty run, fps <= 0) or ExportError."""
    if not fps > 0:
        raise ValueError(f"fps {fps!r}: frames per second must be > 0")
    iio, frames = _frames(history, order, decode, budget, title, max_steps, on_frame)
    return iio.imwrite("<bytes>", frames, extension=".gif", duration=round(1000 / fps), loop=0)


def run_mp4(history, order: list[str], decode: Callable | None = None, budget: int | None = None,
            title: str = "Paged Attention Lab", fps: float = 1.0, max_steps: int = MAX_VIDEO_STEPS,
            on_frame: Callable[[int, int], None] | None = None) -> bytes:
    """The run as an H.264 MP4 (bytes, yuv420p: plays in browsers and slide software) through imageio-ffmpeg's
    ffmpeg. Raises ValueError (empty run, fps <= 0) or ExportError (no imageio-ffmpeg)."""
    if not fps > 0:
        raise ValueError(f"fps {fps!r}: frames per second must be > 0")
    try:
        import imageio_ffmpeg  # noqa: F401 - the ffmpeg binary imageio's FFMPEG plugin runs
    except ImportError as exc:
        raise ExportError("MP4 export needs imageio-ffmpeg (pip install imageio-ffmpeg): " + str(exc)) from exc
    iio, frames = _frames(history, order, decode, budget, title, max_steps, on_frame)
    with tempfile.TemporaryDirectory() as tmp:  # ffmpeg writes to a file, not to memory
        path = os.path.join(tmp, "run.mp4")
        iio.imwrite(path, frames, plugin="FFMPEG", fps=fps, codec="libx264", macro_block_size=16)
        with open(path, "rb") as f:
            return f.read()
