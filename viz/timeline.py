"""KV utilisation and running requests over steps, paged vs contiguous (utilisation is
``engine.metrics.utilization_pct``: slots holding K/V over slots allocated or reserved, in %)."""

from __future__ import annotations

import plotly.graph_objects as go

from engine.metrics import utilization_pct

from .plain import figure

TITLES = ("KV utilisation: tokens / allocated slots (%)", "running requests")
DOMAINS = ((0.0, 0.45), (0.55, 1.0))  # the two panels side by side (make_subplots' spacing)


def timeline_figure(series: dict[str, list], current_step: int | None = None) -> go.Figure:
    """``series``: label ("paged", "contiguous", or any other name) -> list of StepRecords. Two panels side
    by side, each over the steps: utilisation (%) and running requests.

    Built as one figure dict (axes, titles and the current step's dotted lines as layout entries), not with
    ``make_subplots`` / ``add_vline``: those cost ~160 ms per redraw; the dicts, unvalidated (``viz.plain``), ~1 ms."""
    palette = {"paged": "#0072B2", "contiguous": "#D55E00"}
    data = []
    for label, records in series.items():
        steps = [r.step for r in records]
        color = palette.get(label, "#555555")
        data.append({"type": "scatter", "x": steps, "y": [utilization_pct(r.snapshot) for r in records],
                     "name": label, "line": {"color": color}, "xaxis": "x", "yaxis": "y"})
        data.append({"type": "scatter", "x": steps, "y": [len(r.snapshot.running) for r in records],
                     "name": label, "line": {"color": color}, "showlegend": False, "xaxis": "x2", "yaxis": "y2"})
    longest = max((len(r) for r in series.values()), default=0)
    most = max((len(rec.snapshot.running) for r in series.values() for rec in r), default=0)
    # whole steps and whole requests: ticks every 1 while there are few, so none repeats or falls between
    xaxis = {"title": {"text": "step"}, "tickformat": "d", **({"dtick": 1} if longest <= 12 else {})}
    layout = {
        "height": 300, "margin": {"l": 10, "r": 10, "t": 60, "b": 10},
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.12, "x": 0},
        "xaxis": {**xaxis, "domain": list(DOMAINS[0]), "anchor": "y"},
        "xaxis2": {**xaxis, "domain": list(DOMAINS[1]), "anchor": "y2"},
        "yaxis": {"rangemode": "tozero", "anchor": "x"},
        "yaxis2": {"rangemode": "tozero", "anchor": "x2", "tickformat": "d", **({"dtick": 1} if most <= 8 else {})},
        "annotations": [{"text": t, "x": sum(d) / 2, "y": 1.0, "xref": "paper", "yref": "paper",
                         "xanchor": "center", "yanchor": "bottom", "showarrow": False, "font": {"size": 16}}
                        for t, d in zip(TITLES, DOMAINS)],
        "shapes": [] if current_step is None else [
            {"type": "line", "x0": current_step, "x1": current_step, "y0": 0, "y1": 1, "xref": x, "yref": y,
             "line": {"dash": "dot", "color": "#888888"}} for x, y in (("x", "y domain"), ("x2", "y2 domain"))],
    }
    return figure(data, layout)
