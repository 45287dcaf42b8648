"""A real server's prefix cache, drawn from its KV events: pure functions of ``PrefixCacheMirror`` and its
``BatchSummary`` history (``engine/watch/cache_mirror.py``). No Streamlit, no torch, no sockets: the Server page
draws the same figures live (``engine/watch/kv_subscriber.py``) and from a capture (``engine/watch/capture.py``).

- ``prefix_tree_figure``: the cached blocks as a forest of prefixes. A block is a marker; its parent (the
  block before it in the prompt, ``parent_block_hash``) is to its left, joined by an edge; siblings (prompts
  that share everything up to their parent and then differ) are stacked below one another. Layout: a
  pre-order walk from each root; a block takes the row of its first child, so a prompt's chain of blocks is
  one straight line and every branch point opens a new row below. Roots are blocks whose parent is not in
  the view (a prompt's first block, or one whose parent was evicted, or stored before the watch began).
  Colour: age (seconds before the view's last batch, the publisher's clock) or one colour per root; a ring:
  stored by the last batch; a bigger marker labelled "x2": the hash is held by two physical blocks.
- ``batch_activity_figure``: blocks stored (up) and removed (down, evictions) per batch, over the
  publisher's sequence numbers.
- ``cache_size_figure``: the cache's size in blocks after each batch, with the pool's usable size.
- ``rank_numbers`` / ``server_numbers``: every number the page shows per rank and from ``/metrics``, read
  from the mirror and ``engine.metrics`` (one definition of each ratio).
- ``state_line`` / ``batch_line``: a subscriber's state and one batch, in words;
  ``stream_caption``: its counts (malformed, duplicates, jumps, gaps, lost, before the watch), named.
- ``mirror_warnings``: what the page must say above a cache that is not the server's whole cache (from
  before a restart, started mid-stream, cut by the memory cap).

Units: blocks are physical KV blocks (``copies`` counted, as vLLM's events count them); a "prefix" is a
distinct block hash; tokens = blocks x block_size; times in seconds.
"""

from __future__ import annotations

import html
import time
from typing import Callable, Iterable

import plotly.graph_objects as go

from engine import metrics
from engine.watch.cache_mirror import hash_labels
from engine.records import plural  # noqa: F401  (the Server page reads it from here too)

from .colors import PALETTE

MAX_TREE_BLOCKS = 1500    # the tree draws at most this many blocks (the most recently stored)
MAX_BATCH_BARS = 300      # bars stay readable (a bar per batch) up to about this many: the latest are drawn
MAX_BATCH_POINTS = 2000   # the cache-size line draws at most this many batches (the latest)
# age colours: newest vermillion, then reddish purple, oldest blue (Okabe & Ito; all dark enough on white)
AGE_SCALE = [[0.0, "#D55E00"], [0.5, "#CC79A7"], [1.0, "#0072B2"]]
STORED, REMOVED, SIZE, POOL = "#0072B2", "#D55E00", "#009E73", "#7F7F7F"
HIGHLIGHT = "#009E73"  # the router view's cached prefix (Okabe & Ito bluish green)
VLLM_EVENTS_FLAG = ("--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                    "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'")


# ------------------------------------------------------------------------------------------------ numbers
def rank_numbers(mirror, num_gpu_blocks: int | None = None) -> dict:
    """One rank's cache in numbers: ``blocks`` (physical, copies counted), ``prefixes`` (distinct hashes),
    ``tokens``, ``roots`` (prefix trees), ``pool_share_pct`` (``metrics.cached_share_pct``; None without the
    pool's size), ``batches``, ``stored`` / ``removed`` (blocks over all batches), ``block_size``, ``groups``:
    for a hybrid server (KV cache groups, ``cache_mirror.PrefixCacheMirror.hybrid``) one ``{"group", "label",
    "blocks", "tokens"}`` per group (``blocks`` summing to the total), else [] (a single-group server reads as
    before)."""
    size = mirror.block_size or 0
    groups = ([{"group": g, "label": mirror.group_label(g), "blocks": n, "tokens": n * size}
               for g, n in mirror.group_blocks().items()] if mirror.hybrid else [])
    return {"blocks": mirror.num_blocks, "prefixes": len(mirror.blocks), "tokens": mirror.num_tokens,
            "roots": len(mirror.children().get(None, [])),
            "pool_share_pct": metrics.cached_share_pct(mirror.num_blocks, num_gpu_blocks),
            "batches": mirror.num_batches, "stored": mirror.total_stored, "removed": mirror.total_removed,
            "block_size": mirror.block_size, "groups": groups}


def copies_by_group(mirror, block) -> str:
    """``group 0 (sliding window, 48 tokens) x1, group 1 (full attention) x1``: which KV cache group holds each
    copy of a cached block (a hybrid server's; ``CachedBlock.groups``)."""
    counts: dict[int, int] = {}
    for g in block.copy_groups():
        counts[g] = counts.get(g, 0) + 1
    return ", ".join(f"{mirror.group_label(g)} x{n}" for g, n in sorted(counts.items()))


def groups_line(numbers: dict) -> str:
    """``cached blocks by KV cache group: group 0 (sliding window, 48 tokens) 2 · group 1 (full attention) 4``
    from ``rank_numbers``; "" for a single-group server."""
    if not numbers.get("groups"):
        return ""
    return "cached blocks by KV cache group: " + " · ".join(
        f"{g['label']} {g['blocks']:,}" for g in numbers["groups"])


def server_numbers(values: dict) -> dict:
    """A server's ``/metrics`` (``engine.watch.server_metrics.parse_metrics``) as the page shows them:
    ``kv_cache_usage_pct`` (vLLM's 0..1 gauge in %), ``hit_rate_pct`` (``metrics.server_hit_rate_pct``),
    ``preemptions``, ``running``, ``waiting``, ``num_gpu_blocks``, ``block_size``; None where absent."""
    count = (lambda name: None if values.get(name) is None else int(values[name]))  # noqa: E731
    return {"kv_cache_usage_pct": metrics.server_kv_usage_pct(values),
            "hit_rate_pct": metrics.server_hit_rate_pct(values), "preemptions": count("num_preemptions"),
            "running": count("num_requests_running"), "waiting": count("num_requests_waiting"),
            "num_gpu_blocks": values.get("num_gpu_blocks"), "block_size": values.get("block_size")}


def state_line(view, now: float | None = None) -> str:
    """A ``kv_subscriber.SubscriberView``'s state in words, with what to do about it."""
    now = time.time() if now is None else now
    state, endpoint = view.state, view.endpoint
    if state == "connecting":
        return f"connecting to {endpoint}"
    if state == "unreachable":
        return (f"unreachable: nothing listens at {endpoint}: is the server started with "
                f"--kv-events-config (enable_kv_cache_events, publisher zmq, endpoint on this port)?")
    if state == "connected":
        return "connected, waiting for events"
    if state == "live":
        return f"live: last batch {max(0.0, now - view.last_batch_at):.1f} s ago"
    if state == "idle":
        return f"idle: no batch for {max(0.0, now - view.last_batch_at):.0f} s"
    if state == "not_publisher":
        return (f"not a KV event publisher: {view.detail}" if getattr(view, "detail", None) else
                f"not a KV event publisher: {endpoint} answered, but not as a ZMQ publisher")
    if state == "disconnected":
        return "disconnected: the server went away; showing what was received"
    if state == "stopped":
        return "stopped: showing what was received"
    return state


STREAM_COUNTS_HELP = (
    "batches applied: live and replayed batches the view holds; from the replay socket: those of them asked "
    "for there (a late join, a gap). malformed: messages that are not a batch (bad frames or payload, over "
    "the size limit), skipped. duplicate or out of order: live batches numbered not above the last one, "
    "skipped. impossible sequence jumps: live batches numbered further past the last one than a publisher's "
    "replay buffer holds, that the next batch did not continue from (a corrupt number), skipped, not lost. "
    "gaps: runs of missing numbers while watching. lost: batches in those gaps that the replay socket did "
    "not return. before the watch began: batches published before the first one this watch saw (a late "
    "join): not lost, they predate the watch.")


def stream_caption(view) -> str:
    """A subscriber's counts (``kv_subscriber.SubscriberView``) in one line, each named, read from the view
    and never recomputed (``watch``'s final summary reads the same fields; ``STREAM_COUNTS_HELP`` says what
    each counts): ``batches 5 applied (0 from the replay socket) · malformed 1 · duplicate or out of order 1
    · impossible sequence jumps 1 · gaps 1 · lost 2 · before the watch began 40 (not lost)``."""
    return (f"batches {view.received:,} applied ({view.replayed:,} from the replay socket) · malformed "
            f"{view.malformed:,} · duplicate or out of order {view.duplicates:,} · impossible sequence jumps "
            f"{view.jumps:,} · gaps {view.gaps:,} · lost {view.lost:,} · before the watch began "
            f"{view.before_watch:,} (not lost)")


def mirror_warnings(mirror) -> list[str]:
    """Why the cache shown may not be the server's (``cache_mirror.PrefixCacheMirror``), one sentence each:
    the server restarted and its first batch has not come (``stale``), the view joined mid-stream without
    the batches before (``starts_at``), the view's memory cap dropped blocks (``capped_out``)."""
    out = []
    if mirror.stale:
        out.append(mirror.stale)
    if mirror.starts_at is not None:
        out.append(f"the view starts at batch {mirror.starts_at:,}: it joined a running server without the batches "
                   f"before (no replay endpoint, or it did not answer), so blocks stored before it are unknown")
    if mirror.capped_out:
        out.append(f"memory cap: the view holds at most {mirror.max_blocks:,} distinct blocks; the "
                   f"{mirror.capped_out:,} oldest-stored were dropped from it, so it shows fewer blocks than the "
                   f"server holds")
    return out


def batch_line(rank: int | str, summary, position: int | None = None, total: int | None = None) -> str:
    """One batch in words: ``batch 5 of 31: rank 0, #12: stored 2 blocks, removed 1 (evicted); cache 40
    blocks = 640 tokens`` (the position only when given). vLLM sends BlockRemoved when it evicts a cached
    block to reuse its memory."""
    where = f"batch {position:,} of {total:,}: " if position is not None and total is not None else ""
    if getattr(summary, "restarted", False):
        removed = (f"removed {summary.removed:,}; view reset: the publisher restarted (its cache starts empty, "
                   f"the blocks shown before were dropped)")
    elif summary.cleared:
        removed = f"removed {summary.removed:,}: all blocks cleared (AllBlocksCleared: the prefix cache was reset)"
    else:
        removed = f"removed {summary.removed:,} (evicted)" if summary.removed else "removed none"
    replayed = " (came from the replay socket)" if summary.replayed else ""
    who = rank if isinstance(rank, str) else f"rank {rank}"  # a stream's label (engine.watch.servers)
    return (f"{where}{who}, #{summary.seq}{replayed}: stored {summary.stored:,} "
            f"block{'s' * (summary.stored != 1)}, {removed}; cache {summary.num_blocks:,} "
            f"block{'s' * (summary.num_blocks != 1)} = {summary.num_tokens:,} tokens")


# --------------------------------------------------------------------------------------------- the tree
def tree_layout(mirror, max_blocks: int = MAX_TREE_BLOCKS) -> dict:
    """Positions of the most recently stored ``max_blocks`` blocks (insertion order of ``mirror.blocks``,
    which is the order they were stored; a hash stored again after its removal counts as new).

    Returns {"shown": [hash], "total": distinct hashes, "pos": {hash: (x, y)}, "edges": [(parent, child)],
    "roots": [hash], "root_of": {hash: root}}: x = blocks from its root, y = row (0 at the top)."""
    hashes = list(mirror.blocks)
    shown = hashes[-max_blocks:] if len(hashes) > max_blocks else hashes
    keep = set(shown)
    kids: dict[str, list[str]] = {}
    roots = []
    for h in shown:
        parent = mirror.blocks[h].parent
        if parent is not None and parent in keep and parent != h:
            kids.setdefault(parent, []).append(h)
        else:
            roots.append(h)
    pos: dict[str, tuple[int, int]] = {}
    root_of: dict[str, str] = {}
    edges: list[tuple[str, str]] = []
    row = 0

    def walk(root: str) -> None:  # iterative pre-order: a chain can be thousands of blocks long
        nonlocal row
        stack = [(root, 0, None)]
        while stack:
            h, depth, parent = stack.pop()
            if h in pos:
                continue  # a cycle in a malformed stream: draw each block once
            pos[h] = (depth, row)
            root_of[h] = root
            if parent is not None:
                edges.append((parent, h))
            children = [c for c in kids.get(h, []) if c not in pos]
            if not children:
                row += 1  # a leaf ends its row; the next branch starts below
            stack.extend((c, depth + 1, h) for c in reversed(children))

    for r in roots:
        walk(r)
    for h in shown:  # blocks on a parent cycle have no root: start one at the oldest
        if h not in pos:
            roots.append(h)
            walk(h)
    return {"shown": shown, "total": len(hashes), "pos": pos, "edges": edges, "roots": roots, "root_of": root_of}


def tree_hash_labels(mirror, shown: list[str]) -> dict[str, str]:
    """How the tree names each block it draws and each parent it names in a hover: ``hash_labels`` (as
    ``watch`` prints roots) over those hashes only, so labels on screen differ where hashes differ (a 16-digit
    int hash in full: hashes 1 and 2 were both "000000000000"; a longer bytes hash by 12 digits or as many
    more as it takes). Over the drawn blocks, not the whole mirror: 1,500 hashes take ~5 ms, the 100,000 of
    a capped mirror ~1 s, too long for a page redrawn every second."""
    parents = (mirror.blocks[h].parent for h in shown)
    return hash_labels([*shown, *(p for p in parents if p is not None)])


def _short(h: str | None, labels: dict[str, str]) -> str:
    return "none (a prompt's first block)" if h is None else labels[h]


HOVER_WIDTH = 56  # characters per hover line (a wide label is cut off at the figure's edge)


def _wrap(text: str, width: int = HOVER_WIDTH) -> str:
    """Hard-wrap plain text into <br>-separated lines (HTML-escaped), so a hover label stays narrow."""
    return "<br>".join(html.escape(text[i:i + width]) for i in range(0, len(text), width))


def _text(decode: Callable[[list[int]], str] | None, ids: list[int], limit: int = 168) -> str:
    if decode is None:
        return ""
    try:
        text = decode(ids)
    except Exception as exc:  # a tokenizer that cannot decode these ids (another model's vocabulary)
        return f"(cannot decode: {type(exc).__name__})"
    text = text if len(text) <= limit else text[:limit] + "..."
    return _wrap(repr(text)[1:-1])  # newlines and tabs shown as \n, \t: a block's text, exactly


def _ids(ids: list[int], limit: int = 32) -> str:
    shown = ", ".join(map(str, ids[:limit]))
    return _wrap(f"[{shown}{', ...' if len(ids) > limit else ''}]")


def prefix_tree_figure(mirror, decode: Callable[[list[int]], str] | None = None,
                       max_blocks: int = MAX_TREE_BLOCKS, now_ts: float | None = None, color_by: str = "age",
                       title: str | None = None, height: int | None = None, label: str | None = None,
                       highlight: Iterable[str] | None = None) -> go.Figure:
    """The cached blocks as a tree of prefixes (see the module docstring for the layout).

    Args:
        mirror: an ``engine.watch.cache_mirror.PrefixCacheMirror`` (one rank).
        decode: token ids -> text, for the hover (optional; the server's model's tokenizer).
        max_blocks: draw at most this many blocks, the most recently stored; the title says "showing N of M".
        now_ts: the time ages are measured to (seconds since the epoch, the publisher's clock); default the
            timestamp of the mirror's last batch, so a replay and a live view of the same batch agree.
        color_by: "age" (seconds since the block was stored) or "root" (one colour per prefix tree).
        label: how the title names the stream (default ``rank N``; a server's name when several are watched).
        highlight: hashes to mark (the router view's cached prefix of a prompt, ``engine.watch.router``): a
            thick green ring around each, drawn where the block is drawn.
    """
    if color_by not in ("age", "root"):
        raise ValueError(f"color_by must be 'age' or 'root', got {color_by!r}")
    fig = go.Figure()
    rank = f"{label or f'rank {mirror.rank}'}: "
    if not mirror.blocks:
        said = ("waiting for events: no block cached yet" if not mirror.num_batches else
                f"the cache is empty after {mirror.num_batches:,} batches (every stored block was removed)")
        fig.add_annotation(text=f"The prefix cache is empty<br>{said}", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper", font={"size": 16, "color": "#555555"})
        fig.update_layout(title=title or f"{rank}prefix tree (empty)", height=height or 260,
                          xaxis={"visible": False}, yaxis={"visible": False}, plot_bgcolor="white",
                          margin={"l": 10, "r": 10, "t": 40, "b": 10})
        return fig
    lay = tree_layout(mirror, max_blocks)
    pos, shown = lay["pos"], lay["shown"]
    if now_ts is None:
        now_ts = mirror.history[-1].ts if mirror.history else max(b.stored_ts for b in mirror.blocks.values())
    # edges: one trace, segments separated by None
    ex, ey = [], []
    for parent, child in lay["edges"]:
        (x0, y0), (x1, y1) = pos[parent], pos[child]
        ex += [x0, x1, None]
        ey += [y0, y1, None]
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line={"color": "#BBBBBB", "width": 1.5},
                             hoverinfo="skip", showlegend=False))
    n = len(shown)
    base = 13 if n <= 150 else 9 if n <= 600 else 6
    order = [h for h in shown if h in pos]
    hybrid = mirror.hybrid  # KV cache groups: each block's hover says which group holds each copy
    roots = {r: i for i, r in enumerate(lay["roots"])}
    xs, ys, sizes, colors, ages, hover, labels, rings = [], [], [], [], [], [], [], []
    last = mirror.last_seq
    labelled = n <= 400
    name = tree_hash_labels(mirror, order)
    for h in order:
        b = mirror.blocks[h]
        x, y = pos[h]
        age = max(0.0, now_ts - b.stored_ts)
        xs.append(x)
        ys.append(y)
        ages.append(age)
        sizes.append(base + 5 if b.copies > 1 else base)
        colors.append(PALETTE[roots[lay["root_of"][h]] % len(PALETTE)])
        labels.append(f"x{b.copies}" if b.copies > 1 and labelled else "")
        rings.append(b.stored_seq == last)
        text = _text(decode, b.token_ids)
        hover.append(
            f"block {name[h]}: tokens {x * b.block_size}-{(x + 1) * b.block_size - 1} from the root"
            f"<br>{_ids(b.token_ids)}" + (f"<br>text: {text}" if decode is not None else "")
            + f"<br>parent: {_short(b.parent, name)}<br>copies: {b.copies} physical block{'s' * (b.copies != 1)}"
            + (f" ({copies_by_group(mirror, b)})" if hybrid else "") +
            f"<br>stored by batch #{b.stored_seq}, {age:.1f} s before the last batch"
            + (f"<br>medium: {b.medium}" if b.medium else ""))
    marker = {"size": sizes, "line": {"color": ["#000000" if r else "#FFFFFF" for r in rings],
                                      "width": [2.5 if r else 0.5 for r in rings]}}
    if color_by == "age":
        top = max(ages) if ages and max(ages) > 0 else 1.0
        marker.update(color=ages, colorscale=AGE_SCALE, cmin=0, cmax=top, showscale=True,
                      colorbar={"title": {"text": "age (s)", "side": "right"}, "thickness": 12, "len": 0.8})
    else:
        marker["color"] = colors
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers+text" if labelled else "markers", text=labels,
                             textposition="top center", textfont={"size": 12}, marker=marker,
                             hovertext=hover, hoverinfo="text", showlegend=False, name="blocks"))
    marked = [h for h in (highlight or []) if h in pos]
    if marked:
        fig.add_trace(go.Scatter(x=[pos[h][0] for h in marked], y=[pos[h][1] for h in marked], mode="markers",
                                 marker={"size": base + 12, "color": "rgba(0,0,0,0)",
                                         "line": {"color": HIGHLIGHT, "width": 3}},
                                 hoverinfo="skip", showlegend=False, name="cached prefix"))
    total = lay["total"]
    # the trees of the whole view, as ``watch`` counts its prefix roots (``cache_mirror.children``), not only
    # of the blocks drawn (a capped drawing of 1,500 blocks holds a few of a view's 100 trees)
    trees = len(lay["roots"]) if total <= len(shown) else len(mirror.children().get(None, []))
    head = title or (f"{rank}{plural(total, 'prefix', 'prefixes')} in {plural(trees, 'tree')} "
                     f"({plural(mirror.num_blocks, 'block')} = {plural(mirror.num_tokens, 'token')})")
    sub = []
    if total > len(shown):
        sub.append(f"showing {len(shown):,} of {total:,} blocks (the most recently stored)")
    key = ["colour: age (s)" if color_by == "age" else "colour: one per tree", "ring: stored by the last batch"]
    if any(mirror.blocks[h].copies > 1 for h in order):
        key.append("xN: held by N blocks")
    if marked:
        key.append(f"green ring: the prompt's cached prefix ({plural(len(marked), 'block')})")
    sub.append(" · ".join(key))
    rows = max(ys) + 1
    deepest = max(xs)
    fig.update_layout(
        title={"text": f"{head}<br><sub>{'<br>'.join(sub)}</sub>", "font": {"size": 15}},
        height=height or max(300, min(760, 34 * rows + 110 + 16 * len(sub))), plot_bgcolor="white",
        margin={"l": 10, "r": 10, "t": 56 + 16 * len(sub), "b": 40}, hoverlabel={"align": "left"},
        xaxis={"title": {"text": "blocks from the root (a block's parent is to its left)"}, "tickformat": "d",
               "dtick": 1 if deepest <= 12 else None, "zeroline": False, "showgrid": False,
               "range": [-0.5, deepest + 0.5]},
        yaxis={"visible": False, "autorange": "reversed"})
    return fig


# ------------------------------------------------------------------------------------------- over time
def _latest(history: Iterable, max_batches: int) -> tuple[list, int]:
    items = list(history)
    return items[-max_batches:], len(items)


def _x(batches: list) -> tuple[list, str]:
    """Sequence numbers when they rise (the normal case), else the order received (a publisher restarted
    and numbered from 0 again)."""
    seqs = [b.seq for b in batches]
    if all(a < b for a, b in zip(seqs, seqs[1:])):
        return seqs, "batch (publisher's sequence number)"
    return list(range(len(batches))), "batch (in the order received; the sequence numbers restarted)"


def _reset_words(b) -> str:
    """', all cleared (AllBlocksCleared)', ', view reset (the publisher restarted)' or ''."""
    if getattr(b, "restarted", False):
        return ", view reset (the publisher restarted)"
    return ", all cleared (AllBlocksCleared)" if b.cleared else ""


def batch_activity_figure(history, max_batches: int = MAX_BATCH_BARS, title: str | None = None) -> go.Figure:
    """Blocks stored (up, blue) and removed (down, vermillion: evictions, or a reset) per batch, over the
    publisher's sequence numbers; a batch that cleared the cache (AllBlocksCleared) is marked with an x, a
    batch recovered from the replay socket is hatched. ``history``: ``BatchSummary`` list (one rank)."""
    batches, total = _latest(history, max_batches)
    xs, xtitle = _x(batches)
    hover = [f"#{b.seq}{' (replayed)' if b.replayed else ''}: +{b.stored:,} stored, -{b.removed:,} removed"
             f"{_reset_words(b)}; cache {b.num_blocks:,} blocks after" for b in batches]
    fig = go.Figure()
    # batches recovered from the replay socket are hatched, in traces of their own (a legend shows one pattern)
    for replayed in (False, True):
        part = [(x, b, h) for x, b, h in zip(xs, batches, hover) if b.replayed == replayed]
        if replayed and not part:
            continue
        marker = {"pattern": {"shape": "/"}} if replayed else {}
        for sign, name, color in ((1, "stored", STORED), (-1, "removed (evicted)", REMOVED)):
            fig.add_trace(go.Bar(x=[x for x, _, _ in part], y=[sign * (b.stored if sign > 0 else b.removed)
                                                               for _, b, _ in part],
                                 name=f"{name} (from the replay socket)" if replayed else name,
                                 marker={"color": color, **marker}, hovertext=[h for _, _, h in part],
                                 hoverinfo="text", showlegend=not replayed))
    if any(b.replayed for b in batches):  # one legend entry for the hatching, in neither colour
        fig.add_trace(go.Bar(x=[None], y=[None], name="hatched: from the replay socket (joined late or after a gap)", hoverinfo="skip",
                             marker={"color": "#FFFFFF", "line": {"color": "#555555", "width": 1},
                                     "pattern": {"shape": "/", "fgcolor": "#555555"}}))
    cleared = [(x, b) for x, b in zip(xs, batches) if b.cleared]
    if cleared:
        fig.add_trace(go.Scatter(x=[x for x, _ in cleared], y=[0] * len(cleared), mode="markers",
                                 name="all blocks cleared", marker={"symbol": "x", "size": 12, "color": "#000000"},
                                 hovertext=[f"#{b.seq}: {_reset_words(b)[2:]}" for _, b in cleared], hoverinfo="text"))
    shown = f" (the last {len(batches):,} of {total:,})" if total > len(batches) else ""
    fig.update_layout(
        title={"text": title or f"Blocks stored (up) and removed (down) per batch{shown}", "font": {"size": 14}},
        barmode="relative", bargap=0.15, height=300, margin={"l": 10, "r": 10, "t": 40, "b": 90},
        legend={"orientation": "h", "yanchor": "top", "y": -0.32, "x": 0, "font": {"size": 11}},
        plot_bgcolor="white",
        xaxis={"title": {"text": xtitle}, "tickformat": "d"},
        yaxis={"title": {"text": "blocks"}, "zeroline": True, "zerolinecolor": "#888888", "gridcolor": "#EEEEEE"})
    if not batches:
        fig.add_annotation(text="no batch yet", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    return fig


def cache_size_figure(history, num_gpu_blocks: int | None = None, max_batches: int = MAX_BATCH_POINTS,
                      title: str | None = None) -> go.Figure:
    """The cache's size after each batch: blocks (copies counted) and distinct prefixes; with the pool's
    usable size (vLLM's ``num_gpu_blocks`` less its null block) as a dashed line when known."""
    batches, total = _latest(history, max_batches)
    xs, xtitle = _x(batches)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[b.num_blocks for b in batches], name="cached blocks", mode="lines",
                             line={"color": SIZE, "width": 2, "shape": "hv"},
                             hovertemplate="#%{x}: %{y:,} blocks<extra></extra>"))
    fig.add_trace(go.Scatter(x=xs, y=[b.num_hashes for b in batches], name="distinct prefixes", mode="lines",
                             line={"color": "#56B4E9", "width": 1.5, "dash": "dot", "shape": "hv"},
                             hovertemplate="#%{x}: %{y:,} distinct<extra></extra>"))
    usable = metrics.usable_pool_blocks(num_gpu_blocks)
    top = max([b.num_blocks for b in batches] + [usable or 0, 1])
    if usable is not None:
        fig.add_hline(y=usable, line={"color": POOL, "dash": "dash"},
                      annotation_text=f"pool: {usable:,} usable blocks", annotation_position="top left")
    shown = f" (the last {len(batches):,} of {total:,} batches)" if total > len(batches) else ""
    fig.update_layout(
        title={"text": title or f"Cache size after each batch{shown}", "font": {"size": 14}},
        height=300, margin={"l": 10, "r": 10, "t": 40, "b": 90}, plot_bgcolor="white",
        legend={"orientation": "h", "yanchor": "top", "y": -0.32, "x": 0, "font": {"size": 11}},
        xaxis={"title": {"text": xtitle}, "tickformat": "d"},
        yaxis={"title": {"text": "blocks"}, "range": [0, top * 1.2], "gridcolor": "#EEEEEE", "tickformat": ",d"})
    return fig


def rates_figure(history, scrapes: list | None = None, bin_s: float | None = None, title: str | None = None
                 ) -> go.Figure:
    """Rates over time by the server's own clock (``engine.watch.rates.binned``): blocks evicted per second
    per time bin (bars; a star above a bin where a hot prefix was evicted), how long the evicted blocks had
    been cached (mean, a line on the right axis, seconds) and, when /metrics was read, the prefix-cache hit
    rate between consecutive reads (``metrics.windowed_hit_rate_pct``, a dotted line, % on the right axis is
    not shared: its values are in the hover and the legend says so).

    x: seconds since the first batch, the publisher's clock (``ts``), so a replay draws what the live view
    drew. ``scrapes``: (seconds on the same axis, values) oldest first."""
    from engine.watch.rates import binned, hit_rate_series

    b = binned(history, bin_s)
    fig = go.Figure()
    mid = [t + b["bin_s"] / 2 for t in b["t"]]
    fig.add_trace(go.Bar(x=mid, y=b["evictions_per_s"], name="evictions / s", marker_color=REMOVED,
                         width=b["bin_s"] * 0.9,
                         customdata=[[a if a is not None else "-"] for a in b["mean_evicted_age_s"]],
                         hovertemplate="%{x:.0f} s: %{y:.3g} blocks evicted / s; evicted blocks cached "
                                       "%{customdata[0]} s on average<extra></extra>"))
    ages = [(x, a) for x, a in zip(mid, b["mean_evicted_age_s"]) if a is not None]
    if ages:
        fig.add_trace(go.Scatter(x=[x for x, _ in ages], y=[a for _, a in ages], name="age at eviction (s, right)",
                                 mode="lines+markers", yaxis="y2", line={"color": "#CC79A7", "width": 1.5},
                                 hovertemplate="%{x:.0f} s: evicted after %{y:.0f} s cached<extra></extra>"))
    hot = [(x, e) for x, e, h in zip(mid, b["evictions_per_s"], b["hot_evicted"]) if h]
    if hot:
        fig.add_trace(go.Scatter(x=[x for x, _ in hot], y=[(e or 0) for _, e in hot], mode="markers",
                                 marker={"symbol": "star", "size": 14, "color": "#E69F00"},
                                 name="hot prefix evicted", hovertemplate="%{x:.0f} s: a hot prefix was evicted"
                                                                          "<extra></extra>"))
    if scrapes:
        series = hit_rate_series(scrapes, t0=0.0)
        pts = [(t, r) for t, r in zip(series["t"], series["hit_rate_pct"]) if r is not None]
        if pts:
            fig.add_trace(go.Scatter(x=[t for t, _ in pts], y=[r for _, r in pts], yaxis="y3", mode="lines+markers",
                                     name="hit rate between /metrics reads (%)",
                                     line={"color": "#009E73", "dash": "dot"},
                                     hovertemplate="%{x:.0f} s: hit rate %{y:.1f}% since the read before"
                                                   "<extra></extra>"))
    if not b["t"]:
        fig.add_annotation(text="no batch yet", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(
        title={"text": title or f"Evictions over time (bins of {b['bin_s']:g} s, the server's clock)",
               "font": {"size": 14}},
        height=300, margin={"l": 10, "r": 10, "t": 40, "b": 90}, plot_bgcolor="white", bargap=0.05,
        legend={"orientation": "h", "yanchor": "top", "y": -0.32, "x": 0, "font": {"size": 11}},
        xaxis={"title": {"text": "seconds since the first batch (server's clock)"}},
        yaxis={"title": {"text": "blocks / s"}, "rangemode": "tozero", "gridcolor": "#EEEEEE"},
        yaxis2={"overlaying": "y", "side": "right", "rangemode": "tozero", "showgrid": False,
                "title": {"text": "s"}},
        yaxis3={"overlaying": "y", "side": "right", "range": [0, 100], "visible": False})
    return fig


def rates_line(history) -> str:
    """The last minute of the server's clock in words (``engine.watch.rates.window_rates``)."""
    from engine.watch.rates import WINDOW_S, window_rates

    r = window_rates(history)
    if r["evictions_per_s"] is None:
        return "no batch yet"
    age = "" if r["mean_evicted_age_s"] is None else f", evicted after {r['mean_evicted_age_s']:.0f} s cached on average"
    hot = f"; {plural(r['hot_evicted'], 'hot prefix', 'hot prefixes')} evicted" if r["hot_evicted"] else ""
    return (f"last {min(WINDOW_S, r['seconds']):.0f} s of the server's clock: {r['evictions_per_s']:.3g} evictions / s "
            f"({plural(r['evicted'], 'block')}){age}, {r['stores_per_s']:.3g} stores / s{hot}")


TIER_COLORS = {"GPU": "#0072B2", None: "#0072B2", "CPU": "#E69F00"}  # other tiers: the palette after these
MAX_GROUP_BARS = 20


def groups_figure(mirror, decode: Callable[[list[int]], str] | None = None, top: int = MAX_GROUP_BARS,
                  label: str | None = None, groups: list | None = None) -> go.Figure:
    """A big pool by root prefix (``engine.watch.groups.root_groups``): one bar per prefix tree, the ``top``
    holding the most blocks, stacked by storage tier when the events carry more than one ``medium``; the
    label is the root block's text (or ids); the hover: distinct prefixes, longest chain, times extended
    (the events' sign of reuse), newest block's age. Built in O(blocks): 10^5 blocks in about 0.5 s of CPU."""
    from engine.watch.groups import root_groups

    groups = root_groups(mirror) if groups is None else groups  # ``groups``: already grouped (one pass)
    shown = groups[:top]
    media = sorted({m for g in groups for m in g.tiers}, key=lambda m: (m not in ("GPU", None), str(m)))
    now = mirror.history[-1].ts if mirror.history else max((g.newest_ts for g in groups), default=0.0)
    names = []
    for i, g in enumerate(shown):
        text = _text(decode, g.first_tokens, limit=40).replace("<br>", "") if decode else ""
        names.append(f"{i + 1}. {text or _ids(g.first_tokens, limit=6)}")
    fig = go.Figure()
    for j, m in enumerate(media):
        color = TIER_COLORS.get(m, PALETTE[(j + 2) % len(PALETTE)])
        fig.add_trace(go.Bar(
            y=names, x=[g.tiers.get(m, 0) for g in shown], orientation="h", name=str(m or "no medium"),
            marker_color=color, showlegend=len(media) > 1,
            customdata=[[g.distinct, g.depth, g.extended, max(0.0, now - g.newest_ts)] for g in shown],
            hovertemplate=("%{y}<br>%{x:,} blocks" + (f" in {m}" if len(media) > 1 else "") +
                           "<br>%{customdata[0]:,} distinct prefixes, longest chain %{customdata[1]:,} blocks"
                           "<br>extended %{customdata[2]:,} times (requests that went on past one of its blocks)"
                           "<br>newest block stored %{customdata[3]:.0f} s before the last batch<extra></extra>")))
    total = len(groups)
    more = f" (the {len(shown)} largest of {total:,})" if total > len(shown) else ""
    fig.update_layout(
        barmode="stack", plot_bgcolor="white",
        title={"text": f"{label or f'rank {mirror.rank}'}: {plural(mirror.num_blocks, 'block')} in "
                       f"{plural(total, 'prefix tree')}{more}, by root prefix", "font": {"size": 15}},
        height=max(260, min(760, 26 * len(shown) + 120)), margin={"l": 10, "r": 10, "t": 50, "b": 40},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 1, "xanchor": "right"},
        xaxis={"title": {"text": "blocks held (copies counted)"}, "gridcolor": "#EEEEEE", "tickformat": ",d"},
        yaxis={"autorange": "reversed", "automargin": True})
    if not groups:
        fig.add_annotation(text="The prefix cache is empty", showarrow=False, x=0.5, y=0.5, xref="paper",
                           yref="paper")
    return fig
