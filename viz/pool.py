"""The paged block pool as one heatmap (one cell per physical block, or per slot in slot mode).

Cell colour: the owning request's colour; grey with the reference count written on it when several
sequences share the block; light grey when free but still holding a cached prefix; near-white when free.
Cell text (small pools): owner and fill "k/B". KV cache groups (a hybrid model,
``Snapshot.kv_cache_groups``): one pool for every group, each block in use held by one group at a time, so
a cell also says its group ("full" or "win", ``block_groups``) and the hover names it. Hover: block id, owners, reference count, fill, prefix-cache
hash, and the text of the tokens the block holds (``decode`` turns token ids into text).

Traces and layout are plain dicts wrapped by ``viz.plain.figure`` (no Plotly validation on the step's path:
~1 ms instead of ~20 ms a figure; tests/test_viz_plain.py validates every figure instead).
"""

from __future__ import annotations

import math
from typing import Callable

import plotly.graph_objects as go

from .colors import CACHED_FREE, FREE, OUTLINE, SELECTED, SHARED, request_color, request_id_of
from .plain import figure

TEXT_LIMIT = 512  # above this many cells the labels are left out (unreadable, and slow to draw)
FRAME_LIMIT = 64  # above this many outlined blocks, markers instead of one shape per block


def _columns(n: int) -> int:
    """A square-ish grid (cells big enough for a label in small pools), at most 64 columns."""
    return max(1, min(64, n, math.ceil(math.sqrt(n))))


def _discrete_scale(colors: list[str]) -> list[list]:
    n = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def block_tokens(snapshot) -> dict[int, list[int]]:
    """Physical block -> the token ids it holds, read from the sequences' tables (every KV cache group's)
    and tokens."""
    B = snapshot.block_size
    held: dict[int, list[int]] = {}
    for seq in snapshot.sequences:
        if seq.status != "running":
            continue
        for table in seq.group_block_tables or [seq.block_table]:
            for i, b in enumerate(table):
                if b >= 0 and b not in held:
                    held[b] = seq.token_ids[i * B:(i + 1) * B][: snapshot.fills[b]]
    return held


GROUP_TAGS = {"full_attention": "full", "sliding_window": "win"}  # a cell's group, short enough for a cell


def block_groups(snapshot) -> dict[int, int]:
    """Physical block -> the KV cache group whose tables hold it (a hybrid model's; empty without groups)."""
    groups: dict[int, int] = {}
    if not getattr(snapshot, "kv_cache_groups", None):
        return groups
    for seq in snapshot.sequences:
        if seq.status != "running":
            continue
        for g, table in enumerate(seq.group_block_tables):
            for b in table:
                if b >= 0:
                    groups.setdefault(b, g)
    return groups


def group_name(group: dict) -> str:
    """A KV cache group in words: "full attention (layers 1, 3)" / "sliding window 48 tokens (layers 0, 2)"."""
    layers = ", ".join(map(str, group["layers"]))
    if group["kind"] == "full_attention":
        return f"full attention (layers {layers})"
    return f"sliding window {group['sliding_window']} tokens (layers {layers})"


def pool_cells(snapshot, request_order: list[str], decode: Callable[[list[int]], str] | None = None) -> list[dict]:
    """One dict per physical block: id, color, label, hover fields. Pure data (tested directly)."""
    B = snapshot.block_size
    tokens = block_tokens(snapshot)
    hashes = snapshot.block_hashes or [None] * snapshot.num_blocks
    kv_groups = getattr(snapshot, "kv_cache_groups", None) or []
    held_by = block_groups(snapshot)
    cells = []
    for b in range(snapshot.num_blocks):
        owners = snapshot.owners[b]
        count = snapshot.ref_counts[b]
        fill = snapshot.fills[b]
        if count == 0:  # the block id is written on every cell, so the events' "block 7" can be found
            color = CACHED_FREE if hashes[b] else FREE
            label = f"{b}: cached" if hashes[b] else f"{b}"
        elif count > 1:
            color, label = SHARED, f"{b}: x{count}<br>{fill}/{B}"
        else:
            color, label = request_color(owners[0], request_order), f"{b}: {owners[0]}<br>{fill}/{B}"
        text = decode(tokens[b]) if decode and b in tokens else ""
        group = held_by.get(b)
        if group is not None:  # a hybrid model: the cell says which group's tables hold it
            label += f" {GROUP_TAGS[kv_groups[group]['kind']]}"
        cells.append({"block": b, "owners": owners, "ref_count": count, "fill": fill, "color": color,
                      "label": label, "hash": hashes[b] or "", "text": text, "group": group,
                      "group_name": group_name(kv_groups[group]) if group is not None else ""})
    return cells


def block_pool_figure(snapshot, request_order: list[str], decode: Callable[[list[int]], str] | None = None,
                      highlight: list[int] | None = None, selected: str | None = None,
                      slot_mode: bool = False, title: str | None = None) -> go.Figure:
    """The pool after a step.

    Args:
        snapshot: an ``engine.records.Snapshot`` (paged).
        request_order: request ids in first-seen order (fixes each request's colour).
        decode: token ids -> text, for the hover (optional).
        highlight: block ids to outline (what this step changed).
        selected: a request id whose blocks are outlined too.
        slot_mode: one row per block, one cell per token slot (small pools).
    """
    cells = pool_cells(snapshot, request_order, decode)
    B = snapshot.block_size
    colors = list(dict.fromkeys(c["color"] for c in cells)) or [FREE]
    index = {c: i for i, c in enumerate(colors)}
    if slot_mode:
        ncols, nrows = B, snapshot.num_blocks
        if FREE not in index:
            colors.append(FREE)
            index[FREE] = len(colors) - 1
        # a slot is coloured when it holds a token, else it is free space (slack or free block)
        z = [[index[cells[b]["color"]] if s < cells[b]["fill"] and cells[b]["ref_count"] else index[FREE]
              for s in range(B)] for b in range(nrows)]
        text = [["" for _ in range(B)] for _ in range(nrows)]
        custom = [[[b, ", ".join(cells[b]["owners"]) or "free", cells[b]["ref_count"], f"{cells[b]['fill']}/{B}",
                    cells[b]["hash"] or "-", cells[b]["text"], b * B + s] for s in range(B)] for b in range(nrows)]
        pos = {b: (b, None) for b in range(nrows)}
    else:
        ncols = _columns(len(cells))
        nrows = math.ceil(len(cells) / ncols)
        z = [[None] * ncols for _ in range(nrows)]
        text = [[""] * ncols for _ in range(nrows)]
        custom = [[[None] * 7 for _ in range(ncols)] for _ in range(nrows)]
        pos = {}
        show_text = len(cells) <= TEXT_LIMIT
        for c in cells:
            r, col = divmod(c["block"], ncols)
            z[r][col] = index[c["color"]]
            text[r][col] = c["label"] if show_text else ""
            custom[r][col] = [c["block"], _owners_text(c), c["ref_count"], f"{c['fill']}/{B}",
                              c["hash"] or "-", c["text"], c["block"] * B]
            pos[c["block"]] = (r, col)
    data = [{
        "type": "heatmap", "z": z, "text": text, "texttemplate": "%{text}", "customdata": custom,
        "colorscale": _discrete_scale(colors), "zmin": -0.5, "zmax": len(colors) - 0.5, "showscale": False,
        "xgap": 2, "ygap": 2,
        "hovertemplate": ("block %{customdata[0]}<br>owners: %{customdata[1]}<br>reference count: "
                          "%{customdata[2]}<br>fill: %{customdata[3]}<br>prefix hash: %{customdata[4]}"
                          "<br>tokens: %{customdata[5]}<extra></extra>"),
        "textfont": {"size": 12 if ncols <= 16 else 10},
    }]
    shapes = []
    chosen = set()
    if selected:
        chosen = {c["block"] for c in cells if any(request_id_of(o) == selected for o in c["owners"])}
    for blocks, color in ((chosen, SELECTED), (set(highlight or []), OUTLINE)):
        # a frame around each block (its cell, or in slot mode its row of slots), scaled with the figure; past
        # FRAME_LIMIT frames (a big prefill in a big pool) one trace of open squares is lighter to send and draw
        pts = [pos[b] for b in sorted(blocks) if b in pos]
        if len(pts) > FRAME_LIMIT and not slot_mode:
            data.append({"type": "scatter", "x": [p[1] for p in pts], "y": [p[0] for p in pts], "mode": "markers",
                         "hoverinfo": "skip", "showlegend": False,
                         "marker": {"symbol": "square-open", "size": 7, "color": color,
                                    "line": {"width": 2, "color": color}}})
            continue
        for row, col in pts:
            x0, x1 = (-0.5, B - 0.5) if slot_mode else (col - 0.5, col + 0.5)
            shapes.append({"type": "rect", "x0": x0, "x1": x1, "y0": row - 0.5, "y1": row + 0.5,
                           "line": {"color": color, "width": 3}})
    legend = _group_key(data, cells, pos, getattr(snapshot, "kv_cache_groups", None) or [], slot_mode, B)
    yaxis = {"visible": False, "autorange": "reversed"}
    if slot_mode:  # one row per block: name each row after its block, owners and reference count
        yaxis = {"autorange": "reversed", "tickmode": "array", "tickvals": list(range(nrows)), "showgrid": False,
                 "zeroline": False, "ticktext": [_row_label(c) for c in cells], "tickfont": {"size": 13}}
    title = title or f"{snapshot.num_blocks - snapshot.num_free_blocks}/{snapshot.num_blocks} blocks in use"
    layout = {
        "title": {"text": title},
        "margin": {"l": 10, "r": 10, "t": 40 + 22 * title.count("<br>"), "b": 10},  # room for a title's 2nd line
        "height": max(220, min(640, (34 if slot_mode else 48) * nrows + 60)), "xaxis": {"visible": False},
        "yaxis": yaxis, "plot_bgcolor": "white",
    }
    if shapes:  # only when framed: an empty list would still be sent to the browser with every step
        layout["shapes"] = shapes
    if legend:  # a hybrid model: the key to the groups' patterns, under the cells
        layout.update(showlegend=True, legend={"orientation": "h", "x": 0, "xanchor": "left", "y": -0.02,
                                               "yanchor": "top", "font": {"size": 12}})
        layout["margin"]["b"] = 34
    return figure(data, layout)


# A KV cache group's pattern over its blocks' cells (the request's colour stays beneath): plain for full
# attention, hatching for a sliding window (one hatch per sliding group, in group order). Readable without
# hover, in greyscale and on a projector; the key names each group.
GROUP_HATCHES = ["/", "x", "\\", "."]


def _group_key(data: list, cells: list[dict], pos: dict, groups: list[dict], slot_mode: bool, B: int) -> bool:
    """With KV cache groups, append to ``data`` one trace per group: a sliding group's cells hatched (a
    filled outline per cell, ``fillpattern``; no hover, the heatmap's answers), a full group's an empty
    legend entry ("plain"), each named for the key ("hatched: window 48 (layers 0, 2)"). Returns whether any was added."""
    if not groups:
        return False
    sliding = 0
    for g, group in enumerate(groups):
        layers = ", ".join(map(str, group["layers"]))
        name = (f"window {group['sliding_window']} (layers {layers})" if group["kind"] == "sliding_window"
                else f"full attention (layers {layers})")
        trace = {"type": "scatter", "mode": "lines", "hoverinfo": "skip", "showlegend": True, "fill": "toself",
                 "line": {"width": 0.5, "color": "#333333"}, "meta": {"role": "kv_group", "group": g}}
        if group["kind"] != "sliding_window":
            data.append({**trace, "x": [None], "y": [None], "name": f"\u25a0 plain: {name}",
                         "fillcolor": "rgba(0,0,0,0)"})
            continue
        hatch = GROUP_HATCHES[sliding % len(GROUP_HATCHES)]
        sliding += 1
        xs, ys = [], []
        for c in cells:
            if c["group"] != g or c["block"] not in pos:
                continue
            row, col = pos[c["block"]]
            x0, x1 = (-0.5, B - 0.5) if slot_mode else (col - 0.5, col + 0.5)
            xs += [x0 + 0.04, x1 - 0.04, x1 - 0.04, x0 + 0.04, x0 + 0.04, None]
            ys += [row - 0.42, row - 0.42, row + 0.42, row + 0.42, row - 0.42, None]
        data.append({**trace, "x": xs or [None], "y": ys or [None], "name": f"\u25a8 hatched: {name}",
                     "fillcolor": "rgba(0,0,0,0)",
                     "fillpattern": {"shape": hatch, "fgcolor": "rgba(0,0,0,0.5)", "bgcolor": "rgba(0,0,0,0)",
                                     "size": 12, "solidity": 0.12}})
    return True


def _owners_text(cell: dict) -> str:
    """The hover's owners: the sequences, and with KV cache groups the group whose tables hold the block."""
    owners = ", ".join(cell["owners"]) or "free"
    return f"{owners} (KV cache group {cell['group']}: {cell['group_name']})" if cell.get("group") is not None else owners


def _row_label(cell: dict) -> str:
    """``block 2: A`` / ``block 0: A,B x2`` / ``block 5: free``."""
    if cell["ref_count"] == 0:
        return f"block {cell['block']}: {'cached' if cell['hash'] else 'free'}"
    count = f" x{cell['ref_count']}" if cell["ref_count"] > 1 else ""
    return f"block {cell['block']}: {','.join(cell['owners'])}{count}"


def block_table_rows(snapshot, decode: Callable[[list[int]], str] | None = None) -> list[dict]:
    """One row per live sequence: its logical -> physical table, tokens held and status."""
    rows = []
    for seq in snapshot.sequences:
        swapped = seq.status == "swapped"  # its table lists CPU swap-pool blocks, not GPU blocks
        rows.append({
            "sequence": seq.seq_id,
            "status": f"swapped ({seq.num_tokens} tokens' K/V in the CPU swap pool)" if swapped else seq.status,
            "tokens in pool": 0 if swapped else seq.num_tokens,
            "block table (logical -> physical)": ("(freed) " if seq.status == "finished" else "") + " ".join(
                f"{i}->{'cpu' if swapped else ''}{b}" for i, b in enumerate(seq.block_table)),
            "text": decode(seq.token_ids[seq.prompt_len:]) if decode else "",
        })
    return rows


def swap_pool_figure(snapshot, request_order: list[str]) -> go.Figure:
    """The CPU swap pool as a strip: a cell per swap block, coloured by the swapped request that holds it."""
    n = snapshot.num_swap_blocks
    colors_of = [FREE] * n
    for seq in snapshot.sequences:
        if seq.status == "swapped":
            for c in seq.block_table:  # while swapped, the table lists swap-pool blocks
                colors_of[c] = request_color(seq.seq_id, request_order)
    colors = list(dict.fromkeys(colors_of)) or [FREE]
    index = {c: i for i, c in enumerate(colors)}
    cols = max(1, min(64, n))
    rows = max(1, math.ceil(n / cols))
    z = [[None] * cols for _ in range(rows)]
    for c, color in enumerate(colors_of):
        z[c // cols][c % cols] = index[color]
    data = [{"type": "heatmap", "z": z, "colorscale": _discrete_scale(colors), "zmin": -0.5,
             "zmax": len(colors) - 0.5, "showscale": False, "xgap": 1, "ygap": 1, "hoverinfo": "skip"}]
    used = n - snapshot.num_free_swap_blocks
    layout = {"title": {"text": f"CPU swap pool: {used}/{n} blocks in use", "font": {"size": 13}},
              "height": 60 + 14 * rows, "margin": {"l": 10, "r": 10, "t": 36, "b": 6},
              "xaxis": {"visible": False}, "yaxis": {"visible": False, "autorange": "reversed"},
              "plot_bgcolor": "white"}
    return figure(data, layout)
