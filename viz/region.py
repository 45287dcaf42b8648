"""Slot-level strips on one scale: the contiguous baseline's region and the paged pool's slots.

Both memories hold the same number of token slots (the same bytes), so drawing both as strips of equally
many cells, each cell standing for the same number of slots, compares them fairly. Categories:
- contiguous: used by a sequence (its request's colour) and the three kinds of waste, each in its own colour
  (``viz.colors``), with a legend always on the figure giving each kind's slots now
  (``engine.metrics.contiguous_waste_now``, a kind at 0 still listed):
  reserved but not yet used (pale purple: a running sequence's future slots, and a request's spare rows
  for samples or beams not forked yet), internal fragmentation (dark brown: slots of a running row past its
  known final length, drawn only when final lengths are known; a finished request's reservation is
  released at its finish, so its internal fragmentation leaves the strip then and is counted in the title
  as "released"), external fragmentation (light orange: free slots in gaps too small for the next
  reservation although together they would hold it), free (near-white);
- paged: used (the owner's colour), last-block slack (light grey), free (near-white).

Traces and layout are plain dicts wrapped by ``viz.plain.figure`` (no Plotly validation on the step's path:
~1 ms instead of ~15-20 ms a strip; tests/test_viz_plain.py validates every figure instead).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import plotly.graph_objects as go

from engine.metrics import (contiguous_waste_now, internal_fragmentation, row_final_length, slack_pct,
                            slots_allocated, slots_used)

from .colors import EXTERNAL, FREE, INTERNAL, RESERVED, SHARED, SLACK, request_color
from .plain import figure
from .pool import _discrete_scale

MAX_CELLS = 2048  # cells drawn per strip; above this each cell stands for several slots (majority wins)


def region_cells(layout: dict, request_order: list[str], final_lengths: dict[str, int] | None = None) -> list[str]:
    """Colour of every slot of a contiguous region layout (``Snapshot.contiguous``).

    ``final_lengths`` (sequence id -> tokens it will hold when it finishes), known only with hindsight,
    splits a row's unused slots into reserved, not yet used (up to the final length, ``RESERVED``) and
    internal fragmentation (past it, never used; ``INTERNAL``). Without it all unused slots are
    ``RESERVED``. Spare rows (a request's rows for samples or beams not forked yet) are ``RESERVED`` whole.
    Per colour, the cells equal ``engine.metrics.contiguous_waste_now``'s counts.
    """
    cap = layout["capacity_slots"]
    slots = [FREE] * cap
    # gaps too small for a reservation are external fragmentation only when the free slots together would
    # hold one (the allocator's external_frag_slots); otherwise the region is simply full
    if layout.get("external_frag_slots", 0):
        need = layout.get("external_frag_need") or layout["reservation"]
        for g in layout["gaps"]:
            if g["length"] < need:
                slots[g["start"]:g["start"] + g["length"]] = [EXTERNAL] * g["length"]
    for r in layout["regions"]:
        color = request_color(r["seq_id"], request_order)
        start, used, length = r["start"], r["used"], r["length"]
        final = row_final_length(r, final_lengths)
        slots[start:start + used] = [color] * used
        slots[start + used:start + final] = [RESERVED] * (final - used)
        slots[start + final:start + length] = [INTERNAL] * internal_fragmentation(length, final)
    return slots


def _as_snapshot(layout: dict):
    """A contiguous layout seen as the snapshot ``engine.metrics`` reads (its ``contiguous`` field)."""
    return SimpleNamespace(contiguous=layout)


def paged_slot_cells(snapshot, request_order: list[str]) -> list[str]:
    """Colour of every slot of a paged pool: used (owner or shared), last-block slack, free."""
    B = snapshot.block_size
    slots = []
    for b in range(snapshot.num_blocks):
        count, fill = snapshot.ref_counts[b], snapshot.fills[b]
        if count == 0:
            slots += [FREE] * B
            continue
        color = SHARED if count > 1 else request_color(snapshot.owners[b][0], request_order)
        slots += [color] * fill + [SLACK] * (B - fill)
    return slots


def _strip(slots: list[str], title: str, hover_unit: str) -> tuple[list[dict], dict]:
    """The strip of ``slots`` (one colour per slot) as ``(data, layout)`` dicts for ``viz.plain.figure``: at most
    ``MAX_CELLS`` cells of ``ceil(len(slots) / MAX_CELLS)`` slots each (a cell takes its slots' most common
    colour), 64 to a row; the title gets a last line naming the slots per cell."""
    n = len(slots)
    per_cell = max(1, math.ceil(n / MAX_CELLS))
    cells = []
    for i in range(0, n, per_cell):
        chunk = slots[i:i + per_cell]
        cells.append(max(set(chunk), key=chunk.count))
    cols = min(64, len(cells))
    rows = math.ceil(len(cells) / cols)
    colors = list(dict.fromkeys(cells))
    index = {c: k for k, c in enumerate(colors)}
    z = [[None] * cols for _ in range(rows)]
    custom = [[""] * cols for _ in range(rows)]
    for k, c in enumerate(cells):
        r, col = divmod(k, cols)
        z[r][col] = index[c]
        custom[r][col] = f"{hover_unit} {k * per_cell:,}..{min(n, (k + 1) * per_cell) - 1:,}"
    data = [{"type": "heatmap", "z": z, "customdata": custom, "colorscale": _discrete_scale(colors), "zmin": -0.5,
             "zmax": len(colors) - 0.5, "showscale": False, "xgap": 1, "ygap": 1,
             "hovertemplate": "%{customdata}<extra></extra>"}]
    title += f"<br>one cell = {per_cell} slots" if per_cell > 1 else "<br>one cell = one slot"
    layout = {"title": {"text": title, "font": {"size": 14}}, "margin": {"l": 10, "r": 10, "t": 76, "b": 10},
              "height": max(160, min(480, 14 * rows + 60)), "xaxis": {"visible": False},
              "yaxis": {"visible": False, "autorange": "reversed"}, "plot_bgcolor": "white"}
    return data, layout


WASTE_LEGEND = (("reserved_not_yet_used", RESERVED, "reserved, not yet used"),
                ("internal", INTERNAL, "internal fragmentation"),
                ("external", EXTERNAL, "external fragmentation"))


def waste_legend_labels(layout: dict, final_lengths: dict[str, int] | None = None) -> list[str]:
    """The legend's three entries, "<kind>: N slots", with the counts of ``metrics.contiguous_waste_now``."""
    waste = contiguous_waste_now(layout, final_lengths)
    return [f"{label}: {waste[key]:,} slot{'s' * (waste[key] != 1)}" for key, _, label in WASTE_LEGEND]


def contiguous_region_figure(layout: dict, request_order: list[str],
                             final_lengths: dict[str, int] | None = None) -> go.Figure:
    """The contiguous region as a strip of slots; see ``region_cells`` for ``final_lengths``.

    The title's numbers are ``engine.metrics``'s (slots used and reserved, slack %) and the internal
    fragmentation of reservations released so far (the layout's ``internal_frag_slots``). The legend, always
    shown, has one entry per kind of waste with its slots now (``waste_legend_labels``), also when 0."""
    snap = _as_snapshot(layout)
    used, reserved = slots_used(snap), slots_allocated(snap)
    title = (f"contiguous: {used:,} used / {reserved:,} reserved ({slack_pct(snap):.1f}% unused)<br>"
             f"internal fragmentation of released reservations so far: {layout['internal_frag_slots']:,} slots")
    data, fig_layout = _strip(region_cells(layout, request_order, final_lengths), title, "slots")
    for (_, color, _), label in zip(WASTE_LEGEND, waste_legend_labels(layout, final_lengths)):
        # a legend entry per kind, drawn as a square swatch by a trace with no point on the strip
        data.append({"type": "scatter", "x": [None], "y": [None], "mode": "markers", "name": label,
                     "showlegend": True, "hoverinfo": "skip",
                     "marker": {"symbol": "square", "size": 12, "color": color,
                                "line": {"color": "#7F7F7F", "width": 1}}})
    fig_layout.update(showlegend=True, legend={"orientation": "h", "yanchor": "top", "y": -0.02, "x": 0,
                                               "font": {"size": 12}},
                      margin={"l": 10, "r": 10, "t": 76, "b": 40},  # room below the strip for the legend
                      height=fig_layout["height"] + 30)
    return figure(data, fig_layout)


def paged_slots_figure(snapshot, request_order: list[str]) -> go.Figure:
    """The paged pool as a strip of slots; the title's numbers are ``engine.metrics``'s."""
    title = (f"paged: {slots_used(snapshot):,} used / {slots_allocated(snapshot):,} allocated<br>"
             f"({slack_pct(snapshot):.1f}% last-block slack)")
    return figure(*_strip(paged_slot_cells(snapshot, request_order), title, "slots"))
