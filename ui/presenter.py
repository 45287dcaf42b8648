"""The Playground's presenter view: one screen for a projector or a talk.

Switched on by the "Presenter view" toggle or the URL parameter ``?present=1`` (a link a speaker opens on
the lectern machine). It hides the sidebar and Streamlit's header and draws, for the step under the cursor,
on one screen at 1280x720 and at 1920x1080 (a browser test checks each preset's key step at both sizes):

1. the step in one or two sentences, the moment first (a copy-on-write, a preemption, a hit: grouped, e.g.
   "7 sequences found the same 5 cached blocks"; ``viz.steps.step_sentences(key_first=True)``);
2. the paged block pool and the block-table picture side by side;
3. the contiguous baseline's strip with its three kinds of waste, and beside it "step N of M" first, then the
   few numbers that tell the story (``column_lines``).

A beam-search step has two moments (``viz.block_table.selection_phases``: the copies, then the beam
selection). The view draws one of them, the lab's (``Lab.phase_of``), in every figure and number at once:
the pool's title, the block tables and the numbers are always of the same moment. The stage's presses move
it (Step / PageDown / a clicker first shows the selection, Back / PageUp the copies again), as a slide deck
steps through a slide's builds, so a speaker with a clicker sees what a mouse user sees; the Step button
says "Selection" while the next press shows it. The figures' heights are sized from the text on screen
(``viz.presenter.presenter_sizes`` with the sentences and the numbers column), so a long sentence never
pushes "step N of M" out of a 1280x720 window.

Every figure goes through ``viz.presenter.projector_style`` (type at least 18 px). The numbers are read
through ``engine.metrics`` like the Playground's. Nothing here steps an engine: the stage's presses
(PageDown, a clicker, Step / Next event / Run to the end) are handled by the Playground before this draws.
"""

from __future__ import annotations

import html

import streamlit as st

from engine import metrics
from ui.lab import POLICY_LABELS
from ui.state import viewport
from viz.presenter import one_line_cells, presenter_sizes, projector_style
from viz.stage import StageStep, hybrid_short, stage_step
from viz.steps import SEMANTICS_SHORT, step_label

PRESENT_PARAM = "present"  # ?present=1 opens the Playground in the presenter view
PRESENT_KEY = "present"  # whether the view is on (plain session state)
TOGGLE_KEY = "present_toggle"  # the toggle widget's key
SENTENCES = 2  # the step said in at most this many sentences (then how many more the Playground view says)

# Hide the sidebar (and its open/close arrow) and Streamlit's header; less padding above; text sized from the
# view's smallest font (``viz.presenter.presenter_sizes``: it grows with the window).
CSS = """
<style>
section[data-testid="stSidebar"], [data-testid="stSidebarCollapsedControl"], header[data-testid="stHeader"],
[data-testid="stSidebarNav"] {{ display: none !important; }}
.main .block-container, [data-testid="stMainBlockContainer"] {{ padding-top: 0.6rem !important;
  padding-bottom: 0.5rem !important; max-width: 100% !important; }}
.st-key-present_words p, .st-key-present_words li {{ font-size: {words}px !important; line-height: 1.3 !important; }}
.st-key-present_numbers p {{ font-size: {numbers}px !important; margin-bottom: 0.1rem !important; }}
[data-testid="stButton"] button p {{ font-size: {numbers}px !important; }}
[data-testid="stMain"] [data-testid="stWidgetLabel"] p, [data-testid="stMain"] [data-testid="stCaptionContainer"],
[data-testid="stMain"] [data-testid="stCaptionContainer"] p, [data-testid="stMain"] [data-testid="stSliderThumbValue"],
[data-testid="stMain"] [data-testid="stSliderTickBar"] div, [data-testid="stMain"] [data-testid="stAlert"] p
  {{ font-size: {font}px !important; }}
[data-testid="stMain"] [data-testid="stWidgetLabel"], [data-testid="stMain"] [data-testid="stWidgetLabel"] *,
[data-testid="stMain"] [data-testid="stButton"] button *
  {{ white-space: normal !important; text-overflow: clip !important; overflow: visible !important;
     overflow-wrap: normal !important; }}
[class*="st-key-steady_"] {{ display: grid !important; grid-template-columns: minmax(0, 1fr) !important; }}
[class*="st-key-steady_"] > div {{ grid-area: 1 / 1 !important; width: 100% !important; }}
[class*="st-key-steady_"] > div:first-child {{ z-index: 1; }}
.st-key-present_toggle [data-testid="stWidgetLabel"] p {{ white-space: nowrap !important; }}
</style>
"""


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def presenting() -> bool:
    """Whether the presenter view is on: plain session state (which Streamlit never cleans up, unlike a
    widget's value after a run that did not draw it), first taken from ``?present=``."""
    if PRESENT_KEY not in st.session_state:
        st.session_state[PRESENT_KEY] = _truthy(st.query_params.get(PRESENT_PARAM, ""))
    return bool(st.session_state[PRESENT_KEY])


def _toggled() -> None:
    """The toggle's callback: the view follows it, and the URL says so (a reload or a shared link keeps it)."""
    on = bool(st.session_state.get(TOGGLE_KEY))
    st.session_state[PRESENT_KEY] = on
    if on:
        st.query_params[PRESENT_PARAM] = "1"
    elif PRESENT_PARAM in st.query_params:
        del st.query_params[PRESENT_PARAM]


def toggle() -> None:
    st.session_state[TOGGLE_KEY] = presenting()  # the widget shows the state, whatever it held before
    st.toggle("Presenter view", key=TOGGLE_KEY, on_change=_toggled,
              help="One screen for a projector: no sidebar, big type, the step in a sentence or two, the pool, "
                   "the block tables and the contiguous baseline. Opens directly with ?present=1 in the URL.")


def sizes() -> dict:
    """Figure heights and the smallest font for this browser's window (``viz.presenter.presenter_sizes``)."""
    vp = viewport()
    return presenter_sizes(vp["h"] if vp else None)


def style_page() -> None:
    font = sizes()["font"]
    st.markdown(CSS.format(words=round(font * 1.15), numbers=round(font * 1.05), font=font), unsafe_allow_html=True)


def numbers(lab, paged, contiguous, moment: dict | None = None) -> list[str]:
    """The few numbers that tell the story, a line per side, each read through ``engine.metrics``. ``moment``:
    the phase of a beam step on screen (``viz.presenter.phase_moment``): the paged numbers are that moment's,
    the one the pool and the block tables beside them show, and say which it is."""
    snap = moment["snapshot"] if moment else paged.snapshot
    used = snap.num_blocks - snap.num_free_blocks
    after = f" ({moment['label']})" if moment and moment["label"] else ""
    line = (f"**Paged**{after}: {used}/{snap.num_blocks} blocks in use, "
            f"{metrics.slack_pct(snap):.0f}% slack" if metrics.slots_allocated(snap) else
            f"**Paged**{after}: {used}/{snap.num_blocks} blocks in use")
    line += f", {len(snap.running)} running"
    if snap.waiting:
        line += f", {len(snap.waiting)} waiting"
    if snap.swapped:
        line += f", {len(snap.swapped)} swapped out"
    cache = metrics.prefix_cache_stats(snap.prefix_cache)
    if lab.run.settings.enable_prefix_caching and cache["query_tokens"]:
        line += f", hit rate {cache['hit_rate_pct']:.0f}%"
    lines = [line]
    if hybrid := hybrid_short(snap, lab.bytes_per_block()):  # a hybrid model: what its sliding windows save
        lines.append(f"**Hybrid**: {hybrid}")
    if contiguous is not None:
        cs = contiguous.snapshot
        unused = f", {metrics.slack_pct(cs):.0f}% of reserved unused" if metrics.slots_allocated(cs) else ""
        lines.append(f"**Contiguous** ({POLICY_LABELS[lab.run.settings.contiguous_policy]}): {len(cs.running)} "
                     f"admitted, {len(cs.waiting)} waiting{unused}")
    return lines


def few_sentences(step: StageStep) -> list[str]:
    """The step in at most ``SENTENCES`` sentences, the moment first (``step_sentences(key_first=True)``);
    the last says how many more decisions the Playground view lists. ``step``: the step on screen
    (``viz.stage.stage_step``): a beam step's phase says that moment's sentences (``StageStep.sentences``,
    ``of_moment``)."""
    said = step.sentences(of_moment=True, limit=10**6, key_first=True, group_from=2)
    shown = said[:SENTENCES]
    if len(said) > SENTENCES:
        shown[-1] += f" (+{len(said) - SENTENCES} more)"
    return shown


def words_markdown(sentences: list[str]) -> str:
    """The sentences as a Markdown list for the stage: escaped, and each "->" (a copy "1->2") drawn as one
    arrow character, so a line never breaks inside it ("1-" / ">2")."""
    return "\n".join("- " + html.escape(x).replace("-&gt;", "\u2192") for x in sentences)


def projector_tables(step: StageStep, size: dict, width: int):
    """The block-table picture of ``step`` (the stage's, ``viz.stage.StageStep.tables_figure``) at the
    projector's type: laid out for the pool row's height and ``width`` px, every text ``size["font"]`` px, the
    title on one line; the copy-on-write's caption is left out (the sentences above say it)."""
    fig = step.tables_figure(title="block tables", compact=True, font_px=size["font"], height_px=size["pool"],
                             width_px=width, captions=False)
    return projector_style(fig, height=size["pool"], min_font=size["font"], scale=1.0)


def projector_pool(step: StageStep, size: dict, width: float):
    """The paged pool of ``step`` (``viz.stage.StageStep.pool_figure``: its changed blocks outlined) at the
    projector's type, ``width`` px wide, titled with the moment's blocks in use and which phase it is."""
    fig = projector_style(step.pool_figure(title="paged pool{label}: {used}/{blocks} blocks in use"),
                          height=size["pool"], min_font=size["font"])
    rows, cols = max(1, len(fig.data[0].z)), max(1, len(fig.data[0].z[0]))
    below = 10
    if fig.layout.showlegend:  # a hybrid model's key to the groups' patterns: two lines of it under the cells
        below = 2 * (size["font"] + 12)
        fig.update_layout(margin_b=below, legend_y=-8 / max(1, size["pool"] - fig.layout.margin.t - below))
    one_line_cells(fig, (size["pool"] - fig.layout.margin.t - below) / rows, size["font"], col_px=width / cols)
    return fig


def finished_on(history: list, index: int, has_work: bool) -> bool:
    """Whether "all requests finished" is true of recorded step ``index`` (-1: the latest) of ``history``:
    no work left and no later step recorded. Looking back (N ran on to the end and stayed on its step), the
    requests running in the numbers beside it have not finished (the trial read "all requests finished"
    beside "2 running")."""
    index = index if index >= 0 else len(history) - 1
    return not has_work and index >= len(history) - 1


def step_line(paged, last_step: int, has_work: bool) -> str:
    """The step on screen: "step N of M · its kind · the semantics"."""
    return (f"step {paged.step} of {last_step} · {step_label(paged)} · {SEMANTICS_SHORT[paged.semantics]}"
            + ("" if has_work else " · all requests finished"))


def column_lines(lab, paged, contiguous, moment: dict, last_step: int, has_work: bool) -> list[tuple[str, str]]:
    """The column beside the contiguous strip, top to bottom, as (kind, text): "step N of M" first, so it stays
    on screen whatever follows; what Next event found, in one short line (``Lab.said_short_on``: the long
    form, three lines there, shrank the figures above on the same step); the numbers (``numbers``); while
    Play runs, its rate; the lab's notes."""
    out = [("caption", step_line(paged, last_step, has_work))]
    if said := lab.said_short_on(paged):
        out.append(("caption", f"**{said}.**"))
    out += [("numbers", line) for line in numbers(lab, paged, contiguous, moment)]
    if said := playing_line(lab):
        out.append(("caption", said))
    out += [("caption", note) for note in lab.run.notes]  # e.g. a request the baseline cannot admit at all
    return out


# The room kept in the column beside the strip for what Next event says (``Lab.said_short_on``), whether or not
# it is said: the figures above keep their size on the step when N answers (the block tables of one step
# dropped from 8 to 5 logical blocks when the line came, issue 24's trial). As long as its longest form.
SAID_RESERVE = "**Next event: none after step 00,000; the run has finished.**"


def sized_column(lab, paged, column: list[tuple[str, str]]) -> list[str]:
    """The column's texts the figures are sized for (``presenter_sizes``): those shown, and room for the
    line Next event may say (``SAID_RESERVE``) when it is not shown."""
    texts = [text for _, text in column]
    return texts if lab.said_short_on(paged) else texts[:1] + [SAID_RESERVE] + texts[1:]


STEADY_STATE = "steady_charts"  # session state: per stacked chart, (parity, the figure on top, its spec, below)


def steady_chart(fig, name: str, config: dict | None = None) -> None:
    """``st.plotly_chart`` for a figure that changes with every step, without a blank frame between steps.

    Streamlit gives a chart an element id hashed from its figure (even with a ``key``), the browser keys the
    chart's component by that id, and the component reads the figure only when it mounts: every new step
    mounts a new chart, which is empty (white) until plotly.js has drawn it; a speaker's trial caught the pool,
    the block tables and the strip blank on 3 of ~33 screenshots during Play. So two charts are stacked in one
    grid cell (the CSS's ``st-key-steady_*``): on top (first, so a reader of the page finds it first), the
    new step's figure under one key; below it, the previous step's under the key and id it had on top before
    (the browser keeps that chart, drawn, and moves it below), covered once the new one is drawn (its paper is
    opaque white). Measured in Chromium: the chart below is the very DOM node drawn the step before. The same figure again (a rerun with
    nothing new: the Play timer, the window's size) draws both exactly as before, so nothing mounts."""
    import plotly.io as pio

    fig.update_layout(paper_bgcolor="#FFFFFF")  # the chart on top hides the one below once drawn
    spec = pio.to_json(fig, validate=False)
    charts = st.session_state.setdefault(STEADY_STATE, {})
    last = charts.get(name)
    if last is None:
        parity, below = 0, None
    elif last[2] == spec:
        parity, fig, below = last[0], last[1], last[3]  # the very same objects: the same ids, nothing mounts
    else:
        parity, below = 1 - last[0], last[1]
        if below.layout.height != fig.layout.height:  # a taller one below would show under the new one's edge
            below = None
    charts[name] = (parity, fig, spec, below)
    with st.container(key=f"steady_{name}"):
        st.plotly_chart(fig, width="stretch", key=f"{name}_{parity}", config=config)
        if below is not None:
            st.plotly_chart(below, width="stretch", key=f"{name}_{1 - parity}", config=config)


def views(lab, history: list, index: int, has_work: bool, decode) -> None:
    """The presenter's screen for recorded step ``index`` of ``history`` (see the module docstring). A beam
    step is drawn in the lab's phase (``Lab.phase_of``): the pool, the block tables, the numbers and the
    titles all of one moment, moved by the stage's presses (a clicker's PageDown shows the selection)."""
    paged, contiguous = history[index]
    previous = history[index - 1][0] if index > 0 else None
    # "all requests finished" is of the step on screen: looking back (N ran on to the end and stayed on its
    # step), the requests running in the numbers beside it are not finished
    has_work = not finished_on(history, index, has_work)
    phase = lab.phase_of(paged)
    # the step read once for every view below (``viz.stage``: the Playground and the exports read it so too)
    step = stage_step(paged, contiguous, previous, order=lab.run.order, decode=decode, budget=lab.step_budget(),
                      final_lengths=lab.contiguous_final_lengths(), phase=phase)
    moment = step.moment
    sentences = few_sentences(step)
    column = column_lines(lab, paged, contiguous, moment, history[-1][0].step, has_work)
    vp = viewport() or {}
    # a hybrid model's run has no contiguous baseline: the numbers take the lower row, the pool row the rest
    wide_numbers = contiguous is None and bool(paged.snapshot.kv_cache_groups)
    size = presenter_sizes(vp.get("h"), vp.get("w"), sentences, sized_column(lab, paged, column),
                           numbers_full_width=wide_numbers)
    with st.container(key="present_words"):
        st.markdown(words_markdown(sentences))
    left, right = st.columns([1, 1])
    with left, st.container(key="present_pool"):
        width = vp.get("w", 1280) / 2 - 60  # the pool's column: half the window, less padding
        steady_chart(projector_pool(step, size, width), "present_pool_fig", config={"displayModeBar": False})
    with right, st.container(key="present_tables"):
        tables_width = vp.get("w", 1280) // 2 - 40  # the picture's column: half the window, less padding
        steady_chart(projector_tables(step, size, tables_width), "present_tables_fig",
                     config={"displayModeBar": False})
    if wide_numbers:  # the numbers below say why there is no baseline (the run's notes)
        low_right = st.container()
    else:
        low_left, low_right = st.columns([3, 2])
        with low_left, st.container(key="present_contiguous"):
            if contiguous is not None:
                fig = step.region_figure()
                fig.update_layout(title_text=f"contiguous baseline: {layout_line(contiguous.snapshot)}",
                                  margin={"t": 36, "b": 36})
                steady_chart(projector_style(fig, height=size["strip"], min_font=size["font"], scale=1.0),
                             "present_region_fig", config={"displayModeBar": False})
            else:
                st.info(" ".join(lab.run.notes) or "No contiguous baseline for these settings.")
    with low_right, st.container(key="present_numbers"):
        numbers_now = [text for kind, text in column if kind == "numbers"]
        for kind, text in column:
            if kind == "caption":
                st.caption(text)
            elif text is numbers_now[0]:
                st.markdown("  \n".join(numbers_now))


def playing_line(lab) -> str | None:
    """While Play runs: its speed and the rate measured since it started (``Lab.play_rate``)."""
    if not lab.player.playing or (rate := lab.play_rate()) is None:
        return None
    return (f"Playing at {lab.player.speed:g} steps per second: {rate:.1f} measured since Play started"
            + (" (the page draws every few steps to keep the pace)" if lab.player.speed > 2 else ""))


def layout_line(cs) -> str:
    """The contiguous strip's title in one line: slots used / reserved (``engine.metrics``)."""
    return f"{metrics.slots_used(cs):,} used / {metrics.slots_allocated(cs):,} reserved slots"
