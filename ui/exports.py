"""The Playground's "Export" expander: the recorded run as one interactive HTML file, as a GIF or MP4 for slides,
and the step on screen as PNG (the figures and the encoding are ``viz.export``'s; this module only asks).

Nothing heavy runs on a script run that did not ask for it (the Playground reruns on every Play tick): the HTML
is built when its download button is clicked (Streamlit's deferred ``data`` callable, on a thread of its own);
GIF, MP4 and PNG are built when their "Build" button is clicked, with a progress line in ``st.status``. Each
file is kept per (lab token, steps recorded, what): a second click on the same run hands over the same bytes,
and a run that has moved on (a new step, Reset) builds afresh.
"""

from __future__ import annotations

import streamlit as st

from ui.state import shared_model
from viz.export import (MAX_HTML_STEPS, MAX_VIDEO_STEPS, ExportError, chromium_path, figure_png, run_gif, run_html,
                        run_mp4, step_figure)

CACHE_KEY = "export_files"  # session state: {(lab token, steps recorded, what): bytes or str}
FPS_CHOICES = (0.5, 1.0, 2.0, 4.0)


def _cache(lab, total: int) -> dict:
    """This session's built files, of this run as recorded now only (an older run's are let go); the dict
    itself is handed to the HTML download's thread, which has no session state."""
    cache = st.session_state.setdefault(CACHE_KEY, {})
    for old in [k for k in cache if k[:2] != (lab.protocol.token, total)]:
        cache.pop(old, None)
    return cache


def _budget(lab) -> int | None:
    """vLLM V1's token budget per step, for the sentences (None in the paper's semantics)."""
    return lab.run.paged.max_num_batched_tokens if lab.run.paged.semantics == "v1" else None


def _title(lab) -> str:
    return f"Paged Attention Lab: preset {lab.run.settings.preset}"


def _name(lab, total: int, ext: str, step: int | None = None) -> str:
    at = f"-step{step}" if step is not None else f"-{total}steps"
    return f"paged-attention-{lab.run.settings.preset}{at}.{ext}"


def html_builder(lab, history, cache: dict, decode=None):
    """The deferred ``data`` of the HTML download: builds the page once per (lab, steps) when clicked."""
    key = (lab.protocol.token, len(history), "html")

    def build() -> str:
        if key not in cache:
            cache[key] = run_html(history, lab.run.order, decode=decode, budget=_budget(lab), title=_title(lab))
        return cache[key]

    return build


OPEN_KEY = "export_open"  # the Export expander's open state (session state)


def export_panel(lab) -> None:
    """The "Export" expander under the Playground's views, for the run recorded so far (``Lab.frame``)."""
    history, index, _ = lab.frame()
    if not history:
        return
    total = len(history)
    cache = _cache(lab, total)
    # drawn only while open (a lazy expander: its open state reruns the page): its widgets cost every step
    panel = st.expander("Export: this run as HTML, GIF or MP4; this step as PNG", key=OPEN_KEY, on_change="rerun")
    if not panel.open:
        return
    with panel:
        decode = shared_model(lab.run.settings.model)[1].decode
        shown = min(total, MAX_HTML_STEPS)
        st.download_button(
            f"Download the run as HTML ({total} steps{'' if shown == total else f', {shown} shown'})",
            data=html_builder(lab, history, cache, decode), file_name=_name(lab, total, "html"),
            mime="text/html", on_click="ignore", icon=":material/download:", key="export_html",
            help="One self-contained file (plotly.js inside, ~5 MB and more with each step): open it from disk, "
                 "offline, and press Play or drag the slider. Built when you click (a few seconds, up to a minute "
                 f"for a long run); runs longer than {MAX_HTML_STEPS} steps are sampled evenly.")
        st.caption("GIF / MP4 / PNG are drawn by kaleido in a headless Chromium "
                   f"({chromium_path() or 'none found: set BROWSER_PATH'}); each takes a few seconds to start.")
        c1, c2, c3 = st.columns(3)
        fps = c1.select_slider("Steps per second", FPS_CHOICES, value=1.0, key="export_fps")
        cap = c2.number_input("At most this many steps", min_value=2, max_value=MAX_VIDEO_STEPS,
                              value=min(MAX_VIDEO_STEPS, max(2, total)), step=10, key="export_cap",
                              help="A longer run is sampled evenly (first and last step kept); about 0.3 s a step "
                                   "to draw.")
        kind = c3.radio("Video", ("GIF", "MP4"), horizontal=True, key="export_kind")
        _video(lab, history, cache, kind, fps, int(cap))
        _png(lab, history, index, cache)


def _video(lab, history, cache: dict, kind: str, fps: float, cap: int) -> None:
    total = len(history)
    key = (lab.protocol.token, total, kind, fps, cap)
    if st.button(f"Build {kind} ({min(total, cap)} frames)", key="export_build_video"):
        with st.status(f"Drawing {min(total, cap)} steps for the {kind}...", expanded=True) as status:
            bar = st.progress(0.0)
            encode = run_gif if kind == "GIF" else run_mp4
            try:
                cache[key] = encode(history, lab.run.order, budget=_budget(lab), title=_title(lab), fps=fps, max_steps=cap,
                                    on_frame=lambda done, n: bar.progress(done / n, f"step {done} of {n}"))
            except (ExportError, ValueError) as exc:
                status.update(label=f"{kind} not built", state="error")
                st.error(str(exc))
                return
            status.update(label=f"{kind} ready: {len(cache[key]) / 2**20:.1f} MiB", state="complete", expanded=False)
    if key in cache:
        ext = kind.lower()
        st.download_button(f"Download the {kind}", cache[key], file_name=_name(lab, total, ext),
                           mime="image/gif" if kind == "GIF" else "video/mp4", on_click="ignore",
                           icon=":material/download:", key="export_video_download")


def _png(lab, history, index: int, cache: dict) -> None:
    step = history[index][0].step
    key = (lab.protocol.token, len(history), "png", index)
    if st.button(f"Build a PNG of step {step} (the step on screen)", key="export_build_png"):
        with st.status(f"Drawing step {step}...") as status:
            try:
                cache[key] = figure_png(step_figure(history, index, lab.run.order, budget=_budget(lab), title=_title(lab)))
            except ExportError as exc:
                status.update(label="PNG not built", state="error")
                st.error(str(exc))
                return
            status.update(label=f"PNG of step {step} ready", state="complete")
    if key in cache:
        st.download_button(f"Download the PNG of step {step}", cache[key], file_name=_name(lab, 0, "png", step),
                           mime="image/png", on_click="ignore", icon=":material/download:", key="export_png_download")
