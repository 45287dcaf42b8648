"""Streamlit pieces the lessons share: step through a recorded engine run with the Playground's figures."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from viz import block_pool_figure, block_table_rows, swap_pool_figure
from viz.colors import colour_key
from viz.steps import SEMANTICS_SHORT, step_label

from .common import EngineRun


KIND_WORDS = {"allocate": "allocations", "new_block": "new blocks", "free": "frees", "fork": "forks",
              "cow": "copy-on-write copies", "prefix_hit": "prefix-cache hits", "admit": "admissions",
              "preempt": "preemptions", "swap_out": "swaps out", "swap_in": "swaps in", "wait": "waits"}


def _set(key: str, value: int) -> None:
    st.session_state[key] = st.session_state[f"{key}:kept"] = value


def _kept(key: str) -> None:
    st.session_state[f"{key}:kept"] = st.session_state[key]


def step_through(run: EngineRun, key: str, decode=None, slot_mode: bool | None = None,
                 jump_kinds: tuple[str, ...] = (), show_text: bool = True) -> None:
    """A step slider over ``run``'s records with the pool, the swap pool, this step's events in words and
    the block tables. ``slot_mode``: one cell per slot (default: for pools of at most 16 blocks).
    ``show_text``: the block tables get a column of each sequence's generated text (with ``decode``); off
    where the replies carry no meaning (prompts cut mid-word to an exact length), so the table holds blocks.
    ``jump_kinds``: event kinds the "previous/next" buttons jump between. The chosen step is kept while the
    widget is off screen (e.g. while another run is selected)."""
    n = len(run.records)
    now = min(max(1, st.session_state.get(f"{key}:kept", 1)), n)
    st.session_state[key] = now  # set before the slider exists in this run (Streamlit drops unseen widgets' state)
    if jump_kinds:
        steps = [i + 1 for i, rec in enumerate(run.records) if any(e.kind in jump_kinds for e in rec.events)]
        earlier, later = [x for x in steps if x < now], [x for x in steps if x > now]
        words = ", ".join(KIND_WORDS.get(k, k) for k in jump_kinds)
        c1, c2, c3 = st.columns([1, 1, 3])
        c1.button("◀ previous", key=f"{key}-prev", on_click=_set, args=(key, earlier[-1] if earlier else now),
                  width="stretch", disabled=not earlier)
        c2.button("next ▶", key=f"{key}-next", on_click=_set, args=(key, later[0] if later else now),
                  width="stretch", disabled=not later)
        shown = ", ".join(map(str, steps[:16])) + (", ..." if len(steps) > 16 else "")
        c3.caption(f"the buttons jump between the steps with {words}: {shown or 'none'}")
    i = st.slider("Step", 1, max(n, 2), key=key, disabled=n < 2, on_change=_kept, args=(key,)) - 1
    rec = run.records[min(i, n - 1)]
    snap = rec.snapshot
    changed = sorted({b for e in rec.events
                      if e.kind in ("allocate", "new_block", "cow", "fork", "free", "swap_in", "swap_out")
                      for b in e.blocks})
    finished = sorted({e.request_id for e in rec.events if e.kind == "finish"})
    st.caption(f"step {rec.step} of {n} ({step_label(rec)}; {SEMANTICS_SHORT.get(rec.semantics, rec.semantics)} "
               f"semantics) · running {', '.join(snap.running) or 'none'} · waiting "
               f"{', '.join(snap.waiting) or 'none'}" + (f" · swapped {', '.join(snap.swapped)}" if snap.swapped else "")
               + (f" · finished this step {', '.join(finished)}" if finished else "")
               + f" · free blocks {snap.num_free_blocks}/{snap.num_blocks}")
    left, right = st.columns([3, 2])
    small = slot_mode if slot_mode is not None else snap.num_blocks <= 16
    left.plotly_chart(block_pool_figure(snap, run.request_ids, decode=decode, highlight=changed, slot_mode=small),
                      width="stretch", key=f"{key}-pool", config={"displayModeBar": False})
    left.caption(colour_key(snap))
    if snap.num_swap_blocks and run.events("swap_out"):  # only runs that swap show the CPU swap pool
        left.plotly_chart(swap_pool_figure(snap, run.request_ids), width="stretch", key=f"{key}-swap",
                          config={"displayModeBar": False})
    lines = [e.message for e in rec.events if e.kind != "append"]
    appends = sum(e.kind == "append" for e in rec.events)
    if appends:
        lines.append(f"{appends} sequence{'s' * (appends != 1)} wrote {'their' if appends != 1 else 'its'} new "
                     "token into a block with room")
    right.markdown("**This step, in words**\n\n" + ("\n".join(f"- {x}" for x in lines) or "- nothing changed"))
    rows = block_table_rows(snap, decode if show_text else None)
    if not (show_text and decode):
        rows = [{k: v for k, v in row.items() if k != "text"} for row in rows]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
