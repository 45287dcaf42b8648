"""One colour per request everywhere (pool, tables, text, charts).

The palette is Okabe & Ito's (2008) colour-universal design set without its black, readable by people with
the common colour-vision deficiencies and distinct on a projector, extended with Paul Tol's muted set: 16
base colours. It never runs out: request 17 onwards cycle through the 16 again, first as lighter tints, then
as darker shades (``PALETTE_CYCLES``), and every cell also carries its request's id. No request colour is
black (the outline of what a step changed), magenta (the highlighted request's outline) or a grey (free,
cached, shared, slack). States that are not a request use greys.
"""

from __future__ import annotations

OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
TOL_MUTED = ["#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499"]
OUTLINE = "#000000"  # the outline of the blocks a step changed: no request may have it
BASE_PALETTE = OKABE_ITO[:-1] + TOL_MUTED  # 16 colours, Okabe-Ito's black left out (it is the outline colour)
# Request i gets BASE_PALETTE[i % 16] mixed with white or black by cycle (i // 16): the base, a tint, a shade,
# then again (the request id written in every cell tells two requests of one colour apart).
PALETTE_CYCLES = ((None, 0.0), ("#FFFFFF", 0.4), ("#000000", 0.4))


def _mix(color: str, toward: str | None, amount: float) -> str:
    """``color`` moved ``amount`` (0..1) of the way toward ``toward`` (hex), as a hex colour."""
    if toward is None or amount == 0:
        return color
    a = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    b = [int(toward[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * amount):02X}" for x, y in zip(a, b))


def palette_color(index: int) -> str:
    """The colour of the ``index``-th request (0-based), for any index >= 0 (see ``PALETTE_CYCLES``)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"a palette index is an integer >= 0, got {index!r}")
    cycle, base = divmod(index, len(BASE_PALETTE))
    toward, amount = PALETTE_CYCLES[cycle % len(PALETTE_CYCLES)]
    return _mix(BASE_PALETTE[base], toward, amount)


PALETTE = [palette_color(i) for i in range(len(BASE_PALETTE) * len(PALETTE_CYCLES))]  # one full round

FREE = "#F2F2F2"         # a free block / slot
CACHED_FREE = "#D9D9D9"  # free, but still holding a cached prefix (prefix caching)
SHARED = "#7F7F7F"       # a block several sequences point at (the count is written on it)
SLACK = "#BDBDBD"        # paged: allocated but unused (the unfilled tail of last blocks)
# The contiguous baseline's three kinds of waste, from ColorBrewer's colour-blind-safe PuOr / BrBG schemes at
# three lightness levels (pale, dark, mid), so they differ by lightness too, for every colour vision:
RESERVED = "#B2ABD2"     # reserved, not yet used (a running request's future slots): pale purple, not grey
INTERNAL = "#8C510A"     # internal fragmentation (never-used reservation): dark brown
EXTERNAL = "#FDB863"     # external fragmentation (a gap too small for a reservation): light orange
SELECTED = "#FF00FF"     # outline of the highlighted request's blocks (magenta: no request has it)
TEXT = "#1A1A1A"         # labels drawn on boxes and on white: near-black, so every label on a tinted fill
#                          keeps a WCAG contrast of at least 4.5:1 (``contrast_ratio``; Streamlit's Plotly theme
#                          would otherwise draw them in its pale grey)


def relative_luminance(color: str) -> float:
    """WCAG 2.1 relative luminance of ``#RRGGBB`` (0 black .. 1 white)."""
    if not (isinstance(color, str) and len(color) == 7 and color[0] == "#"):
        raise ValueError(f"a colour is '#RRGGBB', got {color!r}")
    channels = []
    for i in (1, 3, 5):
        c = int(color[i:i + 2], 16) / 255
        channels.append(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
    r, g, b = channels
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(a: str, b: str) -> float:
    """WCAG 2.1 contrast ratio of two colours (1..21; text needs >= 4.5 at normal sizes)."""
    la, lb = sorted((relative_luminance(a), relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def request_id_of(seq_id: str) -> str:
    """Sequences "R3.1" (sample) and "R3.b2" (beam) belong to request "R3"."""
    return seq_id.split(".", 1)[0]


def request_color(request_id: str, order: list[str]) -> str:
    """The colour of ``request_id``; ``order`` is the list of request ids in first-seen order."""
    rid = request_id_of(request_id)
    idx = order.index(rid) if rid in order else sum(map(ord, rid))  # stable across processes
    return palette_color(idx)


def request_colors(order: list[str]) -> dict[str, str]:
    return {rid: palette_color(i) for i, rid in enumerate(order)}


def colour_key(snapshot, contiguous_layout: dict | None = None, selected: str | None = None,
               strips: bool = False) -> str:
    """The pool's colours now on screen, in one sentence: shared and cached blocks, external fragmentation
    (``contiguous_layout``, the contiguous strip) and the highlighted request (``selected``) only when
    something shows them. ``strips``: the slot strips are on screen too (the paged strip's light grey is
    explained, and with ``contiguous_layout`` the contiguous strip's purple and brown, apart from it)."""
    parts = ["Colours: one per request"]
    if any(c > 1 for c in snapshot.ref_counts):
        parts.append("dark grey = a block shared by several sequences (its reference count is written on it): "
                     "forked samples or beams, or a prefix found in the prefix cache")
    if any(c == 0 and h for c, h in zip(snapshot.ref_counts, snapshot.block_hashes or [])):
        parts.append("light grey \"cached\" = free, but still holding a prefix the prefix cache can reuse")
    if strips:
        parts.append("light grey paged strip cells = last-block slack (the unfilled end of a last block)")
        if contiguous_layout is not None:
            parts.append("contiguous strip: pale purple = reserved, not yet used (a sequence's future slots, or a "
                         "spare row for a sample or beam not forked yet), dark brown = internal fragmentation "
                         "(reserved past a known final length)")
    if contiguous_layout and contiguous_layout.get("external_frag_slots"):
        parts.append("orange = external fragmentation (gaps too small for a reservation, though together "
                     "they would hold one)")
    if getattr(snapshot, "kv_cache_groups", None):  # a hybrid model: a block's KV cache group on its cell
        parts.append("\"win\" / \"full\" on a block = the KV cache group whose table holds it (sliding-window or "
                     "full-attention layers; the groups share the one pool)")
    parts.append("palest grey = free. Outlined black: the blocks this step took, copied, swapped out or freed"
                 + (" (a block that left a window too)" if getattr(snapshot, "kv_cache_groups", None) else ""))
    if selected:
        parts.append(f"magenta: {selected}'s blocks")
    return "; ".join(parts) + "."
