"""The Class page's histogram of predictions: one bar per choice predicted, the right one marked after the
reveal. A pure function of the counts (``ui.class_room_state.ClassView.counts``): no Streamlit, no torch."""

from __future__ import annotations

import plotly.graph_objects as go

from .colors import OKABE_ITO, SHARED

RIGHT = OKABE_ITO[2]   # bluish green: the right answer's bar
OTHER = SHARED         # grey: every other bar (before the reveal, every bar)


def predictions_figure(counts: dict[str, int], answer: str | None = None, title: str = "") -> go.Figure:
    """Bars of ``counts`` (choice -> students who predicted it, in the order given); with ``answer`` (the
    right choice) its bar is green and labelled "right answer", the others grey. Y axis: students."""
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
    return fig
