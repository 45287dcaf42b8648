"""Lesson 4: sharing and copy-on-write. The practice runs on the engine's ``BlockManager`` (block size 4,
8 blocks); the real-model part runs ``LLMEngine`` on the parallel-sampling and shared-prefix scenarios."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.scenarios import get_scenario
from lessons.common import manager_snapshot, scenario_run
from lessons.exercise import Exercise

NUM_BLOCKS, BLOCK_SIZE = 8, 4
MAIN = (6, [("fork", "B", "A"), ("append", "A"), ("append", "B")])
V1 = (8, [("fork", "B", "A"), ("append", "A")])
V2 = (6, [("fork", "B", "A"), ("fork", "C", "A"), ("append", "A"), ("append", "B"), ("append", "C")])
V3 = (6, MAIN[1] + [("release", "A")])
CHAT = {"system": 1600, "chats": 50, "own": 24, "block_size": 16}
SERVE = {"system": 500, "own": 300, "block_size": 16}
B_COPY_OPTIONS = {"cow": "yes, it copies block {b} first", "append": "no, it writes into block {b} in place",
                  "new_block": "it takes a fresh, empty block"}


@dataclass
class Stage:
    """The pool after one operation of the practice."""

    label: str
    tables: dict[str, list[int]]
    counts: list[int]
    free: list[int]
    events: list
    bm: BlockManager


def practice(prompt_len: int, ops: list[tuple]) -> list[Stage]:
    """Replay the practice on a fresh ``BlockManager``: A allocates ``prompt_len`` tokens, then each op
    ("fork", child, parent) / ("append", seq) / ("release", seq). Stage 0 is right after A's prompt."""
    import copy

    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    bm.allocate("A", prompt_len)
    stages = [Stage(f"A's {prompt_len}-token prompt", copy.deepcopy(bm.block_tables), list(bm.ref_counts),
                    list(bm.free_block_queue), bm.drain_events(), copy.deepcopy(bm))]
    for op in ops:
        if op[0] == "fork":
            bm.fork(op[2], op[1])
            label = f"{op[1]} forked from {op[2]}"
        elif op[0] == "append":
            bm.append_slot(op[1])
            label = f"{op[1]} writes one token"
        else:
            bm.free(op[1])
            label = f"release({op[1]})"
        stages.append(Stage(label, copy.deepcopy(bm.block_tables), list(bm.ref_counts), list(bm.free_block_queue),
                            bm.drain_events(), copy.deepcopy(bm)))
    return stages


def chat_example() -> dict:
    """50 chats behind one 1,600-token system prompt, prefix caching on; then the first chat ends."""
    c = CHAT
    B = c["block_size"]
    system = list(range(1, c["system"] + 1))
    per_chat = -(-(c["system"] + c["own"]) // B) - c["system"] // B
    bm = BlockManager(c["system"] // B + c["chats"] * per_chat, B, enable_prefix_caching=True)
    for i in range(c["chats"]):
        bm.allocate(f"chat{i}", c["system"] + c["own"], system + [10_000 + 100 * i + j for j in range(c["own"])])
    shared = bm.block_tables["chat0"][: c["system"] // B]
    before = bm.ref_counts[shared[0]]
    freed = bm.free("chat0")
    return {"shared": shared, "freed": freed, "freed_shared": sorted(set(freed) & set(shared)),
            "count_before": before, "count_after": bm.ref_counts[shared[0]], "private_freed": len(freed)}


def serving_example() -> dict:
    """Two requests behind one 500-token system prompt: which of their blocks are shared."""
    s = SERVE
    B = s["block_size"]
    bm = BlockManager(2 * (-(-(s["system"] + s["own"]) // B)), B, enable_prefix_caching=True)
    system = list(range(1, s["system"] + 1))
    for i in range(2):
        bm.allocate(f"R{i + 1}", s["system"] + s["own"], system + [10_000 + 1_000 * i + j for j in range(s["own"])])
    shared = [b for b in bm.block_tables["R1"] if bm.ref_counts[b] == 2]
    return {"shared": len(shared), "partial": -(-s["system"] // B)}


def parallel_run(loaded):
    return scenario_run(loaded, "parallel-sampling")


def prefix_run(loaded, caching: bool):
    return scenario_run(loaded, "shared-prefix", enable_prefix_caching=caching)


def ordinal(n: int) -> str:
    """1 -> "1st", 2 -> "2nd", 12 -> "12th", 32 -> "32nd"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _table_text(stage: Stage) -> str:
    tables = " · ".join(f"{s} → {t}" for s, t in stage.tables.items())
    counts = ", ".join(f"{b}: {c}" for b, c in enumerate(stage.counts) if c)
    return f"{tables} · reference counts {{{counts}}} · free list {stage.free}"


# -------------------------------------------------------------------------------------------- lesson
def facts(ctx) -> dict:
    from engine.scenarios import SYSTEM_PROMPT

    main = practice(*MAIN)
    chat = chat_example()
    serve = serving_example()
    par = ctx.run(parallel_run)
    tokenizer = ctx.loaded[1]
    requests = get_scenario("shared-prefix").make(0, lambda t: tokenizer(t, add_special_tokens=False)["input_ids"])
    return {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "last_block": NUM_BLOCKS - 1, "prompt": MAIN[0],
            "a_table": str(main[0].tables["A"]),
            "practice_blocks": main[-1].bm.num_used_blocks, "copies_blocks": 2 * len(main[0].tables["A"]),
            "chat_blocks": len(chat["shared"]), "chats": CHAT["chats"], "chat_system": f"{CHAT['system']:,}",
            "chat_block_size": CHAT["block_size"], "serve_prompt": SERVE["system"], "serve_block_size": SERVE["block_size"],
            "serve_shared": serve["shared"], "serve_partial": ordinal(serve["partial"]),
            "ps_prompt": par.records[0].scheduled[0].num_tokens, "ps_n": len(par.records[0].snapshot.sequences),
            "ps_block_size": par.block_size, "sp_requests": len(requests.requests),
            "sp_prompt": len(tokenizer(SYSTEM_PROMPT, add_special_tokens=False)["input_ids"])}


def exercises(ctx) -> dict[str, Exercise]:
    main, v1, v2, v3 = practice(*MAIN), practice(*V1), practice(*V2), practice(*V3)
    a_write, b_write = main[2].events[0], main[3].events[0]
    shared_block = main[1].tables["A"][-1]
    b_answer = B_COPY_OPTIONS[b_write.kind].format(b=shared_block)
    why = ["When A wrote, block {b} had count 2; when B wrote, its count was already 1",
           "B is the original sequence and A is the copy", "Copy-on-write only copies every other write",
           "B's token went into a new block, so there was nothing to copy"]
    why = [w.format(b=shared_block) for w in why]
    count_at_b = main[2].counts[shared_block]
    why_answer = why[0] if (a_write.kind == "cow" and b_write.kind == "append" and count_at_b == 1) else why[3]
    v1_event = v1[-1].events[0]
    v2_copies = sum(e.kind == "cow" for s in v2 for e in s.events)
    first_two = v2[0].tables["A"]
    chat = chat_example()
    par = ctx.run(parallel_run)
    pre, pre_off = ctx.run(prefix_run, True), ctx.run(prefix_run, False)
    _, hit = pre.first("prefix_hit")
    par_after = par.records[1].snapshot
    cows = par.events("cow")
    in_step = sum(e.kind == "cow" for e in par.records[1].events)
    used_on, used_off = pre.records[0].snapshot.num_used_blocks, pre_off.records[0].snapshot.num_used_blocks
    return {
        "p_fork": Exercise("p_fork", "What are the reference counts of A's blocks, in table order?", "list",
                           [main[1].counts[b] for b in main[1].tables["A"]],
                           explanation=f"Forking copies the table, not the blocks: {_table_text(main[1])}"),
        "p_a_table": Exercise("p_a_table", "What is A's block table after its write?", "list", main[2].tables["A"],
                              explanation=(f"The engine said: *{a_write.message}*. Tables now: "
                                           + " · ".join(f"{q} → {t}" for q, t in main[2].tables.items()))),
        "p_a_counts": Exercise("p_a_counts", "And the reference counts of blocks 0, 1 and 2?", "list",
                               main[2].counts[:3], explanation=_table_text(main[2])),
        "p_b_copy": Exercise("p_b_copy", "Does B copy a block before it writes?", "choice", b_answer,
                             options=[o.format(b=shared_block) for o in B_COPY_OPTIONS.values()],
                             explanation=f"The engine said: *{b_write.message}*. {_table_text(main[3])}"),
        "p_why": Exercise("p_why", "Why did A have to copy, but B did not a moment later?", "choice", why_answer,
                          options=why,
                          explanation=(f"Copy-on-write looks at the count at the moment of the write. A's copy "
                                       f"lowered block {shared_block}'s count to {count_at_b}, so B was its only "
                                       "owner by then and could write in place.")),
        "v1_block": Exercise("v1_block", f"**Variation 1.** A's prompt has {V1[0]} tokens (both blocks full), B "
                             "is forked, and A writes one token. Which physical block does that token go into?",
                             "number", v1[-1].tables["A"][-1],
                             explanation=(f"The engine said: *{v1_event.message}*. No copy: the full blocks stay "
                                          f"shared, and the new token starts a new logical block in a fresh block. "
                                          f"{_table_text(v1[-1])}")),
        "v2_counts": Exercise("v2_counts", f"**Variation 2.** A has {V2[0]} tokens; B and then C are forked from A; "
                              f"then A, B and C each write one token, in that order. Predict three numbers: the "
                              f"count of block {first_two[0]} afterwards, the count of block {first_two[1]}, and how "
                              "many copies the three writes made.", "list",
                              [v2[-1].counts[b] for b in first_two] + [v2_copies],
                              explanation=(" ".join(f"*{e.message}*." for st_ in v2[-3:] for e in st_.events)
                                           + f" {v2_copies} copies in three writes: the last writer owns the "
                                           f"original alone by then. {_table_text(v2[-1])}")),
        "v3_free": Exercise("v3_free", "**Variation 3.** Back to the end of the practice (A and B have written). "
                            "Now A finishes: release(A) lowers the count of each block in A's table and frees "
                            "those that reach zero. Which blocks become free? (Write *none* if none.)", "set",
                            sorted(v3[-1].events[0].blocks),
                            explanation=f"The engine said: *{v3[-1].events[0].message}*. {_table_text(v3[-1])}"),
        "chat_free": Exercise("chat_free", f"One of the {CHAT['chats']} conversations ends. How many of the "
                              f"{len(chat['shared'])} shared system-prompt blocks become free?", "number",
                              len(chat["freed_shared"]), unit="blocks",
                              explanation=(f"None: their counts drop from {chat['count_before']} to "
                                           f"{chat['count_after']}. Only the chat's private blocks are freed: its "
                                           f"own {CHAT['own']} tokens after the system prompt filled "
                                           f"{chat['private_freed']} blocks of {CHAT['block_size']}.")
                              if not chat["freed_shared"] else ""),
        "ps_blocks": Exercise("ps_blocks", f"Prefill writes the prompt once and forks the other samples from it. "
                              f"How many blocks are in use after the **first decode step**, when each of the "
                              f"{len(par_after.sequences)} samples has written one token?", "number",
                              par_after.num_used_blocks, unit="blocks",
                              explanation=" ".join(f"*{e.message}*." for e in par.records[1].events
                                                   if e.kind != "append")
                              + f" {len(cows)} copies in the whole run, "
                              + (f"all {in_step} in this step" if in_step == len(cows) else f"{in_step} of them in this step")
                              + ": the last "
                              "sample is the block's only owner by then and writes in place, and the blocks taken "
                              "later are private from the start."),
        "sp_hit": Exercise("sp_hit", f"Blocks hold {pre.block_size} tokens. The second request's prompt is the "
                           "system prompt plus its own question. How many of its prompt tokens does prefix caching find already in the cache?", "number",
                           hit.data["num_tokens"], unit="tokens",
                           explanation=(f"The engine said: *{hit.message}*: only full blocks are cached, and the "
                                        "block where the system prompt ends also holds the question, so it differs. "
                                        f"Once all {len(pre.request_ids)} prompts are prefilled, {used_on} blocks are "
                                        f"in use; with prefix caching off, {used_off}.")),
    }


# ------------------------------------------------------------------------------------------- reveals
def _show(stages_of, index: int):
    def reveal(ctx) -> None:
        import streamlit as st

        from viz import block_pool_figure

        stages = practice(*stages_of)
        stage = stages[index]
        changed = sorted({b for e in stage.events for b in e.blocks})
        left, _ = st.columns([3, 2])  # 8 blocks of 4 slots: a narrow figure keeps the cells readable
        left.plotly_chart(block_pool_figure(manager_snapshot(stage.bm), ["A", "B", "C"], highlight=changed,
                                            slot_mode=True, title=f"after: {stage.label}"),
                          width="stretch", key=f"l4_stage_{id(stages_of)}_{index}")
        owners = sorted(stage.bm.block_tables)
        colours = {"A": "blue", "B": "orange", "C": "green"}
        parts = [f"{'/'.join(colours[o] for o in owners)}: a block owned by {'/'.join(owners)} alone"]
        if any(c > 1 for c in stage.bm.ref_counts):
            parts.append("grey: shared (its owners and count on the left)")
        left.caption("One row per block, one cell per slot. " + "; ".join(parts) + "; pale: free. Framed: what "
                     "this step changed.")
    return reveal


reveal_p_fork = _show(MAIN, 1)
reveal_p_a_counts = _show(MAIN, 2)
reveal_p_b_copy = _show(MAIN, 3)
reveal_v1_block = _show(V1, len(V1[1]))
reveal_v2_counts = _show(V2, len(V2[1]))
reveal_v3_free = _show(V3, len(V3[1]))


def widget_practice_start(ctx) -> None:
    _show(MAIN, 0)(ctx)


def widget_runs(ctx) -> None:
    import streamlit as st

    from lessons.widgets import step_through

    tokenizer = ctx.loaded[1]
    with st.container(border=True):
        which = st.radio("Run", ["parallel sampling (n samples)", "shared system prompt (prefix caching)"],
                         horizontal=True, key="keep_l4_run")
        st.caption("Both runs have automatic prefix caching on (the engine's default), so blocks freed at the end "
                   "keep their prefix hash and show as cached.")
        run = ctx.run(parallel_run) if which.startswith("parallel") else ctx.run(prefix_run, True)
        step_through(run, f"l4_step_{which[:3]}", lambda ids: tokenizer.decode(ids),
                     jump_kinds=("fork", "cow", "prefix_hit", "new_block", "free"))


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)
