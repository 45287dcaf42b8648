"""Streamlit pieces the lessons share: step through a recorded engine run with the Playground's figures."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from viz import block_pool_figure, block_table_rows, swap_pool_figure

from .common import EngineRun


def _jump(key: str, steps: list[int], forward: bool) -> None:
    now = st.session_state.get(key, 1)
    later = [s for s in steps if (s > now if forward else s < now)]
    if later:
        st.session_state[key] = later[0] if forward else later[-1]


def step_through(run: EngineRun, key: str, decode=None, slot_mode: bool = False,
                 jump_kinds: tuple[str, ...] = ()) -> None:
    """A step slider over ``run``'s records with the pool, the swap pool, this step's events in words and
    the block tables. ``jump_kinds``: event kinds the "previous/next" buttons jump between."""
    n = len(run.records)
    if st.session_state.get(key, 1) > n:
        st.session_state[key] = n
    if jump_kinds:
        steps = [i + 1 for i, rec in enumerate(run.records) if any(e.kind in jump_kinds for e in rec.events)]
        c1, c2, c3 = st.columns([1, 1, 3])
        c1.button("◀ previous", key=f"{key}-prev", on_click=_jump, args=(key, steps, False), width="stretch",
                  help=f"The previous step with: {', '.join(jump_kinds)}")
        c2.button("next ▶", key=f"{key}-next", on_click=_jump, args=(key, steps, True), width="stretch",
                  help=f"The next step with: {', '.join(jump_kinds)}")
        shown = ", ".join(map(str, steps[:16])) + (", ..." if len(steps) > 16 else "")
        c3.caption(f"jumps between steps with {' / '.join(jump_kinds)}: {shown or 'none'}")
    i = st.slider("Step", 1, max(n, 2), key=key, disabled=n < 2) - 1
    rec = run.records[min(i, n - 1)]
    snap = rec.snapshot
    changed = sorted({b for e in rec.events if e.kind in ("allocate", "new_block", "cow", "fork", "free", "swap_in")
                      for b in e.blocks})
    st.caption(f"step {rec.step} of {n} ({rec.kind}) · running {', '.join(snap.running) or 'none'} · waiting "
               f"{', '.join(snap.waiting) or 'none'}" + (f" · swapped {', '.join(snap.swapped)}" if snap.swapped else "")
               + f" · free blocks {snap.num_free_blocks}/{snap.num_blocks}")
    st.plotly_chart(block_pool_figure(snap, run.request_ids, decode=decode, highlight=changed, slot_mode=slot_mode),
                    width="stretch", key=f"{key}-pool")
    if snap.num_swap_blocks:
        st.plotly_chart(swap_pool_figure(snap, run.request_ids), width="stretch", key=f"{key}-swap")
    lines = [e.message for e in rec.events if e.kind != "append"]
    appends = sum(e.kind == "append" for e in rec.events)
    if appends:
        lines.append(f"{appends} sequence(s) wrote their new token into a block with room")
    st.markdown("\n".join(f"- {x}" for x in lines) or "- nothing changed in the pool")
    rows = block_table_rows(snap, decode)
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
