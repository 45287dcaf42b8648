"""KV utilisation and running requests over steps, paged vs contiguous (utilisation is
``engine.metrics.utilization_pct``: slots holding K/V over slots allocated or reserved, in %)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.metrics import utilization_pct


def timeline_figure(series: dict[str, list], current_step: int | None = None) -> go.Figure:
    """``series``: label ("paged", "contiguous", or any other name) -> list of StepRecords. Two panels sharing
    the x axis."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KV utilisation: tokens / allocated slots (%)", "running requests"))
    palette = {"paged": "#0072B2", "contiguous": "#D55E00"}
    for label, records in series.items():
        steps = [r.step for r in records]
        color = palette.get(label, "#555555")
        fig.add_trace(go.Scatter(x=steps, y=[utilization_pct(r.snapshot) for r in records], name=label,
                                 line={"color": color}), row=1, col=1)
        fig.add_trace(go.Scatter(x=steps, y=[len(r.snapshot.running) for r in records], name=label,
                                 line={"color": color}, showlegend=False), row=1, col=2)
    if current_step is not None:
        for col in (1, 2):
            fig.add_vline(x=current_step, line={"dash": "dot", "color": "#888888"}, row=1, col=col)
    longest = max((len(r) for r in series.values()), default=0)
    most = max((len(rec.snapshot.running) for r in series.values() for rec in r), default=0)
    # whole steps and whole requests: ticks every 1 while there are few, so none repeats or falls between
    fig.update_xaxes(title_text="step", tickformat="d", dtick=1 if longest <= 12 else None)
    fig.update_yaxes(rangemode="tozero")
    fig.update_yaxes(tickformat="d", dtick=1 if most <= 8 else None, row=1, col=2)
    fig.update_layout(height=300, margin={"l": 10, "r": 10, "t": 60, "b": 10},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.12, "x": 0})
    return fig
