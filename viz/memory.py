"""How one GPU's memory divides up (lesson 1): a single horizontal stacked bar, bytes shown in GB."""

from __future__ import annotations

import plotly.graph_objects as go

PARTS = {"weights": "#0072B2", "KV cache": "#009E73", "not used by the server": "#BDBDBD"}


def gpu_memory_figure(parts: dict[str, int], title: str) -> go.Figure:
    """``parts``: label -> bytes, drawn left to right (labels from ``PARTS`` get their colours)."""
    fig = go.Figure()
    for label, n in parts.items():
        fig.add_trace(go.Bar(x=[n / 1e9], y=[""], orientation="h", name=label,
                             marker={"color": PARTS.get(label, "#E69F00")},
                             text=[f"{label}<br>{n / 1e9:,.1f} GB"], textposition="inside",
                             hovertemplate=f"{label}: %{{x:,.2f}} GB<extra></extra>"))
    fig.update_layout(barmode="stack", title={"text": title, "font": {"size": 14}}, height=170, showlegend=False,
                      margin={"l": 10, "r": 10, "t": 40, "b": 30}, xaxis={"title": "GB (10^9 bytes)"},
                      plot_bgcolor="white")
    return fig
