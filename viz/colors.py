"""One colour per request everywhere (pool, tables, text, charts).

The palette is Okabe & Ito's (2008) colour-universal design set, readable by people with the common
colour-vision deficiencies and distinct on a projector; it is extended with Paul Tol's muted set when more
than eight requests are on screen. States that are not a request use greys.
"""

from __future__ import annotations

OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
TOL_MUTED = ["#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499"]
# Okabe-Ito's black goes last: black also outlines what a step changed, so no early request should be black
PALETTE = OKABE_ITO[:-1] + TOL_MUTED + OKABE_ITO[-1:]

FREE = "#F2F2F2"         # a free block / slot
CACHED_FREE = "#D9D9D9"  # free, but still holding a cached prefix (prefix caching)
SHARED = "#7F7F7F"       # a block several sequences point at (the count is written on it)
SLACK = "#BDBDBD"        # allocated but unused (last-block slack, reserved-not-yet-used)
INTERNAL = "#8C510A"     # internal fragmentation (never-used reservation): brown, unlike any request colour
EXTERNAL = "#FDB863"     # external fragmentation (a gap too small for a reservation)
SELECTED = "#FF00FF"     # outline of the highlighted request's blocks (magenta: no request has it)


def request_id_of(seq_id: str) -> str:
    """Sequences "R3.1" (sample) and "R3.b2" (beam) belong to request "R3"."""
    return seq_id.split(".", 1)[0]


def request_color(request_id: str, order: list[str]) -> str:
    """The colour of ``request_id``; ``order`` is the list of request ids in first-seen order."""
    rid = request_id_of(request_id)
    idx = order.index(rid) if rid in order else sum(map(ord, rid))  # stable across processes
    return PALETTE[idx % len(PALETTE)]


def request_colors(order: list[str]) -> dict[str, str]:
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(order)}


def colour_key(snapshot, contiguous_layout: dict | None = None, selected: str | None = None,
               strips: bool = False) -> str:
    """The pool's colours now on screen, in one sentence: shared and cached blocks, external fragmentation
    (``contiguous_layout``, the contiguous strip) and the highlighted request (``selected``) only when
    something shows them. ``strips``: the slot strips are on screen too (their light grey is explained)."""
    parts = ["Colours: one per request"]
    if any(c > 1 for c in snapshot.ref_counts):
        parts.append("dark grey = a block shared by several sequences (its reference count is written on it): "
                     "forked samples or beams, or a prefix found in the prefix cache")
    if any(c == 0 and h for c, h in zip(snapshot.ref_counts, snapshot.block_hashes or [])):
        parts.append("light grey \"cached\" = free, but still holding a prefix the prefix cache can reuse")
    if strips:
        parts.append("light grey strip cells = last-block slack / reserved but not used")
    if contiguous_layout and contiguous_layout.get("external_frag_slots"):
        parts.append("orange = external fragmentation (gaps too small for a reservation, though together "
                     "they would hold one)")
    parts.append("palest grey = free. Outlined black: the blocks this step took, copied, swapped out or freed")
    if selected:
        parts.append(f"magenta: {selected}'s blocks")
    return "; ".join(parts) + "."
