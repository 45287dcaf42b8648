"""A big pool made readable: its cached blocks grouped by root prefix, the top prefixes by blocks held and
by reuse, and its storage tiers apart.

A tree of 10^5 blocks cannot be read (the Server page draws at most 1,500); what an operator asks of a big
pool is which prompts hold it (a system prompt is one root: every conversation that starts with it is in
its tree) and which prefixes are reused. ``root_groups`` walks each block to its root once (O(blocks),
measured in ``tests/test_watch_servers_groups.py``: 10^5 blocks grouped and drawn well within a second).

Reuse, from the events alone: a cached block is *extended* when a later BlockStored names it as the parent
(a request whose cached prefix ended there went on past it: ``cache_mirror.extensions``). The events never
say what was hit; this is their own sign of reuse, and the hot-prefix note uses the same count.

Tiers: vLLM's ``BlockStored`` / ``BlockRemoved`` carry ``medium`` ("GPU", or "CPU" for blocks offloaded by a
KV connector); ``CachedBlock.media`` keeps each copy's tier, ``tiers`` counts them. A pool whose events carry
one tier (or none: older servers, SGLang) has one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RootGroup:
    """One prefix tree: ``root`` (its first block's hash), ``blocks`` (physical, copies counted),
    ``distinct`` (hashes), ``depth`` (its longest chain, blocks), ``extended`` (stores that went on past one
    of its blocks, the events' sign of reuse), ``tiers`` (medium -> copies), ``newest_ts`` (when its newest
    block was stored, the server's clock), ``first_tokens`` (the root block's token ids)."""
    root: str
    blocks: int = 0
    distinct: int = 0
    depth: int = 0
    extended: int = 0
    tiers: dict = field(default_factory=dict)
    newest_ts: float = 0.0
    first_tokens: list = field(default_factory=list)


def roots_of(mirror) -> dict[str, tuple[str, int]]:
    """hash -> (its root's hash, its depth from the root, 1-based), for every block in the view. A block
    whose parent is not in the view is a root (``cache_mirror.children``); a parent cycle (a malformed stream)
    is cut where it closes."""
    blocks = mirror.blocks
    out: dict[str, tuple[str, int]] = {}
    for h in blocks:
        if h in out:
            continue
        path, seen, cur = [], set(), h
        while cur in blocks and cur not in out and cur not in seen:
            seen.add(cur)
            path.append(cur)
            parent = blocks[cur].parent
            if parent is None or parent not in blocks:
                break
            cur = parent
        if cur in out:
            root, depth = out[cur]
        else:  # path[-1] is a root (or closes a cycle): it starts the chain
            root, depth = path[-1], 0
            path_root = path.pop()
            out[path_root] = (root, 1)
            depth = 1
        for node in reversed(path):
            depth += 1
            out[node] = (root, depth)
    return out


def root_groups(mirror) -> list[RootGroup]:
    """Every prefix tree of the view, most blocks first."""
    groups: dict[str, RootGroup] = {}
    blocks, extensions = mirror.blocks, mirror.extensions
    for h, (root, depth) in roots_of(mirror).items():
        b = blocks[h]
        g = groups.get(root)
        if g is None:
            g = groups[root] = RootGroup(root=root, first_tokens=list(blocks[root].token_ids))
        g.blocks += b.copies
        g.distinct += 1
        if depth > g.depth:
            g.depth = depth
        if h in extensions:
            g.extended += extensions[h]
        if len(b.media) == 1:  # the common case, without a dict per block
            g.tiers[b.media[0]] = g.tiers.get(b.media[0], 0) + 1
        else:
            for medium, n in b.tier_counts().items():
                g.tiers[medium] = g.tiers.get(medium, 0) + n
        if b.stored_ts > g.newest_ts:
            g.newest_ts = b.stored_ts
    return sorted(groups.values(), key=lambda g: (-g.blocks, -g.extended, g.root))


def top_extended(mirror, n: int = 10) -> list[tuple[str, int]]:
    """The ``n`` cached blocks most often extended (hash, count), most first: the prefixes requests reused
    and went on from (a system prompt's last block, typically)."""
    counts = [(h, n) for h, n in mirror.extensions.items() if h in mirror.blocks and n]
    return sorted(counts, key=lambda x: (-x[1], x[0]))[:n]


def tiers(mirror) -> dict:
    """medium -> physical blocks held there (None: events without a medium)."""
    out: dict = {}
    for b in mirror.blocks.values():
        for medium, n in b.tier_counts().items():
            out[medium] = out.get(medium, 0) + n
    return out


def tiers_line(counts: dict) -> str:
    """``GPU 1,200 blocks · CPU 3,400 blocks`` (tiers by size), or "" for a pool of one tier."""
    if len(counts) <= 1:
        return ""
    return " · ".join(f"{m or 'no medium'} {n:,} blocks" for m, n in sorted(counts.items(), key=lambda x: -x[1]))
