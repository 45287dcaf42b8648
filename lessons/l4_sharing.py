"""Lesson 4: sharing and copy-on-write. The practice runs on the engine's ``BlockManager`` (block size 4,
8 blocks); the real-model part runs ``LLMEngine`` on the parallel-sampling and shared-prefix scenarios.

Every expected answer, and every usual wrong answer (``Slip``), is read from those runs: a slip is what the
same run would show if the learner's mistaken rule were the engine's (the count before the write instead of
after, a shared block counted once per owner, the logical block instead of the physical one, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.metrics import blocks_for
from engine.scenarios.presets import get_scenario
from lessons.common import manager_snapshot, scenario_run
from lessons.exercise import Exercise, Slip

NUM_BLOCKS, BLOCK_SIZE = 8, 4
MAIN = (6, [("fork", "B", "A"), ("append", "A"), ("append", "B")])
# Variation 1: the last prompt block is full; A writes, then B (a situation the text does not work through)
V1 = (8, [("fork", "B", "A"), ("append", "A"), ("append", "B")])
V2 = (6, [("fork", "B", "A"), ("fork", "C", "A"), ("append", "A"), ("append", "B"), ("append", "C")])
V3 = (6, MAIN[1] + [("release", "A")])
CHAT = {"system": 1600, "chats": 50, "own": 24, "block_size": 16}
SERVE = {"system": 500, "own": 300, "block_size": 16}
WHY_SLIPS = ["count-at-write", "original-and-copy", "every-other-write", "new-block"]  # one per p_why option
B_COPY_OPTIONS = {"cow": "yes, it copies block {b} first", "append": "no, it writes into block {b} in place",
                  "new_block": "it takes a fresh, empty block"}

RECAP = [
    "A fork copies the block **table**, not the blocks: every block the two tables share has its reference "
    "count raised by one.",
    "Copy-on-write looks at the count **at the moment of the write**: a writer whose last block is shared "
    "copies it, and the last owner left writes in place.",
    "A block is free again only when its count reaches zero: when one of {{ chats }} chats ends, none of the "
    "{{ chat_blocks }} shared system-prompt blocks is freed.",
    "Prefix caching shares **full** blocks only: the block where a shared prompt ends also holds each "
    "request's own tokens, so it stays private.",
    "On the real model, *n* = {{ ps_n }} samples of one prompt hold {{ ps_used }} blocks after their first "
    "token, where {{ ps_n }} separate copies would hold {{ ps_separate }}.",
]


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
    table, held = bm.table_of("chat0")  # what the block manager holds for the chat before it ends
    private = [b for b in table if bm.ref_counts[b] == 1]
    freed = bm.free("chat0")
    return {"shared": shared, "freed": freed, "freed_shared": sorted(set(freed) & set(shared)),
            "count_before": before, "count_after": bm.ref_counts[shared[0]], "private_freed": len(freed),
            "own_tokens": held - c["system"], "private_blocks": len(private)}


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


def touched_blocks(stage: Stage) -> list[int]:
    """The blocks one practice operation touched, sorted: every block its events name, a plain ``append``'s
    (a token written into a block with room) included. What a practice stage frames ("what this step changed").

    Deliberately not ``engine.records.changed_blocks`` (the stages' definition), which leaves plain appends
    out: in an engine step every running sequence appends, and framing them all would bury the step's
    decisions. A practice stage is one operation, and when it is a plain append the block written into is the
    one thing that changed: after A's copy-on-write, B writes its token in place into block 1 (MAIN's stage
    3, the reveal of whether B copies), which ``changed_blocks`` would leave unframed
    (tests/test_lesson_4_framed.py)."""
    return sorted({b for e in stage.events for b in e.blocks})


def _copies(stages: list[Stage]) -> int:
    return sum(e.kind == "cow" for s in stages for e in s.events)


def _system_prompt_tokens(tokenizer) -> int:
    from engine.scenarios.presets import SYSTEM_PROMPT

    return len(tokenizer(SYSTEM_PROMPT, add_special_tokens=False)["input_ids"])


def _parallel_figures(par) -> dict:
    """From the parallel-sampling run: prompt blocks, samples, blocks in use after the first decode step."""
    _, alloc = par.first("allocate")
    after = par.records[1].snapshot
    return {"prompt_blocks": len(alloc.blocks), "n": len(after.sequences), "used": after.num_used_blocks,
            "prompt": par.records[0].scheduled[0].num_tokens}


# -------------------------------------------------------------------------------------------- lesson
def facts(ctx) -> dict:
    main = practice(*MAIN)
    chat = chat_example()
    serve = serving_example()
    run = ctx.run(parallel_run)
    par = _parallel_figures(run)
    tokenizer = ctx.loaded[1]
    requests = get_scenario("shared-prefix").make(0, lambda t: tokenizer(t, add_special_tokens=False)["input_ids"])
    return {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "last_block": NUM_BLOCKS - 1, "prompt": MAIN[0],
            "a_table": str(main[0].tables["A"]),
            "practice_blocks": main[-1].bm.num_used_blocks, "copies_blocks": 2 * len(main[0].tables["A"]),
            "chat_blocks": len(chat["shared"]), "chats": CHAT["chats"], "chat_system": f"{CHAT['system']:,}",
            "chat_own": chat["own_tokens"], "chat_private": chat["private_blocks"],
            "chat_block_size": CHAT["block_size"], "serve_prompt": SERVE["system"], "serve_block_size": SERVE["block_size"],
            "serve_shared": serve["shared"], "serve_partial": ordinal(serve["partial"]),
            "ps_prompt": par["prompt"], "ps_n": par["n"], "ps_block_size": run.block_size,
            "ps_used": par["used"], "ps_separate": par["n"] * blocks_for(par["prompt"] + 1, run.block_size),
            "sp_requests": len(requests.requests), "sp_prompt": _system_prompt_tokens(tokenizer)}


def exercises(ctx) -> dict[str, Exercise]:
    return {**_practice_exercises(), **_variation_exercises(), **_engine_exercises(ctx)}


def _practice_exercises() -> dict[str, Exercise]:
    main = practice(*MAIN)
    a_write, b_write = main[2].events[0], main[3].events[0]
    shared_block = main[1].tables["A"][-1]
    a_table_before = main[1].tables["A"]
    copy_block = a_write.data.get("dst", main[2].tables["A"][-1])
    b_options = {k: o.format(b=shared_block) for k, o in B_COPY_OPTIONS.items()}
    b_answer = b_options[b_write.kind]
    why = ["block {b}'s reference count at the moment B writes, whatever it was when A wrote",
           "which of the two is the original sequence and which the fork",
           "how many writes the block has had: copy-on-write copies every other one",
           "nothing: B's token goes into a new block of its own"]
    why = [w.format(b=shared_block) for w in why]
    count_at_b = main[2].counts[shared_block]
    # the engine's own decisions: A copied a block of count 2; B's write follows the count it then finds
    by_count = a_write.kind == "cow" and (b_write.kind == "cow") == (count_at_b > 1)
    why_answer = why[0] if by_count and b_write.kind != "new_block" else why[3]
    fork_counts = [main[1].counts[b] for b in a_table_before]
    before_fork = [main[0].counts[b] for b in a_table_before]
    only_full = [c if main[1].bm.fills[b] == BLOCK_SIZE else before for b, c, before
                 in zip(a_table_before, fork_counts, before_fork)]
    counts_after = main[2].counts[:3]
    # the count of the shared block before A's write (A's copy not taken off yet); the copy already made
    before_write = [main[1].counts[b] if b == shared_block else c for b, c in enumerate(counts_after)]
    original_freed = [0 if b == shared_block else c for b, c in enumerate(counts_after)]
    b_slips = {
        "cow": Slip("count-before-write", b_options["cow"],
                    f"That would be right if block {shared_block} were still shared. It was when A wrote, but A's "
                    f"copy lowered its count to {count_at_b}: copy-on-write looks at the count at the moment of "
                    "the write."),
        "new_block": Slip("new-block", b_options["new_block"],
                          f"A fresh block is taken only when the last block is **full**; block {shared_block} "
                          f"holds {main[2].bm.fills[shared_block]} of {BLOCK_SIZE} tokens, so B's token has a slot "
                          "there."),
        "append": Slip("in-place", b_options["append"],
                       f"B's block {shared_block} is shared at that moment, so B must copy it first."),
    }
    why_messages = {
        why[1]: "Both sequences are equal owners: neither table is the \"original\". What matters is the state of "
                "the block at the moment of each write.",
        why[2]: "There is no such rhythm: each write checks the block it writes into, at that moment.",
        why[3]: (f"B's next token belongs in logical block {len(a_table_before) - 1}, the one A just copied, and "
                 f"block {shared_block} still has room for it."),
        why[0]: "The engine decided by something else here.",
    }
    return {
        "p_fork": Exercise(
            "p_fork", "What are the reference counts of A's blocks, in table order?", "list", fork_counts,
            explanation=f"Forking copies the table, not the blocks: {_table_text(main[1])}",
            slips=[Slip("count-before-fork", before_fork,
                        "Those are the counts **before** the fork. B's table now points at the same blocks, so "
                        "each count rose by one."),
                   Slip("only-full-blocks", only_full,
                        "A fork shares **every** block, the partly filled last one too: B's tokens so far are "
                        "exactly A's. Only a later write decides whether that block must be copied.")]),
        "p_a_table": Exercise(
            "p_a_table", "What is A's block table after its write?", "list", main[2].tables["A"],
            explanation=(f"The engine said: *{a_write.message}*. Tables now: "
                         + " · ".join(f"{q} → {t}" for q, t in main[2].tables.items())),
            slips=[Slip("in-place", a_table_before,
                        f"That is A writing **into** the shared block {shared_block}, which would change B's "
                        "tokens too. A copies the block and writes into the copy."),
                   Slip("copy-appended", a_table_before + [copy_block],
                        f"The copy **replaces** block {shared_block} in A's table (same logical block, new "
                        "physical block); the table does not grow, since no new logical block starts.")]),
        "p_a_counts": Exercise(
            "p_a_counts", "And the reference counts of blocks 0, 1 and 2?", "list", counts_after,
            explanation=_table_text(main[2]),
            slips=[Slip("count-before-write", before_write,
                        f"Block {shared_block}'s count is the one **before** A's write. A's table no longer points "
                        f"at it, so its count dropped by one."),
                   Slip("original-freed", original_freed,
                        f"Block {shared_block} is not freed: B's table still points at it, so its count is "
                        f"{count_at_b}, not 0.")]),
        "p_why": Exercise(
            "p_why", f"A had to copy block {shared_block} because it was shared. B is about to write into the same "
            "logical block. What decides whether B must copy too?", "choice", why_answer, options=why,
            explanation=("Copy-on-write looks at the reference count at the moment of the write, not at who forked "
                         "whom or at what happened before. Use the counts after A's write to predict B's."),
            slips=[Slip(name, w, why_messages[w]) for name, w in zip(WHY_SLIPS, why) if w != why_answer],
            answer_phrases=["reference count at the moment", "count at the moment of the write",
                            "count at the time of the write", "count at the moment B writes"]),
        "p_b_copy": Exercise(
            "p_b_copy", "Does B copy a block before it writes?", "choice", b_answer, options=list(b_options.values()),
            explanation=f"The engine said: *{b_write.message}*. {_table_text(main[3])}",
            slips=[s for k, s in b_slips.items() if b_options[k] != b_answer],
            answer_phrases=[b_answer] + ([f"B writes into block {shared_block} in place", "B writes in place",
                                          "B does not copy", "B did not copy"] if b_write.kind == "append" else [])),
    }


def _variation_exercises() -> dict[str, Exercise]:
    v1, v2, v3 = practice(*V1), practice(*V2), practice(*V3)
    # Variation 1: which physical blocks A's and then B's token go into
    v1_new = [v1[2].tables["A"][-1], v1[3].tables["B"][-1]]
    last_prompt_block = v1[1].tables["A"][-1]
    logical = v1[2].events[0].data["logical_block"]  # the logical block A's new token starts
    v1_events = [e for s in v1[2:] for e in s.events]
    # Variation 2: counts of the two prompt blocks after the three writes, and the copies made
    first_two = v2[0].tables["A"]
    n_writers = sum(op[0] == "append" for op in V2[1])
    v2_answer = [v2[-1].counts[b] for b in first_two] + [_copies(v2)]
    after_forks = v2[2]
    before_writes = [after_forks.counts[b] for b in first_two]
    v2_all_copy = [before_writes[0], before_writes[1] - n_writers, n_writers]
    v2_first_only = [before_writes[0], before_writes[1] - 1, 1]
    # Variation 3: release(A) at the end of the practice
    freed = sorted(v3[-1].events[0].blocks)
    a_table = v3[-2].tables["A"]
    a_first_table = v3[0].tables["A"]
    return {
        "v1_blocks": Exercise(
            "v1_blocks", f"**Variation 1.** A's prompt has {V1[0]} tokens, so both of its blocks are full. B is "
            "forked from A; then A writes one token, then B writes one token. Act as the block manager: into "
            "which **physical** blocks do A's token and then B's token go? (Two numbers, A's first.)", "list",
            v1_new, tags={"transfer", "allocator"},
            explanation=(" ".join(f"*{e.message}*." for e in v1_events) + " No copy: nobody writes into a full "
                         "block again, so the shared full blocks stay shared, and each new token starts a new "
                         "logical block in a fresh, private block from the front of the free list. "
                         + _table_text(v1[-1])),
            slips=[Slip("into-full-block", [last_prompt_block, last_prompt_block],
                        f"Block {last_prompt_block} is full ({BLOCK_SIZE} of {BLOCK_SIZE}): a new token needs a "
                        "new block; there is nothing to copy into or write in place."),
                   Slip("logical-block", [logical, logical],
                        f"{logical} is the **logical** block both new tokens start; each sequence maps it "
                        "to its own physical block, taken from the free list one after the other."),
                   Slip("order", v1_new[::-1],
                        "The free list hands out blocks in order, and A writes first, so A gets the first free "
                        "block.")],
            answer_phrases=["nobody writes into a full block", "only a partly filled last block",
                            "partly filled last block is copied", "a full block is never copied"]),
        "v2_counts": Exercise(
            "v2_counts", f"**Variation 2.** A has {V2[0]} tokens; B and then C are forked from A; then A, B and C "
            f"each write one token, in that order. Write what the block manager's counters say afterwards: the "
            f"count of block {first_two[0]}, the count of block {first_two[1]}, and how many copies the three "
            "writes made.", "list", v2_answer, tags={"transfer", "allocator"},
            explanation=(" ".join(f"*{e.message}*." for st_ in v2[-3:] for e in st_.events)
                         + f" {_copies(v2)} copies in three writes: the last writer owns the original alone by "
                         f"then. {_table_text(v2[-1])}"),
            slips=[Slip("counts-before-writes", before_writes + [_copies(v2)],
                        f"Those are block {first_two[1]}'s counts **before** the writes: each copy took one "
                        "owner off it."),
                   Slip("every-writer-copies", v2_all_copy,
                        "The last writer does not copy: by then the others have left the block, its count is "
                        "1 and it writes in place."),
                   Slip("first-writer-only", v2_first_only,
                        f"After A's copy, block {first_two[1]} is still shared by B and C (count "
                        f"{before_writes[1] - 1}), so B copies too."),
                   *([Slip("every-write-copied", v2_answer[:2] + [n_writers],
                           f"The counts are right, but not every write copies: by the last write block "
                           f"{first_two[1]}'s count is {v2_answer[1]}, so the last writer owns it alone and writes "
                           "in place, without a copy.")]
                     if v2_answer[2] != n_writers and v2_answer[:2] + [n_writers] != v2_all_copy else [])]),
        "v3_free": Exercise(
            "v3_free", "**Variation 3.** Back to the end of the practice (A and B have written). Now A finishes: "
            "release(A) lowers the count of each block in A's table and frees those that reach zero. Which blocks "
            "become free? (Write *none* if none.)", "set", freed, tags={"allocator"},
            explanation=f"The engine said: *{v3[-1].events[0].message}*. {_table_text(v3[-1])}",
            slips=[Slip("shared-freed", sorted(set(a_table)),
                        f"Block {a_table[0]} is still in B's table: its count drops to "
                        f"{v3[-1].counts[a_table[0]]}, not 0, so it stays."),
                   Slip("old-table", a_first_table,
                        f"A's table is no longer {a_first_table}: its copy replaced block "
                        f"{a_first_table[-1]} by block {a_table[-1]}."),
                   Slip("none", [],
                        f"Block {a_table[-1]} is A's private copy (count 1): releasing A brings it to 0, so it "
                        "is free again.")],
            answer_phrases=[f"{len(freed)} free again [{', '.join(map(str, freed))}]",
                            f"block{'s' if len(freed) > 1 else ''} {' and '.join(map(str, freed))} "
                            f"become{'' if len(freed) > 1 else 's'} free",
                            f"frees block{'s' if len(freed) > 1 else ''} {' and '.join(map(str, freed))}"]
                           if freed else ["none of A's blocks becomes free"]),
    }


def _engine_exercises(ctx) -> dict[str, Exercise]:
    chat = chat_example()
    par = ctx.run(parallel_run)
    pf = _parallel_figures(par)
    pre, pre_off = ctx.run(prefix_run, True), ctx.run(prefix_run, False)
    _, hit = pre.first("prefix_hit")
    cows = par.events("cow")
    in_step = sum(e.kind == "cow" for e in par.records[1].events)
    used_on, used_off = pre.records[0].snapshot.num_used_blocks, pre_off.records[0].snapshot.num_used_blocks
    B = pre.block_size
    system = _system_prompt_tokens(ctx.loaded[1])
    hit_tokens = hit.data["num_tokens"]
    n, P = pf["n"], pf["prompt_blocks"]
    return {
        "chat_free": Exercise(
            "chat_free", f"One of the {CHAT['chats']} conversations ends. How many of the {len(chat['shared'])} "
            "shared system-prompt blocks become free?", "number", len(chat["freed_shared"]), unit="blocks",
            explanation=(f"None: their counts drop from {chat['count_before']} to {chat['count_after']}. Only the "
                         f"chat's private blocks are freed: its own {chat['own_tokens']} tokens after the system "
                         f"prompt filled {chat['private_freed']} blocks of {CHAT['block_size']}.")
            if not chat["freed_shared"] else "",
            slips=[Slip("shared-freed", len(chat["shared"]),
                        f"A shared block is freed only when its count reaches zero; here it drops from "
                        f"{chat['count_before']} to {chat['count_after']}: the other chats still use it."),
                   Slip("private-blocks", chat["private_freed"],
                        f"Those are the chat's **private** blocks ({chat['private_freed']}), which are freed; "
                        "the question asks about the shared ones.")]),
        "ps_blocks": Exercise(
            "ps_blocks", f"Prefill writes the prompt once and forks the other samples from it. How many blocks are "
            f"in use after the **first decode step**, when each of the {n} samples has written one token?",
            "number", pf["used"], unit="blocks", tags={"transfer"},
            explanation=" ".join(f"*{e.message}*." for e in par.records[1].events if e.kind != "append")
            + f" {len(cows)} copies in the whole run, "
            + (f"all {in_step} in this step" if in_step == len(cows) else f"{in_step} of them in this step")
            + ": the last sample is the block's only owner by then and writes in place, and the blocks taken "
            "later are private from the start.",
            slips=[Slip("no-copies", P, "That leaves out copy-on-write: every sample but the last writes into the "
                        "shared, partly filled last prompt block, so it copies it first."),
                   Slip("every-sample-copies", P + n,
                        "The last writer does not copy: by the time it writes, the others have left the shared "
                        "block, so its count is 1."),
                   Slip("shared-counted-per-sample", n * P,
                        f"That counts each sample's {P} prompt blocks separately; shared blocks are stored once, "
                        "however many tables point at them.")]),
        "sp_hit": Exercise(
            "sp_hit", f"Blocks hold {B} tokens. The second request's prompt is the system prompt plus its own "
            "question. How many of its prompt tokens does prefix caching find already in the cache?", "number",
            hit_tokens, unit="tokens", tags={"transfer"},
            explanation=(f"The engine said: *{hit.message}*: only full blocks are cached, and the block where the "
                         "shared part ends also holds the question, so it differs. "
                         f"Once all {len(pre.request_ids)} prompts are prefilled, {used_on} blocks are in use; with "
                         f"prefix caching off, {used_off}."),
            slips=_distinct(hit_tokens, [
                Slip("partial-block-shared", blocks_for(system, B) * B,
                     f"That counts the block where the system prompt ends as shared; it also holds the question's "
                     f"first tokens, which differ, so only full blocks of identical tokens ({B} each) are found."),
                Slip("every-token", system,
                     f"That is the whole system prompt, token by token; the cache finds whole blocks of {B} only, "
                     "so the tokens of the last, partly shared block are computed again."),
            ])),
    }


def _distinct(expected, slips: list[Slip]) -> list[Slip]:
    """The slips whose answers differ from ``expected`` and from each other (the first of equal ones)."""
    seen, out = {expected}, []
    for s in slips:
        if s.answer not in seen:
            seen.add(s.answer)
            out.append(s)
    return out


# ------------------------------------------------------------------------------------------- reveals
def _show(stages_of, index: int):
    def reveal(ctx) -> None:
        import streamlit as st

        from viz import block_pool_figure

        stages = practice(*stages_of)
        stage = stages[index]
        left, _ = st.columns([3, 2])  # 8 blocks of 4 slots: a narrow figure keeps the cells readable
        left.plotly_chart(block_pool_figure(manager_snapshot(stage.bm), ["A", "B", "C"],
                                            highlight=touched_blocks(stage), slot_mode=True,
                                            title=f"after: {stage.label}"),
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
reveal_v1_blocks = _show(V1, len(V1[1]))
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
