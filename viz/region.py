"""Slot-level strips on one scale: the contiguous baseline's region and the paged pool's slots.

Both memories hold the same number of token slots (the same bytes), so drawing both as strips of equally
many cells, each cell standing for the same number of slots, compares them fairly. Categories:
- contiguous: used by a request (its colour), reserved but not yet used (light grey), free slots in gaps too
  small for one reservation although together they would hold one (external fragmentation, orange), free
  (near-white);
- paged: used (the owner's colour), last-block slack (light grey), free (near-white).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import plotly.graph_objects as go

from engine.metrics import internal_fragmentation, slack_pct, slots_allocated, slots_used

from .colors import EXTERNAL, FREE, INTERNAL, SHARED, SLACK, request_color
from .pool import _discrete_scale

MAX_CELLS = 2048  # cells drawn per strip; above this each cell stands for several slots (majority wins)


def region_cells(layout: dict, request_order: list[str], final_lengths: dict[str, int] | None = None) -> list[str]:
    """Colour of every slot of a contiguous region layout (``Snapshot.contiguous``).

    ``final_lengths`` (sequence id -> tokens it will hold when it finishes), known only with hindsight,
    splits a reservation's unused slots into "reserved, not yet used" (up to the final length, light grey)
    and internal fragmentation (past it, never used; brown). Without it all unused slots are light grey.
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
        final = _final_length(r, final_lengths)
        slots[start:start + used] = [color] * used
        slots[start + used:start + final] = [SLACK] * (final - used)
        slots[start + final:start + length] = [INTERNAL] * internal_fragmentation(length, final)
    return slots


def _final_length(region: dict, final_lengths: dict[str, int] | None) -> int:
    """A live reservation's final length as far as it is known: the given one (never below the slots already
    written, never past the reservation), else the whole reservation (nothing is called internal yet)."""
    length = region["length"]
    return min(length, max(region["used"], (final_lengths or {}).get(region["seq_id"], length)))


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


def _strip(slots: list[str], title: str, hover_unit: str) -> go.Figure:
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
    fig = go.Figure(go.Heatmap(z=z, customdata=custom, colorscale=_discrete_scale(colors), zmin=-0.5,
                               zmax=len(colors) - 0.5, showscale=False, xgap=1, ygap=1,
                               hovertemplate="%{customdata}<extra></extra>"))
    title += f"<br>one cell = {per_cell} slots" if per_cell > 1 else "<br>one cell = one slot"
    fig.update_layout(title={"text": title, "font": {"size": 14}}, margin={"l": 10, "r": 10, "t": 76, "b": 10},
                      height=max(160, min(480, 14 * rows + 60)), xaxis={"visible": False},
                      yaxis={"visible": False, "autorange": "reversed"}, plot_bgcolor="white")
    return fig


def contiguous_region_figure(layout: dict, request_order: list[str],
                             final_lengths: dict[str, int] | None = None) -> go.Figure:
    """The contiguous region as a strip of slots; see ``region_cells`` for ``final_lengths``.

    The title's numbers are ``engine.metrics``'s (slots used and reserved, slack %) and the layout's own
    fields (external fragmentation, internal fragmentation of released reservations); with
    ``final_lengths`` the live reservations' slots split into not yet used and internal fragmentation
    (``metrics.internal_fragmentation`` of each reservation at its final length)."""
    snap = _as_snapshot(layout)
    used, reserved = slots_used(snap), slots_allocated(snap)
    if final_lengths is None:
        detail = (f"external fragmentation {layout['external_frag_slots']:,}, internal so far "
                  f"{layout['internal_frag_slots']:,} slots")
    else:
        finals = [(r, _final_length(r, final_lengths)) for r in layout["regions"]]
        not_yet = sum(final - r["used"] for r, final in finals)
        internal = sum(internal_fragmentation(r["length"], final) for r, final in finals)
        detail = (f"not yet used {not_yet:,}, internal {internal:,}, "
                  f"external {layout['external_frag_slots']:,} slots")
    title = f"contiguous: {used:,} used / {reserved:,} reserved ({slack_pct(snap):.1f}% unused)<br>{detail}"
    return _strip(region_cells(layout, request_order, final_lengths), title, "slots")


def paged_slots_figure(snapshot, request_order: list[str]) -> go.Figure:
    """The paged pool as a strip of slots; the title's numbers are ``engine.metrics``'s."""
    title = (f"paged: {slots_used(snapshot):,} used / {slots_allocated(snapshot):,} allocated<br>"
             f"({slack_pct(snapshot):.1f}% last-block slack)")
    return _strip(paged_slot_cells(snapshot, request_order), title, "slots")
