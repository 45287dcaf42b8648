"""Lesson 3: blocks and block tables. The life of one request on the embedded model (``LLMEngine``), a
scattered block table (``BlockManager``) for the "where does token t live" exercise, and the block-size
trade-off for one request."""

from __future__ import annotations

from engine import metrics
from engine.block_manager import BlockManager
from lessons import kv_math
from lessons.common import manager_snapshot, scenario_run
from lessons.exercise import Exercise

LIFE = "life-of-a-request"  # the scenario (engine/scenarios.py) the Playground button loads too
BUSY = {"num_blocks": 12, "block_size": 16, "tokens": [48, 48, 48, 48], "freed": ["R2", "R4"], "new": 70}
WHERE_T = 37  # the token the exercise asks about (a question, not an answer)
TRADE_TOKENS = 600
TRADE_SIZES = [1, 16, 64, 256]
TRADE_MODEL = "llama-2-7b"


# --------------------------------------------------------------------------------------------- runs
def life_run(loaded):
    return scenario_run(loaded, LIFE)


def busy_pool() -> tuple[BlockManager, str]:
    """Four requests fill the pool, two finish, a new one takes the freed blocks. Returns (pool, its id)."""
    b = BUSY
    bm = BlockManager(b["num_blocks"], b["block_size"])
    for i, n in enumerate(b["tokens"]):
        bm.allocate(f"R{i + 1}", n)
    for rid in b["freed"]:
        bm.free(rid)
    new = f"R{len(b['tokens']) + 1}"
    bm.allocate(new, b["new"])
    return bm, new


def tradeoff(tokens: int, bytes_per_token: int, sizes=TRADE_SIZES) -> list[dict]:
    """One row per block size: blocks, slots, empty slots and their bytes for a ``tokens``-token request,
    allocated by a ``BlockManager``."""
    rows = []
    for B in sizes:
        bm = BlockManager(-(-tokens // B), B)
        bm.allocate("R1", tokens)
        slots = bm.num_used_blocks * B
        empty = slots - tokens
        rows.append({"block size": B, "blocks": bm.num_used_blocks, "slots": slots, "empty slots": empty,
                     "empty %": round(metrics.pct(empty, slots), 1), "empty bytes": kv_math.human_bytes(empty * bytes_per_token)})
    return rows


def _llama_bpt() -> int:
    p = kv_math.model_presets()[TRADE_MODEL]
    return kv_math.bytes_per_token(p.config, p.dtype)


# -------------------------------------------------------------------------------------------- lesson
def _life(ctx):
    return ctx.run(life_run)


def _life_facts(ctx) -> dict:
    run = _life(ctx)
    first = run.records[0]
    return {"prompt_len": first.scheduled[0].num_tokens, "block_size": run.block_size, "num_blocks": run.num_blocks,
            "max_tokens": len(run.outputs[run.request_ids[0]].output_token_ids)}


def facts(ctx) -> dict:
    bm, new = busy_pool()
    return {**_life_facts(ctx), "busy_blocks": BUSY["num_blocks"], "busy_block_size": BUSY["block_size"],
            "busy_freed": " and ".join(BUSY["freed"]), "busy_request": new, "busy_tokens": BUSY["new"],
            "busy_table": str(bm.block_tables[new]), "trade_tokens": TRADE_TOKENS}


def exercises(ctx) -> dict[str, Exercise]:
    run = _life(ctx)
    life = _life_facts(ctx)
    B = run.block_size
    _, alloc = run.first("allocate")
    prefill = run.records[0].snapshot
    last = alloc.blocks[-1]
    _, new_block = run.first("new_block")
    bm, new = busy_pool()
    logical, offset = divmod(WHERE_T, bm.block_size)
    table = bm.block_tables[new]
    rows = {r["block size"]: r for r in tradeoff(TRADE_TOKENS, _llama_bpt())}
    r16, r256 = rows[16], rows[256]
    return {
        "prefill_blocks": Exercise(
            "prefill_blocks", f"Prefill writes the keys and values of all {life['prompt_len']} prompt tokens. How "
            f"many blocks of {B} does it take?", "number", len(alloc.blocks), unit="blocks",
            explanation=(f"ceil({life['prompt_len']} / {B}) = {len(alloc.blocks)}: the engine took blocks "
                         f"{alloc.blocks} from the free list.")),
        "last_fill": Exercise(
            "last_fill", "How many tokens does the **last** of those blocks hold after prefill?", "number",
            prefill.fills[last], unit="tokens",
            explanation=(f"Block {last} holds {prefill.fills[last]} of {B} slots; the other "
                         f"{B - prefill.fills[last]} wait for the reply's first tokens. The engine said: "
                         f"*{alloc.message}*")),
        "fourth_block": Exercise(
            "fourth_block", "Decode writes one token per step into the last block. At which **token position** "
            "(counting the prompt from 0) does the request take a fourth block?", "number",
            new_block.data["position"],
            explanation=(f"Positions up to {new_block.data['position'] - 1} fit in the first three blocks; token "
                         f"{new_block.data['position']} starts logical block {new_block.data['logical_block']}. "
                         f"The engine said: *{new_block.message}*")),
        "where_block": Exercise(
            "where_block", f"In {new}'s table {table}, which **physical block** holds token {WHERE_T}?", "number",
            bm.slot(new, WHERE_T) // bm.block_size,
            explanation=(f"{WHERE_T} // {bm.block_size} = logical block {logical}; the table's entry {logical} is "
                         f"physical block {table[logical]}.")),
        "where_slot": Exercise(
            "where_slot", f"And which **slot** of the pool (physical block × {bm.block_size} + offset)?", "number",
            bm.slot(new, WHERE_T),
            explanation=(f"offset {WHERE_T} % {bm.block_size} = {offset}; slot {table[logical]} × {bm.block_size} + "
                         f"{offset} = {bm.slot(new, WHERE_T)}, as the engine's slot mapping says.")),
        "trade_blocks": Exercise(
            "trade_blocks", f"At B = 16, how many blocks does a {TRADE_TOKENS}-token request take?", "number",
            r16["blocks"], unit="blocks",
            explanation=f"ceil({TRADE_TOKENS} / 16) = {r16['blocks']} blocks."),
        "trade_empty": Exercise(
            "trade_empty", "How many of those slots stay empty?", "number", r16["empty slots"], unit="slots",
            explanation=(f"{r16['blocks']} blocks × 16 = {r16['slots']} slots; {r16['slots']} − {TRADE_TOKENS} = "
                         f"{r16['empty slots']}; at Llama-2-7B's "
                         f"{kv_math.human_bytes(_llama_bpt())} per token that is {r16['empty bytes']}.")),
        "trade_256": Exercise(
            "trade_256", "At B = 256, what percentage of the request's allocation is empty? (Within 3 points.)",
            "number", r256["empty %"], tolerance=3.0, unit="%",
            explanation=(f"{r256['blocks']} blocks = {r256['slots']} slots, {r256['empty slots']} empty = "
                         f"{r256['empty %']}% ({r256['empty bytes']} at Llama-2-7B's size), for every such request.")),
    }


def reveal_fourth_block(ctx) -> None:
    import streamlit as st

    from viz import block_pool_figure

    run = _life(ctx)
    i, e = run.first("new_block")
    st.plotly_chart(block_pool_figure(run.records[i].snapshot, run.request_ids, decode=_decode(ctx),
                                      highlight=e.blocks, slot_mode=True, title=f"after step {i + 1}"),
                    width="stretch", key="l3_reveal_fourth")


def reveal_where_slot(ctx) -> None:
    import streamlit as st

    from viz import block_pool_figure

    bm, new = busy_pool()
    snap = manager_snapshot(bm)
    st.plotly_chart(block_pool_figure(snap, sorted(bm.block_tables), highlight=[bm.slot(new, WHERE_T) // bm.block_size],
                                      selected=new, slot_mode=True,
                                      title=f"{new}'s blocks framed in magenta; the block of token {WHERE_T} in black"),
                    width="stretch", key="l3_reveal_where")


def _decode(ctx):
    tokenizer = ctx.loaded[1]
    return lambda ids: tokenizer.decode(ids)


# ------------------------------------------------------------------------------------------- widgets
def widget_life(ctx) -> None:
    import streamlit as st

    from lessons.widgets import step_through

    with st.container(border=True):
        step_through(_life(ctx), "l3_step", _decode(ctx), slot_mode=True, jump_kinds=("allocate", "new_block", "free"))


def widget_locator(ctx) -> None:
    import streamlit as st

    bm, new = busy_pool()
    B = bm.block_size
    st.session_state.setdefault("keep_l3_t", 0)
    with st.container(border=True):
        st.markdown(f"**Try any token of {new}** (it holds {bm.num_tokens[new]} tokens).")
        t = int(st.number_input("token t", 0, bm.num_tokens[new] - 1, key="keep_l3_t"))
        logical, offset = divmod(t, B)
        table = bm.block_tables[new]
        st.markdown(f"token {t} → logical block {t} // {B} = **{logical}**, offset {t} % {B} = **{offset}** → "
                    f"table[{logical}] = physical block **{table[logical]}** → slot {table[logical]} × {B} + {offset}"
                    f" = **{bm.slot(new, t)}**")


def widget_tradeoff(ctx) -> None:
    import pandas as pd
    import streamlit as st

    from lessons.render import keep

    presets = kv_math.model_presets()
    with st.container(border=True):
        c1, c2 = st.columns(2)
        keep(keep_l3_trade_tokens=TRADE_TOKENS, keep_l3_trade_model=presets[TRADE_MODEL].name)
        tokens = int(c1.number_input("Request length (tokens)", 1, 1_000_000, key="keep_l3_trade_tokens"))
        names = [p.name for p in presets.values()]
        name = c2.selectbox("Bytes per token of", names, key="keep_l3_trade_model")
        p = next(p for p in presets.values() if p.name == name)
        bpt = kv_math.bytes_per_token(p.config, p.dtype)
        st.dataframe(pd.DataFrame(tradeoff(tokens, bpt, [1, 8, 16, 32, 64, 128, 256])), hide_index=True,
                     width="stretch")
        st.caption(f"{name}: {kv_math.human_bytes(bpt)} per token in {p.dtype}. Each row is a BlockManager "
                   "allocating the request.")


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)
