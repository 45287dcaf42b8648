"""The Class page's histogram of predictions: one bar per choice predicted, the right one marked after the
reveal. A pure function of the counts (``ui.class_room_state.ClassView.counts``): no Streamlit, no torch."""

from __future__ import annotations

import plotly.graph_objects as go

from .colors import OKABE_ITO, SHARED

RIGHT = OKABE_ITO[2]   # bluish green: the right answer's bar
OTHER = SHARED         # grey: every other bar (before the reveal, every bar)


def predictions_figure(counts: dict[str, int], answer: str | None = None, title: str = "",
                       font_px: int | None = None) -> go.Figure:
    """Bars of ``counts`` (choice -> students who predicted it, in the order given); with ``answer`` (the
    right choice) its bar is green and labelled "right answer", the others grey. Y axis: students.

    ``font_px``: every text of the figure (bar labels, ticks, axis titles, title) at least this many px, and
    the figure and its margins grown to fit it (the Class page's projector view: 18 px at 720 lines, 27 at
    1080, ``viz.presenter.presenter_sizes``); None: Plotly's own sizes (12 px). Raises ValueError for a
    ``font_px`` that is not a positive number of pixels."""
    if font_px is not None and (isinstance(font_px, bool) or not isinstance(font_px, int) or font_px <= 0):
        raise ValueError(f"font_px must be a positive number of pixels, got {font_px!r}")
    choices = list(counts)
    colors = [RIGHT if c == answer else OTHER for c in choices]
    text = [f"{counts[c]} (right answer)" if c == answer else str(counts[c]) for c in choices]
    fig = go.Figure(go.Bar(x=choices, y=[counts[c] for c in choices], marker_color=colors,
                           text=text, textposition="outside", cliponaxis=False,
                           hovertemplate="%{x}: %{y} student(s)<extra></extra>"))
    fig.update_layout(title=title, height=320, margin=dict(l=40, r=10, t=50 if title else 20, b=40),
                      yaxis=dict(title="students", rangemode="tozero", dtick=1 if max(counts.values(), default=0) <= 10 else None),
                      xaxis=dict(type="category", categoryorder="trace"),  # "3", "12": categories, in order
                      showlegend=False, plot_bgcolor="white")
    if font_px is not None:
        f = font_px
        fig.update_traces(textfont_size=f, outsidetextfont_size=f)
        fig.update_layout(font_size=f, title_font_size=round(f * 1.2), hoverlabel_font_size=f,
                          height=max(320, f * 16),
                          margin=dict(l=round(f * 3.2), r=10, t=round(f * 3.2) if title else round(f * 2), b=round(f * 2.6)),
                          xaxis_tickfont_size=f, yaxis_tickfont_size=f, xaxis_title_font_size=f,
                          yaxis_title_font_size=f, uniformtext_minsize=f, uniformtext_mode="show")
    return fig
