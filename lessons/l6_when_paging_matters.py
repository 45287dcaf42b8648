"""Lesson 6: when paging matters, and what it is not. Every answer is decided by an experiment run on the
engine or on its allocators when the page loads (the reveal says which), not typed into the lesson: a
true/false check of seven statements (balanced: some hold, some do not), a choice between three workloads
(which gains most from paging) and a block table to write as the allocator would."""

from __future__ import annotations

import numpy as np

from engine import LLMEngine
from engine.block_manager import BlockManager
from engine.contiguous import ContiguousAllocator
from engine.metrics import blocks_for, pct
from engine.scenarios.run_spec import RunSpec
from lessons import kv_math
from lessons.common import scenario_run
from lessons.exercise import Exercise, Slip

TF = ["true", "false"]
SHORT = {"seed": 3, "n": 16, "lo": 20, "hi": 257, "max_len": 256, "block_size": 16}
FIT = {"model": "llama-2-7b", "gpu": "NVIDIA H100 (80 GB)", "context": 4096}
# lesson 3-like busy pool (q_chunked): four requests fill it, two finish, a new one takes the freed blocks
BUSY = {"num_blocks": 12, "block_size": 16, "tokens": [48, 48, 48, 48], "freed": ["R2", "R4"], "new": 70}
# the allocator question: four requests fill 8 blocks, two finish (in this order), a new one arrives
TABLE = {"num_blocks": 8, "block_size": 16, "tokens": [30, 30, 30, 30], "freed": ["R1", "R3"], "new": 40}
# three workloads for the transfer question (lengths drawn with numpy's default_rng(seed))
WORKLOADS = {
    "near_max": {"label": "16 requests of 200 to 256 tokens each", "n": 16, "lo": 200, "hi": 257},
    "varied": {"label": "16 requests of 20 to 256 tokens each", "n": 16, "lo": 20, "hi": 257},
    "many_full": {"label": "64 requests of exactly 256 tokens each", "n": 64, "lo": 256, "hi": 257},
}
WORKLOAD_SEED = 5

RECAP = [
    "Paging pays off when memory decides how much work fits: many requests at once with **varying** lengths, "
    "a KV cache that is a large share of the GPU, shared prefixes, and preemption.",
    "It changes where keys and values live, not their size or what the model computes: all {{ compared }} "
    "tokens generated in lesson 5's runs were identical with the contiguous baseline.",
    "It does not move the cache to CPU memory (that is swapping), and it does not make memory endless: a "
    "paged server still queues and preempts.",
    "A request's blocks can be anywhere in the pool: the free list's order decides which blocks it gets, not "
    "their being next to each other.",
    "With one request, or with requests whose lengths are all equal and known, there is little to win.",
]


def _tf(claim_holds: bool) -> str:
    return TF[0] if claim_holds else TF[1]


def _tf_slip(answer: str, message: str) -> list[Slip]:
    """The slip for the other option of a true/false question."""
    wrong = TF[1] if answer == TF[0] else TF[0]
    return [Slip(f"said-{wrong}", wrong, message)]


# --------------------------------------------------------------------------------------- experiments
def slots_per_byte(loaded) -> dict:
    """Token slots a paged pool and a contiguous region get from the same KV budget (1 MiB)."""
    out = {}
    for allocator in ("paged", "contiguous"):
        e = LLMEngine(RunSpec(kv_budget_mb=1, block_size=16, max_model_len=256).engine_config(allocator), loaded)
        cache = e.kv_cache
        nbytes = sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache)
        out[allocator] = {"slots": cache.num_blocks * cache.block_size, "bytes": nbytes}
    return out


def contiguous_run(loaded):
    """Lesson 5's requests in its roomy pool's memory, on the contiguous baseline."""
    from lessons.l5_out_of_memory import ROOMY_BLOCKS, SCENARIO

    return scenario_run(loaded, SCENARIO, num_blocks=ROOMY_BLOCKS, allocator="contiguous")


def outputs_match(ctx) -> tuple[bool, int]:
    """Greedy outputs of lesson 5's requests, paged (its roomy run, shared with lesson 5) vs contiguous:
    (identical?, tokens compared)."""
    from lessons.l5_out_of_memory import pressure_run

    paged, contiguous = ctx.run(pressure_run, "roomy"), ctx.run(contiguous_run)
    same = all(paged.outputs[r].output_token_ids == contiguous.outputs[r].output_token_ids for r in paged.request_ids)
    return same, sum(len(o.output_token_ids) for o in paged.outputs.values())


def waste(lengths: list[int], max_len: int, block_size: int) -> dict:
    """Empty share (%) of what each allocator holds for requests of these final lengths: a contiguous region
    reserving ``max_len`` per request, and a paged pool of ``block_size`` blocks."""
    region = ContiguousAllocator(len(lengths) * max_len, max_len)
    pool = BlockManager(sum(blocks_for(L, block_size) for L in lengths), block_size)
    for i, L in enumerate(lengths):
        region.allocate(f"R{i + 1}", L)
        pool.allocate(f"R{i + 1}", L)
    layout = region.layout()
    reserved = layout["used_slots"] + layout["reserved_unused_slots"]
    paged_slots = pool.num_used_blocks * block_size
    return {"contig_pct": pct(reserved - layout["used_slots"], reserved),
            "paged_pct": pct(paged_slots - sum(lengths), paged_slots), "used": layout["used_slots"],
            "reserved": reserved, "paged_slots": paged_slots}


def short_lengths() -> list[int]:
    s = SHORT
    return np.random.default_rng(s["seed"]).integers(s["lo"], s["hi"], s["n"]).tolist()


def workload_waste() -> dict[str, dict]:
    """Each transfer workload's lengths and waste on both allocators (max length and block size of SHORT)."""
    rng = np.random.default_rng(WORKLOAD_SEED)
    out = {}
    for key, w in WORKLOADS.items():
        lengths = rng.integers(w["lo"], w["hi"], w["n"]).tolist()
        out[key] = {"lengths": lengths, **waste(lengths, SHORT["max_len"], SHORT["block_size"])}
        out[key]["saved_pct"] = out[key]["contig_pct"] - out[key]["paged_pct"]
    return out


def pool_after_frees(spec: dict) -> tuple[BlockManager, str, list[int]]:
    """Requests fill a pool, some finish (in order), a new one arrives. Returns (pool, new id, the free list
    just before the new request took its blocks)."""
    bm = BlockManager(spec["num_blocks"], spec["block_size"])
    for i, n in enumerate(spec["tokens"]):
        bm.allocate(f"R{i + 1}", n)
    for rid in spec["freed"]:
        bm.free(rid)
    free_before = list(bm.free_block_queue)
    new = f"R{len(spec['tokens']) + 1}"
    bm.allocate(new, spec["new"])
    return bm, new, free_before


# -------------------------------------------------------------------------------------------- lesson
def facts(ctx) -> dict:
    p = kv_math.model_presets()[FIT["model"]]
    g = kv_math.geometry(p.config, p.dtype)
    gpu = next(x for x in kv_math.gpus() if x.name == FIT["gpu"])
    fit = kv_math.gpu_fit(gpu.memory_bytes, kv_math.parameter_count(p) * g.dtype_bytes, g.bytes_per_token,
                          FIT["context"])
    _, compared = outputs_match(ctx)
    return {"fit_requests": fit.requests, "fit_context": f"{FIT['context']:,}", "fit_gpu": gpu.name,
            "fit_model": p.name, "compared": compared, "table_blocks": TABLE["num_blocks"],
            "table_block_size": TABLE["block_size"]}


def exercises(ctx) -> dict[str, Exercise]:
    return {**_quiz(ctx), **_transfer()}


def _quiz(ctx) -> dict[str, Exercise]:
    from lessons.l5_out_of_memory import pressure_run

    capacity = ctx.run(slots_per_byte)
    per_slot = {k: v["bytes"] / v["slots"] for k, v in capacity.items()}
    same, compared = outputs_match(ctx)
    tight = ctx.run(pressure_run, "recompute")
    swaps = len(tight.events("swap_out"))
    swapped_blocks = sum(len(e.blocks) for e in ctx.run(pressure_run, "swap").events("swap_out"))
    preempts = tight.events("preempt")
    waiters = sorted({e.request_id for e in tight.events("wait")})
    bm, new, _ = pool_after_frees(BUSY)
    table = bm.block_tables[new]
    consecutive = all(b2 == b1 + 1 for b1, b2 in zip(table, table[1:]))
    lengths = short_lengths()
    short = waste(lengths, SHORT["max_len"], SHORT["block_size"])
    one = waste([SHORT["max_len"]], SHORT["max_len"], SHORT["block_size"])
    a = {k: _tf(v) for k, v in {
        "bytes": per_slot["paged"] == per_slot["contiguous"], "outputs": same, "cpu": swaps > 0,
        "no_queue": not preempts and not waiters, "chunked": consecutive,
        "short": short["contig_pct"] - short["paged_pct"] >= 10,
        "batch1": abs(one["contig_pct"] - one["paged_pct"]) < 5}.items()}
    return {
        "q_bytes": Exercise(
            "q_bytes", "*A token's keys and values take exactly as many bytes in a paged block as in a contiguous "
            "region.*", "choice", a["bytes"], options=TF,
            explanation=(f"The engine built a paged pool and a contiguous region from the same 1 MiB budget (it "
                         "sizes both in whole blocks of 16, so the region has as many slots as the pool): "
                         f"{capacity['paged']['slots']:,} vs {capacity['contiguous']['slots']:,} token slots, "
                         f"{per_slot['paged']:,.0f} vs {per_slot['contiguous']:,.0f} bytes per slot. Paging stores the "
                         "same numbers; it only stops wasting slots."),
            slips=_tf_slip(a["bytes"], "Choosing that treats paging as compression. A block is only a different "
                                       "place for the same keys and values, stored in the same number format."),
            answer_phrases=_if(a["bytes"] == "true", ["paging stores the same numbers", "paging does not compress",
                                                      "same bytes per token in a block"])),
        "q_outputs": Exercise(
            "q_outputs", "*With greedy decoding, the paged engine generates exactly the same tokens as the "
            "contiguous baseline, although attention reads keys and values from scattered blocks.*", "choice",
            a["outputs"], options=TF,
            explanation=(f"The engine ran lesson 5's five requests greedily on both allocators: "
                         f"{'all' if same else 'not all'} {compared} generated tokens are identical. The tests go "
                         "further: every step's logits match transformers' own generate."),
            slips=_tf_slip(a["outputs"], "Choosing that assumes the layout changes the arithmetic. The kernel "
                                         "follows the block table to the very same keys and values, so attention "
                                         "computes the same result."),
            answer_phrases=_if(a["outputs"] == "true", ["generated tokens are identical",
                                                        "paging does not change the outputs"])),
        "q_cpu": Exercise(
            "q_cpu", "*Paging moves the KV cache to CPU memory.*", "choice", a["cpu"], options=TF,
            explanation=(f"In lesson 5's tight run with recompute, the engine made {swaps} swaps to the CPU: every "
                         "block stayed in the GPU pool, also under pressure. Only the run with the *swap* policy "
                         f"copied blocks to the CPU ({swapped_blocks} blocks, only while a request was preempted). "
                         "Swapping is a separate policy that paging makes easy, not paging itself."),
            slips=_tf_slip(a["cpu"], "Choosing that mixes paging up with **swapping** (or offloading): paging "
                                     "keeps the cache in the GPU's pool; the name comes from the operating "
                                     "system's page tables, not from paging out to disk."),
            answer_phrases=_if(a["cpu"] == "false", ["swapping is a separate policy", "not paging itself",
                                                     "paging does not move the KV cache to CPU",
                                                     "paging keeps the cache in the GPU"])),
        "q_no_queue": Exercise(
            "q_no_queue", "*With paging, a server never has to queue or preempt a request.*", "choice",
            a["no_queue"], options=TF,
            explanation=(f"Lesson 5's tight pool: {len(preempts)} preemption{'s' * (len(preempts) != 1)} and "
                         f"{', '.join(waiters) or 'nobody'} waiting at the door at times, in the engine's own run. "
                         "Paging uses memory better; it does not make memory endless."),
            slips=_tf_slip(a["no_queue"], "Choosing that confuses using memory well with having enough of it: "
                                          "when the pool is full, a request must wait or someone is preempted."),
            answer_phrases=_if(a["no_queue"] == "false", ["it does not make memory endless",
                                                          "must still queue or preempt", "still has to queue or preempt",
                                                          "paging does not remove queueing"])),
        "q_chunked": Exercise(
            "q_chunked", "*Paging is contiguous allocation in smaller chunks: a request's blocks sit next to each "
            "other in the pool, in order.*", "choice", a["chunked"], options=TF,
            explanation=(f"A busy pool of {BUSY['num_blocks']} blocks, four requests, {' and '.join(BUSY['freed'])} "
                         f"finished: the new request {new} got the blocks {table}, any free block in the free list's "
                         "order. The block table is what makes that possible, and it is why no gaps form."),
            slips=_tf_slip(a["chunked"], "Choosing that misses the block table: it maps each logical block to "
                                         "**any** physical block, so a request's blocks can be scattered across "
                                         "the pool."),
            answer_phrases=_if(a["chunked"] == "false", ["any free block in the free list's order",
                                                         "paging is not chunked contiguous",
                                                         "not contiguous allocation in smaller chunks"])),
        "q_short": Exercise(
            "q_short", "*Paging saves memory even when every request is short, as long as their lengths vary.*",
            "choice", a["short"], options=TF,
            explanation=(f"{len(lengths)} short requests ({min(lengths)} to {max(lengths)} tokens, maximum length "
                         f"{SHORT['max_len']}): contiguous allocation leaves {short['contig_pct']:.1f}% of its "
                         f"reservations empty, paging {short['paged_pct']:.1f}%. What matters is that lengths vary."),
            slips=_tf_slip(a["short"], "Choosing that ties paging to long contexts. The waste it removes comes "
                                       "from reserving for the maximum while lengths vary, at any length."),
            answer_phrases=_if(a["short"] == "true", ["what matters is that lengths vary",
                                                      "helps even at short contexts"])),
        "q_batch1": Exercise(
            "q_batch1", "*For a single request that always runs to the maximum length, paging saves almost no "
            "memory.*", "choice", a["batch1"], options=TF,
            explanation=(f"One request of {SHORT['max_len']} tokens: contiguous {one['contig_pct']:.1f}% empty, "
                         f"paged {one['paged_pct']:.1f}%. With one request of known length there is nothing to win; "
                         "paging pays off with many requests of varying length."),
            slips=_tf_slip(a["batch1"], "Choosing that assumes paging saves memory by itself. It saves what a "
                                        "reservation would leave empty; a request that fills its whole "
                                        "reservation leaves nothing to save."),
            answer_phrases=_if(a["batch1"] == "true", ["there is nothing to win", "saves almost no memory for a single",
                                                       "matters little at batch size 1"])),
    }


def _if(holds: bool, phrases: list[str]) -> list[str]:
    """An exercise's answer phrases, when the engine's answer is the one they word (else none)."""
    return phrases if holds else []


def _transfer() -> dict[str, Exercise]:
    loads = workload_waste()
    best = max(loads, key=lambda k: loads[k]["saved_pct"])
    options = {k: w["label"] for k, w in WORKLOADS.items()}
    why = {"near_max": "Lengths close to the maximum leave little of each reservation empty, so there is little "
                       "for paging to win back.",
           "many_full": "More requests do not help if each fills its reservation: with equal, known lengths a "
                        "contiguous reservation wastes nothing.",
           "varied": "Widely varying lengths leave the most of each reservation empty; that is where paging wins."}
    rows = "; ".join(f"{options[k]}: contiguous {loads[k]['contig_pct']:.1f}% empty, paged "
                     f"{loads[k]['paged_pct']:.1f}%" for k in WORKLOADS)
    bm, new, free_before = pool_after_frees(TABLE)
    table = bm.block_tables[new]
    need = blocks_for(TABLE["new"], TABLE["block_size"])
    return {
        "q_workload": Exercise(
            "q_workload", f"Maximum length {SHORT['max_len']}, blocks of {SHORT['block_size']}. For which workload "
            "does paging free the largest share of the memory a contiguous server would hold?", "choice",
            options[best], options=list(options.values()), tags={"transfer"},
            explanation=(f"The engine's two allocators held each workload (lengths drawn at random): {rows}."),
            slips=[Slip(k, options[k], why[k]) for k in options if k != best],
            answer_phrases=[options[best]] + _if(best == "varied", ["widely varying lengths leave the most",
                                                                    "where lengths vary most"])),
        "q_table": Exercise(
            "q_table", f"Act as the allocator. A pool of {TABLE['num_blocks']} blocks of {TABLE['block_size']} was "
            f"full with four requests; {' and then '.join(TABLE['freed'])} finished, and the free list, front "
            f"first, now reads {free_before}. A new request of {TABLE['new']} tokens arrives. Write its block "
            "table.", "list", table, tags={"transfer", "allocator"},
            explanation=(f"{TABLE['new']} tokens need {need} blocks of {TABLE['block_size']}, taken from the front of "
                         f"the free list: {table}. Scattered, and not in order; the block table makes that work. "
                         "(A finished request's blocks join the free list last block first.)"),
            slips=_distinct(table, [
                Slip("lowest-id", sorted(free_before)[:need],
                     "The allocator does not look for the lowest ids: it takes blocks from the **front** of the "
                     "free list, in the order shown."),
                Slip("newest-freed-first", free_before[::-1][:need],
                     "The free list is a queue, not a stack: blocks are taken from the front, so the blocks "
                     "freed earliest go first."),
                Slip("too-few-blocks", free_before[:need - 1],
                     f"{TABLE['new']} tokens need {need} blocks of {TABLE['block_size']}: the last one is only "
                     "partly filled, but it is a whole block."),
            ])),
    }


def _distinct(expected: list, slips: list[Slip]) -> list[Slip]:
    seen, out = [list(expected)], []
    for s in slips:
        if list(s.answer) not in seen:
            seen.append(list(s.answer))
            out.append(s)
    return out


def reveal_q_table(ctx) -> None:
    import streamlit as st

    from lessons.common import manager_snapshot
    from viz import block_pool_figure

    bm, new, _ = pool_after_frees(TABLE)
    left, _ = st.columns([3, 2])
    left.plotly_chart(block_pool_figure(manager_snapshot(bm), sorted(bm.block_tables), selected=new,
                                        highlight=bm.block_tables[new], title=f"{new}'s blocks framed"),
                      width="stretch", key="l6_reveal_table")


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)
