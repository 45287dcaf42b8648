"""The block-table picture: each sequence's logical blocks in a row, an arrow from each to its physical block.

Left, one row per sequence (its id after a square of its request's colour); its logical blocks L0..Lk are
boxes, each showing the physical block it maps to. Right, the physical blocks those tables reference, in
one column ordered so arrows rarely cross (``_order_physical``: each block at the mean row of its users,
then ``_nest_rows``), folded in two when it does not fit (the second half offset by half a pitch, arrows into
it running level through the gaps of the first), each labelled ``id xcount`` with its reference count; a block shared
by several tables is grey (``colors.SHARED``, as in the pool) and receives several arrows. What the step
changed is outlined black (the pool's outline): blocks it allocated (less the ones a prefix-cache hit
reused), took for a new token, copied to (copy-on-write) or swapped in. A copy-on-write this step is drawn as
its old arrow (dotted, to ``src``) next to the new one (to ``dst``), with a note "copy-on-write: R1.0 block
1 -> 2" under the figure. Picking a token (sequence, position) outlines in magenta (``colors.SELECTED``) its
logical block, physical block and the arrow between them, marks its offset in both boxes and says, in one
line, ``logical block = t // B``, ``offset = t % B``, ``slot = physical x B + offset`` -- the engine's slot
mapping (``engine/block_manager.py``: a slot indexes the flattened pool ``[num_blocks * B, ...]``; Kwon et
al., SOSP 2023, section 4.1).

Geometry: y is in pixels (rows and boxes sized from ``font_px``: 14 in the Playground, the presenter's 18-27
px), labels near-black (``colors.TEXT``, contrast >= 4.5:1 on every tint); x is in logical-block widths. The figure is sized for the
Playground beside the pool at 1280x720 and 1920x1080: up to ``max_rows`` sequences (8) and ``max_blocks``
logical blocks (16) are drawn, 300-420 px high; past that the highlighted request's rows come first, the
first logical blocks and the last ones are drawn (and the picked token's), and the title says what is left
out.

``block_table_picture`` is the pure data (rows, physical boxes, arrows, outlines, notes; tested directly);
``block_table_figure`` draws it. Pure: plotly only. The traces and the layout are written as plain dicts and
wrapped by ``viz.plain.figure`` (no Plotly validation on the step's path: ~47 ms -> ~2-3 ms a figure at step
12 of the "batch" preset on the 2-core dev machine, see ``viz/plain.py``); tests/test_viz_plain.py validates the
figure of every preset.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from typing import Callable

import plotly.graph_objects as go

from engine.records import NULL_BLOCK, blocks_new_in_tables, shown_group

from .colors import FREE, OUTLINE, SELECTED, SHARED, TEXT, request_color, request_id_of
from .plain import figure

CHANGED = OUTLINE  # outline of what a step changed: the pool's (viz/pool.py)
NULL_LINE = "#8a8a8a"  # the border of a null entry (a block a sliding window gave back): no request's colour
FONT_PX = 14         # smallest text on the figure in the Playground (the presenter passes its own, 18-27 px)
ROW_PX, ROW_PX_COMPACT = 38, 34  # one sequence's row at 14 px (rows grow with the font)
MIN_PLOT_PX = 230    # plot area at least this high, so a small preset is not a sliver (height ~ 300 px)
MAX_PLOT_PX, MAX_PLOT_PX_COMPACT = 348, 280  # plot area at most this high (the figure <= ~420 / ~360 px)
CAPTION_CHARS = 72   # a caption line wraps here (~7 px a character at 14 px: fits half of a 1280 px screen)
LOGICAL_W, PHYS_W = 0.8, 1.8     # box widths, in logical-block widths
ARROW_GAP = 2.6                  # room between the last logical block and the physical column
PHYS_PITCH_X = 2.2               # the folded column's second half, this far right of the first
CHAR_EM = 0.6                    # a character's width, in font sizes (Open Sans, Plotly's font, ~0.55)
HEADERS = ("physical block x ref count", "physical x refs", "physical")  # the longest that fits is drawn
# what the picture outlines: the step's changed blocks a table took anew (``engine.records.blocks_new_in_tables``)
CHANGED_KINDS = ("allocate", "new_block", "cow", "swap_in")


def _shown_rows(sequences, selected: str | None, max_rows: int) -> tuple[list, int]:
    """Sequences that hold blocks (running: GPU table; swapped: CPU swap-pool table), the highlighted
    request's first, at most ``max_rows``; and how many were left out. A request's sequences (n samples,
    beams) are drawn in the order of their ids (``_beam_key``), the requests in the order they first appear:
    the rows keep their places from one moment to the next (a beam step's copies and its selection, the next
    step), where the engine's order of sequences moves with every fork (b0, b5, b7, b8 then b8, b7, b0, b9)."""
    live = [s for s in sequences if s.block_table and s.status in ("running", "swapped")]
    first: dict[str, int] = {}
    for s in live:
        first.setdefault(request_id_of(s.seq_id), len(first))
    live.sort(key=lambda s: (first[request_id_of(s.seq_id)], _beam_key(s.seq_id)))
    if selected:
        live = [s for s in live if request_id_of(s.seq_id) == selected] + \
               [s for s in live if request_id_of(s.seq_id) != selected]
    return live[:max_rows], max(0, len(live) - max_rows)


def _shown_columns(num_logical: int, max_blocks: int, keep: int | None) -> list[int]:
    """Logical block indices drawn: all, or the first half and the last half of ``max_blocks`` (the prefix
    and where the step writes), plus ``keep`` (the picked token's block)."""
    if num_logical <= max_blocks:
        return list(range(num_logical))
    head = max_blocks // 2
    cols = set(range(head)) | set(range(num_logical - (max_blocks - head), num_logical))
    if keep is not None and 0 <= keep < num_logical:
        cols.add(keep)
    return sorted(cols)


def _token_pick(snapshot, token, rows) -> dict | None:
    """(seq_id, position) -> logical block, offset, physical block, slot. Raises ValueError naming the bad
    sequence or position."""
    if token is None:
        return None
    seq_id, position = token
    seq = next((s for s in snapshot.sequences if s.seq_id == seq_id), None)
    if seq is None or seq.status != "running" or not seq.block_table:
        raise ValueError(f"token: sequence {seq_id!r} holds no GPU blocks after this step "
                         f"(sequences holding blocks: {', '.join(s.seq_id for s in rows) or 'none'})")
    if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position < seq.num_tokens:
        raise ValueError(f"token: position {position!r} is not held by {seq_id!r} (it holds tokens 0.."
                         f"{seq.num_tokens - 1})")
    B = snapshot.block_size
    logical, offset = divmod(position, B)
    physical = seq.block_table[logical]
    slot = physical * B + offset  # the engine's slot mapping (BlockManager.slot)
    return {"seq_id": seq_id, "position": position, "logical": logical, "offset": offset, "physical": physical,
            "slot": slot,
            "caption": f"token {position} of {seq_id}: logical block {position} // {B} = {logical}, offset "
                       f"{position} % {B} = {offset} -> physical block {physical} -> slot {physical} x {B} + "
                       f"{offset} = {slot}"}


def group_label(group: dict) -> str:
    """A KV cache group as a row says it: "full" (full attention) or "window 48" (a sliding window of 48
    tokens); ``group`` one of ``Snapshot.kv_cache_groups``."""
    return "full" if group["kind"] == "full_attention" else f"window {group['sliding_window']}"


def _group_rows(rows: list, groups: list[dict]) -> tuple[list, dict]:
    """Each sequence's row once per KV cache group (``SequenceState.group_block_tables``), in group order:
    (rows, key -> (sequence id, group)). The shown group's row keeps the sequence id as its key (the
    token pick and copy-on-write name it); another group's is "<id> <label>"."""
    shown, out, meta = shown_group(groups), [], {}
    for s in rows:
        tables = s.group_block_tables or [s.block_table] * len(groups)
        for g, table in enumerate(tables):
            key = s.seq_id if g == shown else f"{s.seq_id} {group_label(groups[g])}"
            out.append(dataclasses.replace(s, seq_id=key, block_table=list(table)))
            meta[key] = (s.seq_id, g)
    return out, meta


def _left_window(events, meta: dict, rows) -> list[dict]:
    """The null entries this step's "leave_window" events put in the drawn rows: one dict per event (row
    ``key``, ``logical`` indices that became the null block, the ``blocks`` given back). A window frees
    from the left, so they are the last nulls of the row's leading run of nulls."""
    by = {v: k for k, v in meta.items()}
    tables = {s.seq_id: s.block_table for s in rows}
    out = []
    for e in events:
        if e.kind != "leave_window" or (e.request_id, e.data.get("group")) not in by:
            continue
        key = by[(e.request_id, e.data["group"])]
        table = tables.get(key, [])
        lead = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
        out.append({"key": key, "seq_id": e.request_id, "group": e.data["group"], "blocks": list(e.blocks),
                    "logical": list(range(max(0, lead - len(e.blocks)), lead))})
    return out


def block_table_picture(snapshot, events=(), request_order: list[str] | None = None, selected: str | None = None,
                        token: tuple[str, int] | None = None, max_rows: int = 8, max_blocks: int = 16,
                        max_physical: int | None = None) -> dict:
    """The picture as plain data (no plotly), for ``block_table_figure`` and the tests.

    Args:
        snapshot: an ``engine.records.Snapshot`` (paged) after the step.
        events: that step's ``Event`` list (``StepRecord.events``); copy-on-write and what changed come from it.
        request_order: request ids in first-seen order (fixes each request's colour).
        selected: a request id drawn first and in full (others' arrows faded).
        token: (sequence id, token position) to locate.
        max_rows / max_blocks: most sequences / logical blocks per row drawn.
        max_physical: most physical blocks drawn (what fits their columns): fewer logical blocks, then fewer
            rows are drawn until the blocks they reference fit.

    KV cache groups (``snapshot.kv_cache_groups``, a hybrid model): one row per group per sequence, each
    labelled with its group ("R1 full", "R1 window 48"), its null entries (-1: blocks a sliding window gave
    back) drawn as empty "null" boxes with no arrow; ``max_rows`` still counts sequences' rows.

    Returns a dict: ``rows`` (seq_id: the row's key, request: the sequence id, label, group (index or None),
    status, color, table, num_tokens), ``columns`` (logical indices drawn),
    ``physical`` (block, ref_count, fill, owners, shared, changed, free), ``arrows`` (seq_id, logical, physical,
    kind "table" or "cow_old": the table's arrow before this step's copy-on-write), ``changed`` (physical
    blocks), ``cow`` (events drawn: seq_id, logical, src, dst), ``token`` (see ``_token_pick``) and
    ``notes`` (what is left out), ``left_window`` (``_left_window``: the null entries this step made).

    Raises:
        ValueError: ``snapshot`` is the contiguous baseline's, ``max_rows`` / ``max_blocks`` < 1, or the
            token names a sequence without GPU blocks or a position it does not hold.
    """
    if getattr(snapshot, "allocator", "paged") != "paged":
        raise ValueError(f"snapshot.allocator: {snapshot.allocator!r}; block tables exist only in a paged pool")
    if max_rows < 1 or max_blocks < 1:
        raise ValueError(f"max_rows {max_rows} / max_blocks {max_blocks}: each must be >= 1")
    order = request_order or []
    B = snapshot.block_size
    groups = list(getattr(snapshot, "kv_cache_groups", None) or [])
    per_seq = max(1, len(groups))  # rows a sequence takes: one per KV cache group
    rows, rows_left = _shown_rows(snapshot.sequences, selected, max(1, max_rows // per_seq))
    pick = _token_pick(snapshot, token, rows)
    if pick and all(s.seq_id != pick["seq_id"] for s in rows):  # the picked sequence is always drawn
        rows = rows[:-1] + [next(s for s in snapshot.sequences if s.seq_id == pick["seq_id"])]
    meta = {s.seq_id: (s.seq_id, None) for s in rows}
    if groups:
        rows, meta = _group_rows(rows, groups)
    changed = blocks_new_in_tables(events)
    keep = pick["logical"] if pick else None
    while True:  # fewer logical blocks, then fewer rows, until the physical blocks fit their column
        num_logical = max((len(s.block_table) for s in rows), default=0)
        columns = _shown_columns(num_logical, max_blocks, keep)
        arrows, cows = _arrows(rows, set(columns), events, B)
        if max_physical is None or len({a["physical"] for a in arrows}) <= max_physical:
            break
        if len(columns) > 2:
            max_blocks = max(1, min(max_blocks, len(columns)) - 1)
        elif len(rows) > 1:
            rows = _drop_row(rows, pick, changed)
            rows_left += 1 if not groups else 0
        else:
            break

    hashes = snapshot.block_hashes or [None] * snapshot.num_blocks
    physical = [{"block": b, "ref_count": snapshot.ref_counts[b], "fill": snapshot.fills[b],
                 "owners": list(snapshot.owners[b]), "shared": snapshot.ref_counts[b] > 1,
                 "free": snapshot.ref_counts[b] == 0, "changed": b in changed, "hash": hashes[b],
                 "color": (FREE if snapshot.ref_counts[b] == 0 else SHARED if snapshot.ref_counts[b] > 1
                           else request_color(request_id_of(snapshot.owners[b][0]), order))}
                for b in _order_physical(rows, arrows)]

    notes = []
    drawn = len({meta[s.seq_id][0] for s in rows})
    if rows_left:
        notes.append(f"{drawn} of {drawn + rows_left} sequences")
    if len(columns) < num_logical:
        notes.append(f"{len(columns)} of {num_logical} logical blocks")
    rows_out = []
    for s in rows:
        real, g = meta[s.seq_id]
        rows_out.append({"seq_id": s.seq_id, "request": real, "group": g,
                         "label": real if g is None else f"{real} {group_label(groups[g])}",
                         "status": str(s.status), "table": list(s.block_table), "token_ids": s.token_ids,
                         "num_tokens": s.num_tokens, "color": request_color(request_id_of(real), order)})
    return {"rows": rows_out, "columns": columns, "physical": physical, "arrows": arrows, "changed": sorted(changed),
            "cow": cows, "token": pick, "notes": notes, "block_size": B,
            "left_window": _left_window(events, meta, rows) if groups else []}


def _drop_row(rows: list, pick: dict | None, changed: set[int]) -> list:
    """``rows`` less one: the last that holds no block the step changed and is not the picked token's (the
    moment stays drawn), else the last one not picked."""
    keep = {pick["seq_id"]} if pick else set()
    candidates = [i for i in range(len(rows) - 1, -1, -1) if rows[i].seq_id not in keep]
    quiet = [i for i in candidates if rows[i].status != "running" or not changed & set(rows[i].block_table)]
    drop = (quiet or candidates)[0]
    return rows[:drop] + rows[drop + 1:]


def _order_physical(rows, arrows: list[dict]) -> list[int]:
    """The physical blocks, top to bottom, so that arrows rarely cross: each block at the mean position of the
    rows whose arrows reach it (the barycentre heuristic of two-layer drawing: Sugiyama et al., 1981), ties in
    order of first use (rows top to bottom, logical blocks left to right). A block only one sequence uses sits
    beside its row, in logical order, so arrows between such blocks never cross; a shared block sits between
    the rows sharing it, where the fewest arrows pass it."""
    index = {s.seq_id: i for i, s in enumerate(rows)}
    users: dict[int, list[int]] = {}
    first: dict[int, tuple[int, int, int]] = {}
    for k, a in enumerate(arrows):
        users.setdefault(a["physical"], []).append(index[a["seq_id"]])
        first.setdefault(a["physical"], (index[a["seq_id"]], a["logical"], k))
    for k, a in enumerate(sorted(arrows, key=lambda a: (index[a["seq_id"]], a["logical"]))):
        first[a["physical"]] = min(first[a["physical"]], (index[a["seq_id"]], a["logical"], k))
    return sorted(users, key=lambda b: (sum(users[b]) / len(users[b]), first[b]))


def _nest_rows(pic: dict, g: dict) -> bool:
    """Swap each row's own blocks (reached by one arrow, from that row) among their places so the row's
    arrows nest instead of crossing: an arrow leaves its logical box upwards to a block above the row, down to
    one below, and passes under (or over) the row's boxes to its right, so above the row the leftmost logical
    block takes the highest place, below it the lowest. Returns whether the order changed."""
    reach: dict[int, list[dict]] = {}
    for a in pic["arrows"]:
        reach.setdefault(a["physical"], []).append(a)
    order = [p["block"] for p in pic["physical"]]
    new = list(order)
    for r in pic["rows"]:
        y0 = g["row_y"][r["seq_id"]]
        own = [(j, reach[b][0]["logical"]) for j, b in enumerate(order)
               if len(reach.get(b, ())) == 1 and reach[b][0]["seq_id"] == r["seq_id"]
               and reach[b][0]["kind"] == "table"]
        if len(own) < 2 or len({lg for _, lg in own}) < len(own):
            continue
        above = [j for j, _ in own if g["phys_xy"][order[j]][1] < y0 - 1]
        below = [j for j, _ in own if j not in above]
        logical = sorted(lg for _, lg in own)
        wanted = logical[:len(above)] + sorted(logical[len(above):], reverse=True)
        by_logical = {lg: order[j] for j, lg in own}
        for j, lg in zip(above + below, wanted):
            new[j] = by_logical[lg]
    if new == order:
        return False
    where = {p["block"]: p for p in pic["physical"]}
    pic["physical"] = [where[b] for b in new]
    return True


SEARCH_ARROWS = 16  # ``_fewer_crossings`` searches pictures of at most this many arrows (2-10 ms); larger ones
# keep the barycentre order (shared-prefix's 8 rows x 8 blocks would take ~100 ms a step)


def _arrow_polylines(pic: dict, g: dict, phys_xy: dict | None = None) -> list[list[tuple[float, float]]]:
    """Each arrow as drawn (``_arrow_path``'s 4 points, the spline passes through them), with the physical
    blocks at ``phys_xy`` (default ``g``'s)."""
    phys_xy = phys_xy or g["phys_xy"]
    last_shown = {r["seq_id"]: max((i for i in range(len(r["table"])) if i in g["x_of"]), default=-1)
                  for r in pic["rows"]}
    return [list(zip(*_arrow_path(g["x_of"][a["logical"]], g["row_y"][a["seq_id"]], g["box_h"],
                                  *phys_xy[a["physical"]], g["row_px"], g["run_from"],
                                  a["logical"] == last_shown[a["seq_id"]])))
            for a in pic["arrows"]]


def _orient(a, b, c) -> int:
    v = (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])
    return 0 if abs(v) < 1e-9 else 1 if v > 0 else -1


def _polylines_cross(p, q) -> bool:
    """Whether two polylines properly intersect (touching at a shared end, two arrows into one block, is not
    a crossing). The x axis is in logical-block widths and y in px: orientation tests do not need one scale."""
    for k in range(len(p) - 1):
        for m in range(len(q) - 1):
            a, b, c, d = p[k], p[k + 1], q[m], q[m + 1]
            if _orient(a, b, c) * _orient(a, b, d) < 0 and _orient(c, d, a) * _orient(c, d, b) < 0:
                return True
    return False


def crossings(pic: dict, g: dict, phys_xy: dict | None = None) -> int:
    """How many pairs of arrows cross as drawn (``_arrow_polylines``)."""
    lines = _arrow_polylines(pic, g, phys_xy)
    return sum(_polylines_cross(lines[i], lines[j]) for i in range(len(lines)) for j in range(i + 1, len(lines)))


def _fewer_crossings(pic: dict, g: dict) -> bool:
    """Swap neighbouring physical blocks while that makes fewer arrows cross as drawn, until no swap helps.
    The barycentre order (``_order_physical``) and ``_nest_rows`` are a good start, but they count neither the
    arrows' real routes nor a copy-on-write's dotted arrow to its source: a beam step's copies (four beams on
    one shared block, three copies of another) drew 9 crossings where no order of the column draws fewer than
    8. A swap changes only the arrows into its two blocks, so only their crossings are counted again. Only
    for pictures of at most ``SEARCH_ARROWS`` arrows. Returns whether the order changed."""
    if len(pic["arrows"]) > SEARCH_ARROWS or len(pic["physical"]) < 2:
        return False
    order = [p["block"] for p in pic["physical"]]
    places = [g["phys_xy"][b] for b in order]
    into: dict[int, list[int]] = {}
    for k, a in enumerate(pic["arrows"]):
        into.setdefault(a["physical"], []).append(k)
    # every arrow's polyline at every place (an arrow's route depends only on where its block sits), its
    # bounding box, and each pair's answer, computed once
    lines = [_arrow_polylines(pic, g, {b: xy for b in order}) for xy in places]
    boxes = [[(min(x for x, _ in ln), max(x for x, _ in ln), min(y for _, y in ln), max(y for _, y in ln))
              for ln in at] for at in lines]
    memo: dict[tuple, bool] = {}

    def cross(k: int, pk: int, m: int, pm: int) -> bool:
        key = (k, pk, m, pm) if k < m else (m, pm, k, pk)
        if key not in memo:
            a, b = boxes[pk][k], boxes[pm][m]
            memo[key] = (a[0] <= b[1] and b[0] <= a[1] and a[2] <= b[3] and b[2] <= a[3]
                         and _polylines_cross(lines[pk][k], lines[pm][m]))
        return memo[key]

    def crossing_of(blocks: tuple[int, int], place: dict) -> int:
        """Crossings of the arrows into ``blocks`` (with each other and with the rest), blocks at ``place``."""
        at = [place[pic["arrows"][k]["physical"]] for k in range(len(pic["arrows"]))]
        mine = [k for b in blocks for k in into.get(b, ())]
        others = [k for k in range(len(at)) if k not in mine]
        return (sum(cross(i, at[i], j, at[j]) for i in mine for j in others)
                + sum(cross(mine[i], at[mine[i]], mine[j], at[mine[j]]) for i in range(len(mine))
                      for j in range(i + 1, len(mine))))

    start, improved = list(order), True
    for _ in range(len(order)):  # passes: each moves a block at most one place per swap that helps
        if not improved:
            break
        improved = False
        for j in range(len(order) - 1):
            pair = (order[j], order[j + 1])
            if not (into.get(pair[0]) or into.get(pair[1])):
                continue
            place = {b: i for i, b in enumerate(order)}
            if crossing_of(pair, {**place, pair[0]: j + 1, pair[1]: j}) < crossing_of(pair, place):
                order[j], order[j + 1] = order[j + 1], order[j]
                improved = True
    if order == start:
        return False
    where = {p["block"]: p for p in pic["physical"]}
    pic["physical"] = [where[b] for b in order]
    return True


def _arrows(rows, shown: set[int], events, B: int) -> tuple[list[dict], list[dict]]:
    """One arrow per (sequence, logical block drawn) to its physical block; for each copy-on-write of the
    step, the arrow it replaced (to ``src``; the table's own arrow now goes to ``dst``)."""
    arrows, cows = [], []
    for s in rows:
        if s.status != "running":
            continue  # a swapped sequence's table lists CPU swap-pool blocks: no arrow into the GPU pool
        arrows += [{"seq_id": s.seq_id, "logical": i, "physical": b, "kind": "table"}
                   for i, b in enumerate(s.block_table) if i in shown and b != NULL_BLOCK]
    live = {s.seq_id: s.block_table for s in rows if s.status == "running"}
    for e in events:
        if e.kind != "cow" or e.request_id not in live:
            continue  # a sequence copied and then pruned in the same step has no row left
        logical = e.data.get("position", 0) // B
        src, dst = e.data.get("src", e.blocks[0]), e.data.get("dst", e.blocks[-1])
        table = live[e.request_id]
        if logical in shown and logical < len(table) and table[logical] == dst:
            arrows.append({"seq_id": e.request_id, "logical": logical, "physical": src, "kind": "cow_old"})
            cows.append({"seq_id": e.request_id, "logical": logical, "src": src, "dst": dst})
    return arrows, cows


# ------------------------------------------------------------------------------------------------ drawing
def _sizes(font: int, compact: bool) -> dict:
    """Box heights and pitches (px) for labels of ``font`` px: a logical box ``font + 8`` high in a row with
    room above and below for the arrows' bends; a physical box ``font + 4`` high. The physical column is folded
    in two when it does not fit: the second half sits beside the first, offset by half a pitch, so block i is
    at ``i`` half-pitches from the top (the order stays top to bottom) and every arrow into the second half runs
    level through a gap of the first."""
    box_h = font + 8
    row_px = max(ROW_PX_COMPACT if compact else ROW_PX, box_h + max(10, round(font * 0.6)))
    phys_h = font + 4
    return {"box_h": box_h, "row_px": row_px, "row_min": box_h + max(8, round(font * 0.45)), "phys_h": phys_h,
            "pitch_one": phys_h + 8, "pitch_half": phys_h / 2 + 2}


def physical_fit(plot_px: float, font: int = FONT_PX) -> int:
    """How many physical blocks the folded column holds in a plot area ``plot_px`` high (px)."""
    z = _sizes(font, True)
    return max(1, int((plot_px - z["phys_h"]) // z["pitch_half"]) + 1)


def _geometry(pic: dict, compact: bool, font: int = FONT_PX, plot_px: float | None = None) -> dict:
    """Where everything goes: y in pixels (top = 0), x in logical-block widths. ``plot_px``: the plot area's
    height (the presenter's); None: as high as the rows and the physical column need (the Playground's)."""
    z = _sizes(font, compact)
    n_rows, n_phys = len(pic["rows"]), len(pic["physical"])
    one = n_phys * z["pitch_one"] - 8
    rows_px = n_rows * z["row_px"]
    if plot_px is None:
        plot_px = max(MIN_PLOT_PX, rows_px)
        folded = one > plot_px
        if folded:
            plot_px = min(MAX_PLOT_PX_COMPACT if compact else MAX_PLOT_PX, max(plot_px, (n_phys - 1) * z["pitch_half"] + z["phys_h"]))
    else:
        folded = one > plot_px
    row_px = z["row_px"] if rows_px <= plot_px else max(z["row_min"], plot_px / max(1, n_rows))
    row_top = max(0.0, (plot_px - n_rows * row_px) / 2)
    row_y = {r["seq_id"]: row_top + (i + 0.5) * row_px for i, r in enumerate(pic["rows"])}
    x_of, x = {}, 0.0
    for k, col in enumerate(pic["columns"]):
        if k and col != pic["columns"][k - 1] + 1:
            x += 0.6  # a gap where logical blocks are left out (an ellipsis is drawn there)
        x_of[col] = x
        x += 1
    x_end = x - 1 + LOGICAL_W / 2 if pic["columns"] else 0
    x0 = x_end + ARROW_GAP + PHYS_W / 2
    step = z["pitch_half"] if folded else z["pitch_one"]
    height = (n_phys - 1) * step + z["phys_h"] if n_phys else 0
    top = (plot_px - height) / 2 + z["phys_h"] / 2
    phys_xy = {p["block"]: (x0 + (PHYS_PITCH_X if folded and j % 2 else 0), top + j * step)
               for j, p in enumerate(pic["physical"])}
    return {"row_px": row_px, "box_h": min(z["box_h"], row_px * 0.72), "phys_h": z["phys_h"], "plot_px": plot_px,
            "row_y": row_y, "x_of": x_of, "x_end": x_end, "phys_xy": phys_xy, "folded": folded,
            "run_from": x0 - PHYS_W / 2 - 0.6, "font": font,
            "x_max": x0 + PHYS_W / 2 + (PHYS_PITCH_X if folded else 0) + 0.1}


def _rect(x: float, y: float, w: float, h: float) -> tuple[list, list]:
    """A closed rectangle path centred at (x, y), then a gap (None) so several share one trace."""
    return ([x - w / 2, x + w / 2, x + w / 2, x - w / 2, x - w / 2, None],
            [y - h / 2, y - h / 2, y + h / 2, y + h / 2, y - h / 2, None])


def _arrow_path(x0: float, y0: float, box_h: float, x1: float, y1: float, row_px: float,
                run_from: float, last: bool = False) -> tuple[list, list]:
    """Leave the logical box by its top or bottom edge (towards the target; the row's last box, by its right
    side when the target is exactly level with it), sweep right through the gap between rows, run level from
    ``run_from`` (left of the physical column) into the physical box's left side: 4 points, drawn as a
    spline."""
    end = x1 - PHYS_W / 2 - 0.12
    if last and abs(y1 - y0) < 1:
        return [x0 + LOGICAL_W / 2, x0 + LOGICAL_W / 2 + 0.3, min(run_from, end - 0.7), end], [y0, y0, y1, y1]
    up = y1 < y0 - 1  # y grows downwards
    edge = y0 - box_h / 2 if up else y0 + box_h / 2
    bend = edge + (-1 if up else 1) * (row_px - box_h) / 2 * 0.8
    return [x0, x0 + 0.25, min(run_from, end - 0.7), end], [edge, bend, y1, y1]


def _box_traces(pic: dict, g: dict, faded: set[str], decode) -> list[dict]:
    """Filled boxes (one scatter trace dict per colour) and their labels with hover text."""
    B = pic["block_size"]
    fills: dict[tuple[str, str, float], tuple[list, list]] = {}

    def add(key, x, y, w, h):
        xs, ys = _rect(x, y, w, h)
        fills.setdefault(key, ([], []))
        fills[key][0].extend(xs)
        fills[key][1].extend(ys)

    lx, ly, ltext, lhover = [], [], [], []
    for r in pic["rows"]:
        y = g["row_y"][r["seq_id"]]
        swapped = r["status"] == "swapped"
        for i, b in enumerate(r["table"]):
            if i not in g["x_of"]:
                continue
            x = g["x_of"][i]
            held = max(0, min(B, r["num_tokens"] - i * B))
            if b == NULL_BLOCK:  # a sliding window gave this block back: the table holds the null block
                add((FREE, NULL_LINE, 0.35 if r["seq_id"] in faded else 1.0), x, y, LOGICAL_W, g["box_h"])
                lx.append(x)
                ly.append(y)
                ltext.append("null")
                lhover.append(f"{r['label']} logical block {i} (tokens {i * B}..{i * B + B - 1}): left the window, "
                              f"no later token attends to it; its block was given back to the pool, the table "
                              f"holds the null block (-1)")
                continue
            color = FREE if swapped else r["color"]
            add((color, r["color"], 0.35 if r["seq_id"] in faded else 1.0), x, y, LOGICAL_W, g["box_h"])
            lx.append(x)
            ly.append(y)
            ltext.append(f"c{b}" if swapped else str(b))
            where = (f"CPU swap-pool block {b} (swapped out)" if swapped else
                     f"physical block {b}, slots {b * B}..{b * B + B - 1}")
            text = decode(r["token_ids"][i * B:i * B + held]) if decode and held else ""
            lhover.append(f"{r['label']} logical block {i} (tokens {i * B}..{i * B + B - 1}; holds {held}/{B})"
                          f"<br>-> {where}" + (f"<br>text: {_escape(text)}" if text else ""))
    px, py, ptext, phover = [], [], [], []
    for p in pic["physical"]:
        x, y = g["phys_xy"][p["block"]]
        color = p["color"]
        add((color, "#404040" if p["shared"] or p["free"] else color, 1.0), x, y, PHYS_W, g["phys_h"])
        px.append(x)
        py.append(y)
        label = f"{p['block']} x{p['ref_count']}" + (" free" if p["free"] else "")
        ptext.append(f"<b>{label}</b>" if p["shared"] else label)
        b = p["block"]
        phover.append(f"physical block {b}: reference count {p['ref_count']}<br>owners: "
                      f"{', '.join(p['owners']) or 'none (free)'}<br>fill {p['fill']}/{B}, slots {b * B}.."
                      f"{b * B + B - 1}" + (f"<br>prefix hash {p['hash'][:12]}" if p["hash"] else ""))
    traces = []
    for (fill, line, opacity), (xs, ys) in fills.items():
        # the fill is a tint of the colour, so black labels stay readable on every palette colour
        traces.append({"type": "scatter", "x": xs, "y": ys, "mode": "lines", "fill": "toself",
                       "fillcolor": _tint(fill), "line": {"color": line, "width": 2}, "opacity": opacity,
                       "hoverinfo": "skip", "showlegend": False, "meta": {"role": "boxes"}})
    for xs, ys, text, hover, role in ((lx, ly, ltext, lhover, "logical"), (px, py, ptext, phover, "physical")):
        traces.append({"type": "scatter", "x": xs, "y": ys, "mode": "markers+text", "text": text,
                       "hovertext": hover, "hovertemplate": "%{hovertext}<extra></extra>",
                       "textfont": {"size": g["font"], "color": TEXT},
                       "marker": {"size": 22, "color": "rgba(0,0,0,0)", "symbol": "square"},
                       "showlegend": False, "meta": {"role": f"{role}_labels"}})
    return traces


def _escape(text: str) -> str:
    """Token text for a hover label: plotly reads ``<`` as markup, and a newline would break the label."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\n", "\u23ce")


def _tint(color: str) -> str:
    """``#RRGGBB`` -> the same colour at 35 % over white (a pale fill; the outline keeps the full colour)."""
    if color == FREE:
        return FREE
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(255 - 0.35 * (255 - c)):02X}" for c in (r, g, b))


def _arrow_traces(pic: dict, g: dict, faded: set[str]) -> list[dict]:
    """One scatter trace dict per (sequence, kind): the table's arrows, and (dotted) the arrows a copy-on-write
    moved."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for a in pic["arrows"]:
        groups.setdefault((a["seq_id"], a["kind"]), []).append(a)
    colors = {r["seq_id"]: r["color"] for r in pic["rows"]}
    last_shown = {r["seq_id"]: max((i for i in range(len(r["table"])) if i in g["x_of"]), default=-1)
                  for r in pic["rows"]}
    traces = []
    for (seq_id, kind), arrows in groups.items():
        xs, ys, sizes, custom = [], [], [], []
        for a in arrows:
            ax, ay = _arrow_path(g["x_of"][a["logical"]], g["row_y"][seq_id], g["box_h"],
                                 *g["phys_xy"][a["physical"]], g["row_px"], g["run_from"],
                                 a["logical"] == last_shown[seq_id])
            xs += ax + [None]
            ys += ay + [None]
            sizes += [0, 0, 0, 11, 0]
            custom += [[seq_id, a["logical"], a["physical"], kind]] * 4 + [None]
        old = kind == "cow_old"
        traces.append({
            "type": "scatter", "x": xs, "y": ys, "mode": "lines+markers",
            "line": {"color": colors[seq_id], "width": 1.5 if old else 2, "shape": "spline",
                     "dash": "dot" if old else "solid"},
            "marker": {"symbol": "triangle-right", "size": sizes, "color": colors[seq_id]},
            "opacity": 0.3 if seq_id in faded else 0.55 if old else 0.9, "customdata": custom, "showlegend": False,
            "hovertemplate": ("%{customdata[0]}: logical block %{customdata[1]} -> physical block %{customdata[2]}"
                              + (" (before this step's copy-on-write)" if old else "") + "<extra></extra>"),
            "name": f"{seq_id} {'before copy-on-write' if old else 'block table'}",
            "meta": {"role": "arrows", "kind": kind, "seq_id": seq_id}})
    return traces


def _outline_traces(pic: dict, g: dict, selected: str | None) -> list[dict]:
    """Scatter trace dicts. Black: blocks this step changed (in both columns); magenta: the selected request's
    boxes (thin) and the picked token's logical block, physical block, arrow and slot (thick)."""
    changed = set(pic["changed"])
    outlines = {"changed": ([], [], CHANGED, 3), "selected": ([], [], SELECTED, 2), "token": ([], [], SELECTED, 4)}

    def add(kind, x, y, w, h):
        xs, ys = _rect(x, y, w, h)
        outlines[kind][0].extend(xs)
        outlines[kind][1].extend(ys)

    for r in pic["rows"]:
        if r["status"] != "running":
            continue
        for i, b in enumerate(r["table"]):
            if i in g["x_of"] and b in changed:
                add("changed", g["x_of"][i], g["row_y"][r["seq_id"]], LOGICAL_W + 0.08, g["box_h"] + 4)
    for left in pic.get("left_window", ()):  # the null block entered these entries this step
        for i in left["logical"]:
            if i in g["x_of"] and left["key"] in g["row_y"]:
                add("changed", g["x_of"][i], g["row_y"][left["key"]], LOGICAL_W + 0.08, g["box_h"] + 4)
    for p in pic["physical"]:
        x, y = g["phys_xy"][p["block"]]
        if p["changed"]:
            add("changed", x, y, PHYS_W + 0.1, g["phys_h"] + 4)
        if selected and any(request_id_of(o) == selected for o in p["owners"]):
            add("selected", x, y, PHYS_W + 0.22, g["phys_h"] + 8)
    pick = pic["token"]
    if pick:
        add("token", g["x_of"][pick["logical"]], g["row_y"][pick["seq_id"]], LOGICAL_W + 0.16, g["box_h"] + 8)
        add("token", *g["phys_xy"][pick["physical"]], PHYS_W + 0.3, g["phys_h"] + 12)
    traces = [{"type": "scatter", "x": xs, "y": ys, "mode": "lines", "line": {"color": color, "width": width},
               "hoverinfo": "skip", "showlegend": False, "meta": {"role": f"outline_{kind}"}}
              for kind, (xs, ys, color, width) in outlines.items() if xs]
    if pick:
        row = next(r for r in pic["rows"] if r["seq_id"] == pick["seq_id"])
        last = max(i for i in range(len(row["table"])) if i in g["x_of"])
        ax, ay = _arrow_path(g["x_of"][pick["logical"]], g["row_y"][pick["seq_id"]], g["box_h"],
                             *g["phys_xy"][pick["physical"]], g["row_px"], g["run_from"], pick["logical"] == last)
        traces.append({"type": "scatter", "x": ax, "y": ay, "mode": "lines",
                       "line": {"color": SELECTED, "width": 4, "shape": "spline"}, "hoverinfo": "skip",
                       "showlegend": False, "meta": {"role": "token_arrow"}})
        # the offset: a marker over the slot's place inside each box (B slots across the box's width)
        B = pic["block_size"]
        lx = g["x_of"][pick["logical"]] - LOGICAL_W / 2 + (pick["offset"] + 0.5) * LOGICAL_W / B
        px_, py_ = g["phys_xy"][pick["physical"]]
        sx = px_ - PHYS_W / 2 + (pick["offset"] + 0.5) * PHYS_W / B
        traces.append({
            "type": "scatter", "x": [lx, sx],
            "y": [g["row_y"][pick["seq_id"]] - g["box_h"] / 2 - 3, py_ - g["phys_h"] / 2 - 3],
            "mode": "markers", "marker": {"symbol": "triangle-down", "size": 12, "color": SELECTED},
            "hovertext": [f"offset {pick['offset']} of logical block {pick['logical']}",
                          f"slot {pick['slot']} (offset {pick['offset']} of physical block {pick['physical']})"],
            "hovertemplate": "%{hovertext}<extra></extra>", "showlegend": False, "meta": {"role": "token_slot"}})
    return traces


def block_table_figure(source, request_order: list[str] | None = None, selected: str | None = None,
                       token: tuple[str, int] | None = None, events=None, decode: Callable | None = None,
                       max_rows: int | None = None, max_blocks: int | None = None, compact: bool = False,
                       title: str | None = None, font_px: int = FONT_PX, height_px: int | None = None,
                       width_px: int | None = None, captions: bool = True) -> go.Figure:
    """The block tables after a step as arrows from logical to physical blocks.

    Args:
        source: a ``StepRecord`` (its snapshot and events are used) or a ``Snapshot`` (then ``events``).
        request_order: request ids in first-seen order (fixes each request's colour, as in the pool).
        selected: a request id: its rows first and its arrows in full, the others' faded; its physical
            blocks outlined magenta as in the pool.
        token: ``(sequence id, position)``: locate that token (logical block, offset, physical block, slot).
        events: the step's events when ``source`` is a Snapshot (else ``source.events``).
        decode: token ids -> text, for the logical blocks' hover (optional).
        max_rows / max_blocks: most sequences / logical blocks drawn (default 8 / 16; ``compact``: 4 / 8;
            with ``height_px``: as many rows as fit, 8 logical blocks).
        compact: smaller rows and limits, for the presenter view beside the pool.
        title: the first line of the title (default "Block tables after step N").
        font_px: every text's size (px; the title 2 px more). The boxes and pitches grow with it.
        height_px: the figure's whole height (px), e.g. the presenter's pool row: rows and physical blocks
            are fitted into it (what is left out is named in the title). None: as high as needed, ~300-420 px.
        width_px: the figure's width (px; default 620, half a 1280 px screen), to choose a header that fits.
        captions: the copy-on-write and token lines under the plot (the presenter says them in its sentences).

    Returns a figure (``layout.height`` in px); every font >= ``font_px``, labels near-black (``colors.TEXT``).

    Raises:
        ValueError: as ``block_table_picture`` (contiguous snapshot, bad limits, a token not held), or a
            ``font_px`` / ``height_px`` that is not a positive number of pixels (or leaves no plot area).
    """
    for name, value in (("font_px", font_px), ("height_px", height_px), ("width_px", width_px)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive number of pixels, got {value!r}")
    snapshot = getattr(source, "snapshot", source)
    if events is None:
        events = getattr(source, "events", [])
    z = _sizes(font_px, compact)
    top = _top_px(font_px, notes=False if height_px else None)
    plot_px = None
    if height_px is not None:
        plot_px = height_px - top - 8
        if plot_px < z["row_min"]:
            raise ValueError(f"height_px {height_px}: leaves no room for one row at {font_px} px type")
        if max_rows is None:
            max_rows = max(1, int(plot_px // z["row_min"]))
        fit = physical_fit(plot_px, font_px)
    else:
        fit = physical_fit(MAX_PLOT_PX_COMPACT if compact else MAX_PLOT_PX, font_px)
    max_rows = (4 if compact else 8) if max_rows is None else max_rows
    max_blocks = (8 if compact or height_px else 16) if max_blocks is None else max_blocks
    pic = block_table_picture(snapshot, events, request_order, selected, token, max_rows, max_blocks, fit)
    g = _geometry(pic, compact, font_px, plot_px)
    if _nest_rows(pic, g):
        g = _geometry(pic, compact, font_px, plot_px)  # same slots, the rows' own blocks swapped among them
    if _fewer_crossings(pic, g):
        g = _geometry(pic, compact, font_px, plot_px)  # same slots, blocks moved where fewer arrows cross
    faded = {r["seq_id"] for r in pic["rows"] if selected and request_id_of(r["request"]) != selected}
    data = _arrow_traces(pic, g, faded) + _box_traces(pic, g, faded, decode) + _outline_traces(pic, g, selected)
    step = getattr(source, "step", None)
    head = title or ("Block tables" + (f" after step {step}" if step else "") + ": logical -> physical")
    if pic["notes"]:  # on a line of its own (one line with a fixed height: the title must stay one line)
        head += (" · " if height_px else "<br>") + f"showing {', '.join(pic['notes'])}"
    if not pic["rows"]:
        head += ": no sequence holds blocks"
    bottom = []
    if pic["cow"] and captions:
        bottom.append("copy-on-write: " + ", ".join(f"{c['seq_id']} block {c['src']} -> {c['dst']}"
                                                    for c in pic["cow"][:4])
                      + (f" (+{len(pic['cow']) - 4} more)" if len(pic["cow"]) > 4 else "")
                      + " (dotted: the arrow before the copy)")
    if pic["left_window"] and captions:
        bottom.append("left the window: " + ", ".join(
            f"{w['key']} block{'s' * (len(w['blocks']) > 1)} {', '.join(map(str, w['blocks']))}"
            for w in pic["left_window"]) + " (given back to the pool; the table holds the null block)")
    if pic["token"] and captions:
        bottom.append(pic["token"]["caption"])
    layout = _layout(pic, g, head, bottom, width_px or 620)
    if height_px is not None:
        layout["height"] = height_px
    return figure(data, layout)


def _top_px(font: int, notes: bool | None) -> int:
    """The top margin (px): the title's line (``font + 2`` px type), then the logical blocks' labels."""
    return round((font + 2) * 1.5 + font * 1.6 + 6)


def _per_unit(g: dict, pic: dict, width_px: int) -> float:
    """One logical-block width in px (estimated from the figure's width: the row labels take the left)."""
    label_chars = max((len(r.get("label", r["seq_id"])) + 2 + (10 if r["status"] == "swapped" else 0) for r in pic["rows"]),
                      default=4)
    plot_w = width_px - 20 - CHAR_EM * g["font"] * label_chars - 10
    return plot_w / (g["x_max"] + 0.7)


# The logical blocks' ticks: numbers, the first one named ("logical 0 1 2 3", not "L0 L1": a hybrid model's
# group legend says "layers 0, 2", and "L0" read as a layer); the longest first name that fits its column.
FIRST_TICKS = ("logical {}", "block {}", "#{}")


def _ticks(g: dict, pic: dict, width_px: int) -> list[tuple[float, str]]:
    """(x, text) of the logical blocks' ticks: the first column's number with the longest of ``FIRST_TICKS``
    whose right half clears the next tick's left half, the others their number alone."""
    cols = pic["columns"]
    if not cols:
        return []
    per_unit, em = _per_unit(g, pic, width_px), CHAR_EM * g["font"]
    gap = (g["x_of"][cols[1]] - g["x_of"][cols[0]]) * per_unit if len(cols) > 1 else float("inf")
    nxt = len(str(cols[1])) if len(cols) > 1 else 0
    first = next((f.format(cols[0]) for f in FIRST_TICKS
                  if (len(f.format(cols[0])) + nxt + 1) * em / 2 <= gap), FIRST_TICKS[-1].format(cols[0]))
    return [(g["x_of"][c], first if k == 0 else str(c)) for k, c in enumerate(cols)]


def _header(g: dict, pic: dict, width_px: int) -> str:
    """The longest of ``HEADERS`` that fits over the physical column and the arrows' gap (estimated from the
    figure's width: the row labels take the left, the x range the rest)."""
    per_unit = _per_unit(g, pic, width_px)
    room = (g["x_max"] - g["x_end"] - 0.5) * per_unit
    return next((h for h in HEADERS if len(h) * CHAR_EM * g["font"] <= room), HEADERS[-1])


def _layout(pic: dict, g: dict, head: str, bottom: list[str], width_px: int = 620) -> dict:
    """The layout dict: title ``head``, the ``bottom`` captions (wrapped) under the plot, the logical-block
    ticks along the top, the rows' ticks on the left; height in px from the geometry ``g``. Every text is
    ``g["font"]`` px (the title 2 px more) in ``TEXT``."""
    font = g["font"]
    top, line = _top_px(font, None) + round((font + 6) * head.count("<br>")), round(font * 1.45)
    lines = [part for text in bottom
             for part in textwrap.wrap(text, CAPTION_CHARS, subsequent_indent="  ", break_on_hyphens=False)]
    margin_b = 8 + line * len(lines)
    annotations = [{"text": text, "xref": "paper", "yref": "paper", "x": 0, "y": 0, "yshift": -8 - line * k,
                    "xanchor": "left", "yanchor": "top", "showarrow": False,
                    "font": {"size": font, "color": TEXT}, "name": "caption"}
                   for k, text in enumerate(lines)]
    ticks = _ticks(g, pic, width_px)
    gaps = [(g["x_of"][c] - 0.8, "...") for k, c in enumerate(pic["columns"][1:], 1)
            if c != pic["columns"][k - 1] + 1]
    ticks = sorted(ticks + gaps)
    if pic["physical"]:  # right-aligned over the physical column: never past the figure's right edge
        annotations.append({"text": _header(g, pic, width_px), "x": g["x_max"] - 0.1, "xanchor": "right",
                            "y": 1, "yref": "paper", "yanchor": "bottom", "yshift": 4, "showarrow": False,
                            "font": {"size": font, "color": TEXT}, "name": "header"})
    return {
        "title": {"text": head, "font": {"size": font + 2, "color": TEXT}, "x": 0, "xanchor": "left", "y": 1,
                  "yanchor": "top", "yref": "container", "pad": {"t": 6, "l": 8}},
        "height": int(g["plot_px"] + top + margin_b), "margin": {"l": 10, "r": 10, "t": top, "b": margin_b},
        "font": {"size": font, "color": TEXT}, "plot_bgcolor": "white", "hovermode": "closest", "dragmode": False,
        "annotations": annotations,
        "xaxis": {"side": "top", "tickmode": "array", "tickvals": [t[0] for t in ticks],
                  "ticktext": [t[1] for t in ticks], "tickfont": {"size": font, "color": TEXT}, "showgrid": False,
                  "zeroline": False, "range": [-0.7, g["x_max"]], "fixedrange": True},
        "yaxis": {"range": [g["plot_px"], 0], "tickmode": "array", "fixedrange": True, "showgrid": False,
                  "zeroline": False, "tickvals": [g["row_y"][r["seq_id"]] for r in pic["rows"]],
                  "ticktext": [f'<span style="color:{r["color"]}">\u25a0</span> {r.get("label", r["seq_id"])}'
                               + (" (swapped)" if r["status"] == "swapped" else "") for r in pic["rows"]],
                  "tickfont": {"size": font, "color": TEXT}, "automargin": True},
    }


# ------------------------------------------------------------------------------ a beam step in two phases
def _beam_key(seq_id: str) -> tuple:
    """Sort key: request, then beam number ("R1.b10" after "R1.b9")."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", seq_id))


def selection_events(events, snapshot=None) -> tuple[list, list]:
    """A step's beam selection, read from its events: the ``fork`` events (a kept beam continuing a parent
    another kept beam already continues shares the parent's blocks) and the ``free`` events of the beams it
    pruned (sequences of a request that forked this step and, with ``snapshot``, absent from the step's
    snapshot: a pruned beam leaves its request). Returns (forks, pruned frees); both empty for any other step.
    The engine emits them in ``LLMEngine._beam_continue``: forks first, then the pruned beams' frees, after the
    step's copy-on-write and writes."""
    forks = [e for e in events if e.kind == "fork" and e.data.get("parent")]
    forked = {request_id_of(e.request_id) for e in forks}
    present = None if snapshot is None else {s.seq_id for s in snapshot.sequences}
    pruned = [e for e in events if e.kind == "free" and "released" in e.data
              and request_id_of(e.request_id) in forked and (present is None or e.request_id not in present)]
    return forks, pruned


def selection_phases(record, previous=None) -> list[dict]:
    """A beam-search step as two moments, so a picture never shows one while the words say the other.

    1. "copies": the step's copy-on-write and writes done, before beam selection: every live beam on its own
       table (e.g. R1.b0 [0, 2], R1.b1 [0, 3], R1.b2 [0, 4], R1.b3 [0, 1]);
    2. "beam selection": the step's snapshot, after the kept beams forked and the pruned ones were freed
       (e.g. R1.b0, b4, b5, b6 all on [0, 2]).

    Phase 1 is rebuilt exactly from the step's snapshot by undoing its selection events (``selection_events``):
    each fork's child leaves its blocks (count - 1, owner removed), each pruned beam takes back the table its
    ``free`` event released (count + 1, owner added, the last block's fill from its token count); the kept
    beams lose the token ``_beam_continue`` appended. ``previous``: the record before (the pruned beams' token
    ids, for the hover; without it they are empty). Returns [] for a step without beam selection, else two
    dicts: ``phase`` ("copies" | "beam selection"), ``label`` ("1 copies", "2 selection"), ``snapshot`` (an
    ``engine.records.Snapshot``), ``events`` (that phase's)."""
    snap = record.snapshot
    forks, pruned = selection_events(record.events, snap)
    if not pruned:
        return []
    B = snap.block_size
    counts, fills, owners = list(snap.ref_counts), list(snap.fills), [list(o) for o in snap.owners]
    for e in forks:
        for b in e.blocks:
            counts[b] -= 1
            owners[b] = [o for o in owners[b] if o != e.request_id]
    children = {e.request_id for e in forks}
    involved = {request_id_of(e.request_id) for e in forks + pruned}
    before = {s.seq_id: s for s in (previous.snapshot.sequences if previous is not None else ())}
    template = {s.request_id: s for s in snap.sequences}
    seqs = []
    for s in snap.sequences:
        if s.seq_id in children:
            continue
        if s.request_id in involved and s.status == "running" and s.token_ids:  # the token selection appended
            s = dataclasses.replace(s, token_ids=list(s.token_ids[:-1]), num_generated=max(0, s.num_generated - 1))
        seqs.append(s)
    for e in pruned:
        table = list(e.data["released"])
        rid = request_id_of(e.request_id)
        like = template.get(rid) or next((s for s in seqs if request_id_of(s.seq_id) == rid), None)
        old = before.get(e.request_id)
        n = like.num_tokens if like is not None else len(table) * B  # beams of a request decode in step
        for k, b in enumerate(table):
            counts[b] += 1
            owners[b].append(e.request_id)
            fills[b] = B if k < len(table) - 1 else n - (len(table) - 1) * B
        seqs.append(dataclasses.replace(
            like if like is not None else old, seq_id=e.request_id, request_id=rid, status="running",
            block_table=table, num_tokens=n, finish_reason=None,
            token_ids=list(old.token_ids) if old is not None else [],
            num_generated=old.num_generated if old is not None else 0))
    seqs.sort(key=lambda s: _beam_key(s.seq_id))
    copies = dataclasses.replace(snap, ref_counts=counts, fills=fills, owners=owners, sequences=seqs,
                                 num_free_blocks=sum(c == 0 for c in counts))  # free exactly at count 0
    selection = set(map(id, forks + pruned))
    return [{"phase": "copies", "label": "1 copies", "snapshot": copies,
             "events": [e for e in record.events if id(e) not in selection]},
            {"phase": "beam selection", "label": "2 selection", "snapshot": snap,
             "events": [e for e in record.events if id(e) in selection]}]
