"""Lesson 2: contiguous allocation and its three kinds of waste, counted by the engine's
``ContiguousAllocator`` and ``BlockManager`` holding the requests' tokens (no model needed). The transfer
questions run the same allocator on situations the text does not work through: another reservation policy
(the vLLM paper's "Pow2" baseline) and another pair of finished requests, where the learner places a new
reservation first-fit. Each usual wrong answer (``Slip``) is computed from the same allocator runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine import metrics
from engine.block_manager import BlockManager
from engine.contiguous import ContiguousAllocator
from engine.records import Snapshot
from lessons.common import manager_snapshot
from lessons.exercise import Exercise, Slip, parse_int_list

REFERENCE = {"seed": 7, "n": 8, "max_len": 2048, "block_size": 16}
LENGTH_RANGE = (50, 900)  # numpy integers(low, high): 50..899 tokens
FRAG_SIZES = [2048, 1280, 2048, 1280, 2048]  # reservations (slots); the two small ones finish
PAGED_BANDS = [(0, 2, "under 2%"), (2, 20, "between 2% and 20%"), (20, 50, "between 20% and 50%"),
               (50, 100, "over 50%")]
POLICY = {"policy": "pow2", "capacity": 6400}  # the transfer: the same requests under another policy
FIRST_FIT = {"finished": ["R2", "R5"], "need": 1500}  # the allocator question: other finished requests

RECAP = [
    "Reserving the maximum length for every request left {{ contig_pct }} of the reference run's memory "
    "without a token; taking blocks of {{ block_size }} as tokens arrive left {{ paged_pct }}.",
    "Contiguous allocation wastes memory in three ways: reserved but not yet used, internal fragmentation "
    "(reserved past the reply's end) and external fragmentation (free gaps too small for a whole reservation).",
    "Smarter reservations (the next power of two, or the exact length if it were known) fit more requests, "
    "but each still needs one unbroken range, held from admission to the end.",
    "A reservation goes into one gap that can hold all of it; the free slots added up do not help, so a "
    "request can wait while plenty of memory is free.",
]


def draw_lengths(seed: int, n: int) -> list[int]:
    """``n`` final lengths drawn uniformly from 50..899 with numpy's default generator (seed 7, n 8: the
    lesson's reference run). Raises ValueError for a negative seed or n < 1."""
    if n < 1 or seed < 0:
        raise ValueError(f"need n >= 1 and seed >= 0, got n={n}, seed={seed}")
    return np.random.default_rng(seed).integers(*LENGTH_RANGE, n).tolist()


@dataclass
class WasteRun:
    """Both allocators holding each request's tokens at one moment. Slot counts are tokens."""

    layout: dict            # ContiguousAllocator.layout()
    snapshot: Snapshot      # the paged pool
    final_lengths: dict     # request id -> final length
    used: int
    reserved: int
    not_yet_used: int       # reserved slots a running request will still fill
    internal: int           # reserved slots past the reply's end (never used)
    paged_slots: int

    @property
    def contig_pct(self) -> float:
        return metrics.pct(self.reserved - self.used, self.reserved)

    @property
    def paged_blocks(self) -> int:
        return self.snapshot.num_used_blocks

    @property
    def paged_pct(self) -> float:
        return metrics.pct(self.paged_slots - self.used, self.paged_slots)


def waste_run(lengths: list[int], max_len: int, block_size: int, progress: int | None = None) -> WasteRun:
    """Give each request a ``max_len`` reservation in a region of ``len(lengths) * max_len`` slots and, in
    a paged pool of the same slots, the blocks its tokens fill; each holds ``min(length, progress)`` tokens (default: its
    final length). Raises ValueError naming a bad length or size."""
    lengths = list(lengths)
    if not lengths:
        raise ValueError("give at least one request length")
    for L in lengths:
        if not 1 <= L <= max_len:
            raise ValueError(f"length {L} is outside 1..{max_len} (the maximum length)")
    contiguous = ContiguousAllocator(len(lengths) * max_len, max_len)
    # the same memory for both: a pool of as many slots as the region (whole blocks, at least what is needed)
    paged = BlockManager(max(len(lengths) * max_len // block_size, sum(-(-L // block_size) for L in lengths)),
                         block_size)
    final = {}
    for i, L in enumerate(lengths):
        rid, held = f"R{i + 1}", max(1, min(L, progress or L))
        final[rid] = L
        contiguous.allocate(rid, held)
        paged.allocate(rid, held)
    layout = contiguous.layout()
    used = layout["used_slots"]
    reserved = used + layout["reserved_unused_slots"]
    not_yet = sum(final[r["seq_id"]] - r["used"] for r in layout["regions"])
    snap = manager_snapshot(paged)
    return WasteRun(layout, snap, final, used, reserved, not_yet, reserved - used - not_yet, snap.slots_allocated)


def reference_run(last_token: bool = True) -> WasteRun:
    """The reference run. ``last_token``: a request of final length L holds L slots, its last token's
    included (this lesson's convention, which keeps the used slots equal to the lengths' sum); False: L - 1,
    what an engine stores, since a finished request's last token is never fed back in (lesson 1)."""
    r = REFERENCE
    lengths = draw_lengths(r["seed"], r["n"])
    if not last_token:
        lengths = [max(1, L - 1) for L in lengths]
    return waste_run(lengths, r["max_len"], r["block_size"])


def stored_run() -> WasteRun:
    """The reference run counted as the engine stores it: each request without its last token."""
    return reference_run(last_token=False)


def fragmentation() -> tuple[ContiguousAllocator, BlockManager]:
    """Five reservations fill the region; the two small ones finish. Returns the region and a paged pool of
    the same slots holding the same three requests (as full as their reservations, the worst case)."""
    region = ContiguousAllocator(sum(FRAG_SIZES), max(FRAG_SIZES))
    for i, size in enumerate(FRAG_SIZES):
        region.allocate(f"R{i + 1}", size, reservation=size)
    small = [f"R{i + 1}" for i, s in enumerate(FRAG_SIZES) if s < max(FRAG_SIZES)]
    for rid in small:
        region.free(rid)
    B = REFERENCE["block_size"]
    pool = BlockManager(sum(FRAG_SIZES) // B, B)
    for i, size in enumerate(FRAG_SIZES):
        if f"R{i + 1}" not in small:
            pool.allocate(f"R{i + 1}", size)
    return region, pool


def policy_admission(lengths: list[int], policy: str, capacity: int, max_len: int = REFERENCE["max_len"],
                     overtake: bool = False) -> tuple[list[str], list[dict]]:
    """Admit requests of these final lengths, in arrival order, into a fresh region of ``capacity`` slots,
    each reserving what ``policy`` gives it (``ContiguousAllocator.reservation_for``), first-fit; first come,
    first served stops at the first request that does not fit (``overtake``: later ones still try, the
    slip). Returns (the admitted request ids, one row per request: id, final length, reservation,
    decision in the allocator's words)."""
    region = ContiguousAllocator(capacity, max_len, policy, max_model_len=max_len)
    admitted, rows, stopped = [], [], False
    for i, L in enumerate(lengths):
        rid = f"R{i + 1}"
        size = region.reservation_for(1, max_len, L)
        if stopped:
            rows.append({"request": rid, "final length": L, "reservation": size, "decision": "waits behind the head"})
            continue
        why = region.admission_refusal([[0]], size)
        if why is None:
            region.allocate(rid, min(L, size), reservation=size)
            admitted.append(rid)
            why = region.drain_events()[-1].message
        else:
            stopped = not overtake
        rows.append({"request": rid, "final length": L, "reservation": size, "decision": why})
    return admitted, rows


def _before_first_fit() -> ContiguousAllocator:
    """The fragmentation region's five reservations, then the ``FIRST_FIT`` requests finish."""
    region = ContiguousAllocator(sum(FRAG_SIZES), max(FRAG_SIZES))
    for i, size in enumerate(FRAG_SIZES):
        region.allocate(f"R{i + 1}", size, reservation=size)
    for rid in FIRST_FIT["finished"]:
        region.free(rid)
    region.drain_events()
    return region


def first_fit_run() -> tuple[ContiguousAllocator, int]:
    """``_before_first_fit``, then a new request reserves ``FIRST_FIT["need"]`` slots. Returns (the region
    after that, its event not drained; where the reservation starts). Raises RuntimeError if no gap fits.

    One convention for every request in the region, the new one too: each holds as many tokens as it
    reserved (the worst case, as in ``fragmentation``). This section is about where reservations lie, so
    the strip's used, reserved and unused figures all count whole reservations (0 slots reserved but not yet
    used), not one token of the new request against the full reservations of the others."""
    region = _before_first_fit()
    need = FIRST_FIT["need"]
    return region, region.allocate(f"R{len(FRAG_SIZES) + 1}", need, reservation=need)


def _pct(x: float) -> str:
    return f"{x:.1f}%"


def _slots(region: ContiguousAllocator) -> str:
    """Where each request's reservation lies, e.g. "R1 0-2,047 · R2 2,048-3,071"."""
    return " · ".join(f"{r['seq_id']} {r['start']:,}-{r['start'] + r['length'] - 1:,}" for r in region.layout()["regions"])


def facts(ctx) -> dict:
    run = ctx.memo(reference_run)
    stored = ctx.memo(stored_run)
    region, _ = fragmentation()
    small = min(FRAG_SIZES)
    return {"n_requests": len(run.final_lengths), "lengths": ", ".join(f"{L:,}" for L in run.final_lengths.values()),
            "max_len": REFERENCE["max_len"], "block_size": REFERENCE["block_size"], "reserved": run.reserved,
            "used": run.used, "contig_pct": _pct(run.contig_pct), "paged_blocks": run.paged_blocks,
            "paged_slots": run.paged_slots, "paged_pct": _pct(run.paged_pct), "frag_capacity": region.capacity,
            "frag_sizes": " / ".join(f"{s:,}" for s in FRAG_SIZES), "frag_small": f"{small:,}",
            "draw_lo": LENGTH_RANGE[0], "draw_hi": LENGTH_RANGE[1] - 1, "ref_seed": REFERENCE["seed"],
            "stored_used": f"{stored.used:,}", "stored_contig_pct": _pct(stored.contig_pct),
            "stored_paged_blocks": stored.paged_blocks, "stored_paged_pct": _pct(stored.paged_pct)}


def exercises(ctx) -> dict[str, Exercise]:
    run = ctx.memo(reference_run)
    B = REFERENCE["block_size"]
    band = next(label for lo, hi, label in PAGED_BANDS if lo <= run.paged_pct < hi)
    band_msgs = {
        "under 2%": "Less than that would need requests filling their last blocks almost exactly.",
        "between 2% and 20%": (f"That much would take requests only a few blocks long. These are hundreds of tokens "
                               f"long, and at most {B - 1} slots of each one's last block are empty."),
        "between 20% and 50%": ("That is what contiguous reservations sized close to each length waste; paging "
                                f"reserves nothing ahead, and only each request's last block of {B} can have "
                                "empty slots."),
        "over 50%": ("That is contiguous allocation's figure. Paging takes a block only when a token needs it, so "
                     "nothing is reserved ahead: only the unfilled end of each request's last block is empty."),
    }
    region, pool = fragmentation()
    need = max(FRAG_SIZES)
    refusal = region.admission_refusal([[0]], need)
    gaps = region.gaps()

    lengths = list(run.final_lengths.values())
    cap, policy = POLICY["capacity"], POLICY["policy"]
    fit, fit_rows = policy_admission(lengths, policy, cap)
    fit_max, _ = policy_admission(lengths, "max", cap)
    fit_exact, _ = policy_admission(lengths, "oracle", cap)
    fit_over, _ = policy_admission(lengths, policy, cap, overtake=True)
    refused = next((r for r in fit_rows if r["request"] not in fit), None)
    pow2_sizes = [(f"{r['final length']:,}", r["reservation"]) for r in fit_rows]

    before = _before_first_fit()
    ff_region, ff_start = first_fit_run()
    ff_gaps = before.gaps()
    ff_need = FIRST_FIT["need"]
    first_gap = ff_gaps[0]
    return {
        "contig_waste": Exercise(
            "contig_waste",
            "Every reply has ended, and each request still holds its reservation. Count one slot for every token "
            "of a request's final length, its last token included. What **percentage of the reserved slots** "
            "holds no token? (Within 5 points counts.)", "number", round(run.contig_pct, 1),
            tolerance=5.0, unit="%",
            explanation=(f"{run.reserved:,} slots reserved ({len(run.final_lengths)} × {REFERENCE['max_len']:,}), "
                         f"{run.used:,} used: ({run.reserved:,} − {run.used:,}) / {run.reserved:,} = "
                         f"{run.contig_pct:.1f}%. At this moment it is all internal fragmentation: the replies "
                         "are over, so none of it will ever be used."),
            slips=[Slip("used-share", round(100 - run.contig_pct, 1),
                        "That is the share that **did** hold tokens; the question asks for the empty share.")],
        ),
        "paged_waste": Exercise(
            "paged_waste",
            f"Now the same requests in blocks of {B} tokens, each taking only the blocks its "
            "tokens fill. What share of the allocated slots is empty?", "choice", band,
            options=[label for *_, label in PAGED_BANDS],
            explanation=(f"{run.paged_blocks} blocks = {run.paged_slots:,} slots for {run.used:,} tokens: "
                         f"{run.paged_pct:.1f}% empty. Only the last block of each request can have empty "
                         f"slots, at most {B - 1} per request."),
            slips=[Slip(f"band-{i}", label, band_msgs[label])
                   for i, (*_, label) in enumerate(PAGED_BANDS) if label != band],
            answer_phrases=[f"paged wastes {band}", f"paging wastes {band}", f"{run.paged_pct:.1f}% empty",
                            f"{run.paged_pct:.1f}% wasted", f"{run.paged_pct:.1f}% of the allocated"],
        ),
        "pow2_fit": Exercise(
            "pow2_fit",
            f"The same {len(lengths)} requests (final lengths {', '.join(f'{L:,}' for L in lengths)}) arrive in the "
            f"same order at a server whose region holds "
            f"{cap:,} slots, enough for {cap // REFERENCE['max_len']} maximum-length reservations and a little more. This server "
            "reserves the **next power of two** at or above each request's final length (the paper's \"Pow2\"). "
            "It places reservations first-fit and serves first come, first served: once a request does not fit, "
            "the ones behind it wait too. How many requests run at once?", "number", len(fit), unit="requests",
            explanation=(f"Powers of two: {', '.join(f'{r_[0]} → {r_[1]:,}' for r_ in pow2_sizes)}. "
                         + (f"After {len(fit)} of them, {refused['request']} needs {refused['reservation']:,} slots "
                            f"and {cap - sum(r_['reservation'] for r_ in fit_rows if r_['request'] in fit):,} are "
                            "left, so it waits, and so does everyone behind it. " if refused else "All of them fit. ")
                         + f"Reserving the maximum, {len(fit_max)} would run; the exact lengths (which no server "
                         f"knows in advance) would let {len(fit_exact)} run."),
            tags={"transfer"},
            slips=[
                Slip("max-length", len(fit_max),
                     f"That is the count when every request reserves the maximum {REFERENCE['max_len']:,}; this "
                     "server reserves less for a shorter request."),
                Slip("exact-length", len(fit_exact),
                     "You reserved each request's exact final length. Rounding up to a power of two reserves "
                     "more: 853 tokens take 1,024 slots, for example."),
                Slip("overtake", len(fit_over),
                     f"You let a later, shorter request overtake {refused['request'] + ', which' if refused else 'the one that'} "
                     "did not fit. First come, first served keeps the order: everyone behind it waits."),
            ],
        ),
        "frag_free": Exercise(
            "frag_free", "How many slots of the region are free now, in total?", "number", region.free_slots,
            unit="slots",
            explanation=(f"The two finished requests gave back {region.free_slots:,} slots, in gaps of "
                         f"{' and '.join(f'{g[1]:,}' for g in gaps)} slots."),
            slips=[Slip("one-gap", gaps[0][1], "That is one gap; both finished requests gave their slots back.")],
        ),
        "frag_admit": Exercise(
            "frag_admit", f"A new request arrives and needs a reservation of {need:,} slots. Can it start now?",
            "choice", "no" if refusal else "yes", options=["yes", "no"],
            explanation=(f"The engine's contiguous allocator answers: *{refusal or 'admitted'}*. That is "
                         f"external fragmentation. A paged pool of the same {pool.num_blocks} blocks of "
                         f"{pool.block_size} has {pool.num_free_blocks} free blocks "
                         f"({pool.num_free_blocks * pool.block_size:,} slots), and any of them will do: "
                         f"can it take {need:,} tokens? {'yes' if pool.can_allocate(need) else 'no'}."),
            slips=[Slip("added-gaps", "yes" if refusal else "no",
                        "Enough slots are free in total, but a reservation is one unbroken range, and no single "
                        "gap is large enough." if refusal else
                        "One gap is large enough for the whole reservation, so it can start.")],
            answer_phrases=(["cannot start now", "no single gap is large enough",
                             f"largest gap {max(g[1] for g in gaps):,} < {need:,}"] if refusal else
                            ["can start now", "one gap is large enough"]),
        ),
        "place_first_fit": Exercise(
            "place_first_fit",
            f"**Be the allocator.** Start again from the full region (all five reservations in place), but this time "
            f"{' and '.join(FIRST_FIT['finished'])} are the two that finish. A new request needs a reservation of "
            f"{ff_need:,} slots. Placing it first-fit (in the lowest-addressed gap that can hold all of it), at "
            "which **slot** does its reservation start?", "number", ff_start, unit="",
            explanation=(f"The gaps are {', '.join(f'{n:,} slots at {st:,}' for st, n in ff_gaps)}. The engine's "
                         f"allocator passed the first and reserved slots {ff_start:,} to {ff_start + ff_need - 1:,} "
                         f"in the second."),
            tags={"allocator", "transfer"},
            slips=[
                Slip("too-small-gap", first_gap[0],
                     f"That gap holds only {first_gap[1]:,} slots: a reservation must fit whole in one gap, so "
                     "first-fit passes it by."),
                Slip("end-of-region", ff_region.capacity - ff_need,
                     "First-fit puts a reservation at the **start** of the gap it chooses, not against the end "
                     "of the region."),
            ],
        ),
    }


def reveal_pow2_fit(ctx) -> None:
    import pandas as pd
    import streamlit as st

    run = ctx.memo(reference_run)
    _, rows = policy_admission(list(run.final_lengths.values()), POLICY["policy"], POLICY["capacity"])
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    st.caption("The engine's contiguous allocator, one request at a time in arrival order.")


WASTE_COLOUR_GAP = 110  # RGB distance: a request drawn beside the waste colours keeps at least this far from them


def _distance(a: str, b: str) -> float:
    return sum((int(a[i:i + 2], 16) - int(b[i:i + 2], 16)) ** 2 for i in (1, 3, 5)) ** 0.5


def picture_order(request_ids: list[str]) -> list[str]:
    """The request order to draw lesson 2's region strips with: the ids in order, with a placeholder
    wherever the next palette colour looks like one of the strip's waste colours (brown internal
    fragmentation, orange external fragmentation, pale purple reserved), so no request is drawn in a colour
    a reader could take for waste. Past the palette's base colours, tints and shades (48) no colour is
    skipped."""
    from viz.colors import BASE_PALETTE, EXTERNAL, INTERNAL, PALETTE_CYCLES, RESERVED, palette_color

    order: list[str] = []
    for rid in request_ids:
        while (len(order) < len(BASE_PALETTE) * len(PALETTE_CYCLES)
               and min(_distance(palette_color(len(order)), w) for w in (INTERNAL, EXTERNAL, RESERVED))
               < WASTE_COLOUR_GAP):
            order.append(f"(colour {len(order)} skipped)")
        order.append(rid)
    return order


def free_gaps_caption(layout: dict) -> str:
    """What the strip's pale free gaps are, from the allocator's layout: external fragmentation when the next
    reservation would fit in them together but in none alone; otherwise plain free slots, too few even
    joined."""
    gaps = [g["length"] for g in layout["gaps"]]
    if not gaps:
        return "No free gap is left."
    need = layout.get("external_frag_need") or layout["reservation"]
    total = sum(gaps)
    sizes = " + ".join(f"{g:,}" for g in gaps) + (f" = {total:,}" if len(gaps) > 1 else "")
    if layout.get("external_frag_slots", 0):
        return (f"Orange: free gaps ({sizes} slots) too small for a whole reservation of {need:,}, though together "
                "they would hold one (external fragmentation).")
    return (f"Palest grey: free slots ({sizes}). The legend counts 0 external fragmentation: a next reservation "
            f"of {need:,} slots would not fit even if the gaps were joined, so the region is short of memory, "
            "not fragmented.")


def reveal_frag_admit(ctx) -> None:
    import streamlit as st

    from viz import contiguous_region_figure

    region, _ = fragmentation()
    layout = region.layout()
    st.plotly_chart(contiguous_region_figure(layout, picture_order([f"R{i + 1}" for i in range(len(FRAG_SIZES))])),
                    width="stretch", key="l2_frag_fig")
    st.caption(free_gaps_caption(layout))


def reveal_place_first_fit(ctx) -> None:
    import streamlit as st

    from viz import contiguous_region_figure

    region, start = first_fit_run()
    layout = region.layout()
    st.plotly_chart(contiguous_region_figure(layout, picture_order([f"R{i + 1}" for i in range(len(FRAG_SIZES) + 1)])),
                    width="stretch", key="l2_first_fit_fig")
    st.caption(f"The region after the new request R{len(FRAG_SIZES) + 1} took slots {start:,} to "
               f"{start + FIRST_FIT['need'] - 1:,}: {_slots(region)}. Every reservation is drawn full, the new "
               "one's too: the picture is about where reservations lie, not what fills them. "
               + free_gaps_caption(layout))


# ----------------------------------------------------------------------------------------------- widget
def _redraw() -> None:
    import streamlit as st

    st.session_state["keep_l2_lengths"] = ", ".join(map(str, draw_lengths(int(st.session_state["keep_l2_seed"]),
                                                                     int(st.session_state["keep_l2_n"]))))


def _reference() -> None:
    import streamlit as st

    r = REFERENCE
    st.session_state.update(keep_l2_seed=r["seed"], keep_l2_n=r["n"], keep_l2_max=r["max_len"],
                            keep_l2_block=r["block_size"])
    _redraw()
    st.session_state.pop("keep_l2_progress", None)


def widget_waste(ctx) -> None:
    import streamlit as st

    from viz import contiguous_region_figure, paged_slots_figure
    from viz.colors import INTERNAL, RESERVED, SLACK

    if "keep_l2_lengths" not in st.session_state:
        _reference()
    with st.container(border=True):
        c = st.columns([1, 1, 1, 1, 1.2], vertical_alignment="bottom")
        c[0].number_input("Seed", 0, 2**31 - 1, step=1, key="keep_l2_seed", on_change=_redraw)
        c[1].number_input("Requests", 1, 64, step=1, key="keep_l2_n", on_change=_redraw)
        c[2].number_input("Max length", 1, 32768, step=128, key="keep_l2_max")
        c[3].number_input("Block size", 1, 1024, step=1, key="keep_l2_block")
        c[4].button("Reference run", on_click=_reference, width="stretch")
        st.text_input("Final lengths (tokens, comma-separated; drawn from the seed, or type your own)",
                      key="keep_l2_lengths")
        try:
            lengths = parse_int_list(st.session_state["keep_l2_lengths"], allow_none=False)
            final = waste_run(lengths, int(st.session_state["keep_l2_max"]), int(st.session_state["keep_l2_block"]))
        except ValueError as exc:
            st.error(f"Cannot run these settings: {exc}")
            return
        longest = max(lengths)
        # the slider's value lives in session state only (no default as well), clamped to the new lengths
        if st.session_state.get("keep_l2_progress", longest) > longest or "keep_l2_progress" not in st.session_state:
            st.session_state["keep_l2_progress"] = longest
        progress = st.slider("Decode progress: tokens each request holds (up to its final length)", 1, max(2, longest),
                             key="keep_l2_progress")
        run = waste_run(lengths, int(st.session_state["keep_l2_max"]), int(st.session_state["keep_l2_block"]), progress)
        order = picture_order(list(run.final_lengths))
        m = st.columns(4)
        m[0].metric("contiguous: empty", f"{run.contig_pct:.1f}%", help="reserved slots without a token")
        m[1].metric("of which not yet used", f"{run.not_yet_used:,}")
        m[2].metric("of which internal", f"{run.internal:,}")
        m[3].metric("paged: empty", f"{run.paged_pct:.1f}%", help="slots of allocated blocks without a token")
        left, right = st.columns(2)
        left.plotly_chart(contiguous_region_figure(run.layout, order, run.final_lengths), width="stretch",
                          key="l2_region", config={"displayModeBar": False})
        right.plotly_chart(paged_slots_figure(run.snapshot, order), width="stretch", key="l2_paged",
                           config={"displayModeBar": False})
        pool_slots = run.snapshot.num_blocks * run.snapshot.block_size
        scale = (f"Both strips draw the same {run.reserved:,} slots of memory on one scale."
                 if pool_slots == run.reserved else
                 f"The region has {run.reserved:,} slots; the paged pool, in whole blocks of "
                 f"{run.snapshot.block_size}, has {pool_slots:,}.")
        st.markdown(
            f'Contiguous: <span style="color:{RESERVED}">■</span> reserved, not yet used · '
            f'<span style="color:{INTERNAL}">■</span> internal fragmentation (past the reply\'s end) · coloured: '
            f'tokens, one colour per request. Paged: <span style="color:{SLACK}">■</span> light grey is the '
            f"unfilled end of a request's last block; "
            f"palest is free, for other requests. (Every reservation here has the same size, so no gaps form "
            f"between them; the third kind of waste comes below.) {scale} Final state: contiguous "
            f"{final.contig_pct:.1f}% vs paged {final.paged_pct:.1f}% empty.",
            unsafe_allow_html=True)


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)
