"""Lesson 3: blocks and block tables. The life of one request on the embedded model (``LLMEngine``); a busy
pool (``BlockManager``) where the learner writes a new request's block table from the free list, then finds
where token t lives; the block-size trade-off: memory from ``BlockManager`` allocations, speed from this
project's own H200 measurement of its Triton paged-attention kernel (``kernel_sweep``, read from the JSON
the benchmark wrote). Each usual wrong answer (``Slip``) is computed from the same runs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine import metrics
from engine.block_manager import BlockManager
from lessons import kv_math
from lessons.common import manager_snapshot, scenario_run
from lessons.exercise import Exercise, Slip

LIFE = "life-of-a-request"  # the scenario (engine/scenarios/presets.py) the Playground button loads too
BUSY = {"num_blocks": 12, "block_size": 16, "tokens": [48, 48, 48, 48], "freed": ["R2", "R4"], "new": 70}
WHERE_T = 37  # the token the exercise asks about (a question, not an answer)
TRADE_TOKENS = 600
TRADE_SIZES = [1, 16, 64, 256]
TRADE_ASK = 256  # the block size the empty-share question asks about
TRADE_MODEL = "llama-2-7b"
# The transfer: which block size fits the most requests of one length in a pool of a given size
PICK = {"pool_slots": 4096, "tokens": 96, "sizes": [8, 32, 128]}
# This project's measurement of its Triton paged-attention kernel (bench/kernels.py on an H200, the run that
# docs/benchmarks.md's section gpu-kernels shows; the date is that run's, the JSON holds no date)
REPO = Path(__file__).resolve().parent.parent
KERNEL_RUN = {"json": "docs/gpu_runs/run5_bench.json", "date": "2026-11-29",
              "doc": "docs/benchmarks.md, section gpu-kernels"}
KERNEL_REF, KERNEL_ASK = 16, 1  # times are shown relative to B = 16; the question asks about B = 1
# Where each design's free-list order comes from, read in vLLM's source (file, function, lines):
FREE_ORDER_SOURCES = {
    "v0": ("vLLM V0, vllm-0.10.0 (the PyPI sdist, sha256 a44e9013...), `vllm/core/block/naive_block.py`: "
           "`NaiveBlockAllocator.__init__` keeps the free block ids in a `deque` (line 42), `_allocate_block_id` "
           "takes `popleft()` (line 138), `_free_block_id` returns a freed id with `appendleft()` (line 152); "
           "`vllm/core/block/block_table.py` `BlockTable.free` frees a table first block to last (line 243); "
           "`cpu_gpu_block_allocator.py` uses this allocator when prefix caching is off (lines 65-78)"),
    "v1": ("vLLM V1, vllm 0.32.0 (`.peer-venv`), `vllm/v1/core/block_pool.py` `BlockPool.free_blocks` (lines "
           "774-803): a freed block without a hash, or any block with caching off, is put at the front "
           "(`prepend_n`), one with a hash at the back (`append_n`); `get_new_blocks` takes from the front "
           "(`popleft_n`, line 681); `single_type_kv_cache_manager.py` frees a request's blocks tail first "
           "(`reversed`, line 589); the queue is `FreeKVCacheBlockQueue` in `kv_cache_utils.py` (line 246)"),
}
KERNEL_BANDS = [(-math.inf, -3.0, "more than 3% shorter"), (-3.0, 3.0, "within 3% of it, either way"),
                (3.0, 50.0, "3% to 50% longer"), (50.0, math.inf, "half as long again, or more")]

RECAP = [
    "Token *t* lives in logical block *t* // *B* at offset *t* % *B*; the block table maps the logical block to "
    "a physical one, so its slot in the pool is physical block × *B* + offset.",
    "Prefill takes just the blocks the prompt fills; decode takes a new block only when the last one is full; a "
    "finished request gives all its blocks back at once.",
    "This engine's free list is a queue (vLLM V1's order for cached blocks): blocks leave from its front and "
    "come back at its end, a request's last block first; vLLM V0 reused the most recently freed block first. "
    "Either way block tables soon point all over the pool, and any free block fits any request.",
    "A request wastes at most *B* − 1 slots, all in its last block. On this project's H200 kernel, block sizes "
    "{{ kernel_sizes }} changed a decode step's attention time by {{ kernel_spread }} against *B* = 16: block "
    "size is a memory trade-off more than a speed one.",
]


# --------------------------------------------------------------------------------------------- runs
def life_run(loaded):
    return scenario_run(loaded, LIFE)


@dataclass
class BusyPool:
    """The busy pool's story: every table before any request finished, the free list just before the new
    request arrives, and the pool after it took its blocks."""

    tables_before: dict[str, list[int]]
    free_before: list[int]
    bm: BlockManager
    new: str
    message: str  # the engine's sentence for the new request's allocation


def busy_story() -> BusyPool:
    """Four requests fill the pool, two finish (in ``BUSY["freed"]`` order), a new one takes blocks from the
    free list."""
    b = BUSY
    bm = BlockManager(b["num_blocks"], b["block_size"])
    for i, n in enumerate(b["tokens"]):
        bm.allocate(f"R{i + 1}", n)
    before = {s: list(t) for s, t in bm.block_tables.items()}
    for rid in b["freed"]:
        bm.free(rid)
    free = list(bm.free_block_queue)
    bm.drain_events()
    new = f"R{len(b['tokens']) + 1}"
    bm.allocate(new, b["new"])
    return BusyPool(before, free, bm, new, bm.drain_events()[-1].message)


def v0_naive_order(tables: dict[str, list[int]], freed: list[str], num_blocks: int, need: int) -> list[int]:
    """The blocks vLLM V0's ``NaiveBlockAllocator`` would hand a new request needing ``need`` blocks, after
    the requests ``freed`` (in that order) release their ``tables`` (``FREE_ORDER_SOURCES["v0"]``): free
    ids in a deque, a table freed first block to last, each freed id put back with ``appendleft``, new
    blocks taken with ``popleft``, so the most recently freed block comes first. The pool's other blocks
    are held (the busy pool has none free)."""
    from collections import deque

    held = {b for t in tables.values() for b in t}
    free = deque(b for b in range(num_blocks) if b not in held)
    for rid in freed:
        for b in tables[rid]:
            free.appendleft(b)
    return [free.popleft() for _ in range(need)]


def v1_uncached_order(tables: dict[str, list[int]], freed: list[str], num_blocks: int, need: int) -> list[int]:
    """The blocks vLLM V1 would hand out with prefix caching off (every freed block to the front, a table
    tail first: ``FREE_ORDER_SOURCES["v1"]``), from this engine's ``BlockManager`` in that mode."""
    bm = BlockManager(num_blocks, max(1, BUSY["block_size"]), evict_uncached_first=True)
    for rid, table in tables.items():
        bm.allocate(rid, len(table) * bm.block_size)
    for rid in freed:
        bm.free(rid)
    return list(bm.free_block_queue)[:need]


def busy_pool() -> tuple[BlockManager, str]:
    """Four requests fill the pool, two finish, a new one takes the freed blocks. Returns (pool, its id)."""
    story = busy_story()
    return story.bm, story.new


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


def fill_pool(pool_slots: int, tokens: int, block_size: int) -> dict:
    """Requests of ``tokens`` tokens allocated by a ``BlockManager`` of ``pool_slots // block_size`` blocks
    until the next one does not fit: how many fit, blocks and empty slots per request."""
    bm = BlockManager(pool_slots // block_size, block_size)
    n = 0
    while bm.can_allocate(tokens):
        bm.allocate(f"R{n + 1}", tokens)
        n += 1
    per = bm.blocks_needed(tokens)
    return {"block size": block_size, "requests that fit": n, "blocks per request": per,
            "empty slots per request": per * block_size - tokens, "free blocks left": bm.num_free_blocks}


def _llama_bpt() -> int:
    p = kv_math.model_presets()[TRADE_MODEL]
    return kv_math.bytes_per_token(p.config, p.dtype)


# ------------------------------------------------------------------------------------ kernel figures
@dataclass(frozen=True)
class KernelSweep:
    """The block-size sweep of this project's Triton paged decode-attention kernel, as measured.

    ``times``: block size -> microseconds for one decode step's attention (``paged_us``: median of
    ``triton.testing.do_bench``) at ``batch`` requests of ``context`` tokens. ``overhead``: (batch, context,
    percent) of the paged kernel at block size 16 against PyTorch's ``scaled_dot_product_attention`` on a
    contiguous copy of the same K/V (CUDA-graph replay times)."""

    gpu: str
    date: str
    source: str
    batch: int
    context: int
    times: dict
    overhead: tuple

    def relative(self, block_size: int, ref: int = KERNEL_REF) -> float:
        """Time at ``block_size`` against ``ref``, in percent (+1.5: 1.5% longer)."""
        return 100.0 * (self.times[block_size] / self.times[ref] - 1.0)


@lru_cache(maxsize=None)
def kernel_sweep(path: str = KERNEL_RUN["json"]) -> KernelSweep:
    """Read the sweep from the benchmark's JSON (``bench/kernels.py --json``). Raises FileNotFoundError or
    ValueError naming the file when it is missing or holds no sweep of one batch and context."""
    file = REPO / path
    data = json.loads(file.read_text())
    rows = data.get("sweep") or []
    shapes = {(r["batch"], r["context"]) for r in rows}
    if len(shapes) != 1 or not any(r["block_size"] == KERNEL_REF for r in rows):
        raise ValueError(f"{path}: expected one batch x context swept over block sizes including {KERNEL_REF}")
    (batch, context), = shapes
    overhead = tuple((r["batch"], r["context"], r["graph_overhead_vs_sdpa_pct"]) for r in data.get("decode", [])
                     if r.get("block_size") == KERNEL_REF and "graph_overhead_vs_sdpa_pct" in r)
    return KernelSweep(data["env"]["gpu"], KERNEL_RUN["date"], path, batch, context,
                       {r["block_size"]: r["paged_us"] for r in rows}, overhead)


def _signed(pct: float) -> str:
    return f"{pct:+.1f}%"


def kernel_table(k: KernelSweep) -> str:
    """The sweep as a Markdown table: block size, microseconds, relative to B = 16."""
    lines = ["| block size | attention time per decode step (µs) | against *B* = 16 |", "|---:|---:|---:|"]
    lines += [f"| {B} | {t:.1f} | {_signed(k.relative(B)) if B != KERNEL_REF else '(reference)'} |"
              for B, t in sorted(k.times.items())]
    return "\n".join(lines)


BIG_BATCH, BIG_CONTEXT = 64, 1024  # the overhead is quoted apart for batches and contexts at least this large


def _and(values) -> str:
    v = [f"{x:,}" for x in sorted(set(values))]
    return " and ".join([", ".join(v[:-1]), v[-1]] if len(v) > 1 else v)


def kernel_facts() -> dict:
    """The kernel figures the lesson's text shows, all read from ``kernel_sweep()``."""
    k = kernel_sweep()
    rel = [k.relative(B) for B in k.times if B != KERNEL_REF]
    big = [(b, p) for b, c, p in k.overhead if b >= BIG_BATCH and c >= BIG_CONTEXT]
    small = [(b, p) for b, c, p in k.overhead if b < BIG_BATCH]
    return {"kernel_gpu": k.gpu, "kernel_date": k.date, "kernel_source": f"`{k.source}` ({KERNEL_RUN['doc']})",
            "kernel_batch": k.batch, "kernel_context": f"{k.context:,}", "kernel_table": kernel_table(k),
            "kernel_ask": KERNEL_ASK, "kernel_ref": KERNEL_REF, "kernel_entries_ask": -(-k.context // KERNEL_ASK),
            "kernel_entries_ref": -(-k.context // KERNEL_REF),
            "kernel_sizes": f"{min(k.times)} to {max(k.times)}",
            "kernel_spread": f"{_signed(min(rel))} to {_signed(max(rel))}",
            "kernel_overhead_big": (f"{_signed(min(p for _, p in big))} to {_signed(max(p for _, p in big))}"
                                    if big else "(not measured)"),
            "kernel_big_batches": _and(b for b, _ in big) if big else "-", "kernel_big_context": f"{BIG_CONTEXT:,}",
            "kernel_overhead_small": f"up to {_signed(max(p for _, p in small))}" if small else "(not measured)",
            "kernel_small_batches": _and(b for b, _ in small) if small else "-"}


# -------------------------------------------------------------------------------------------- lesson
def _life(ctx):
    return ctx.run(life_run)


def _life_facts(ctx) -> dict:
    run = _life(ctx)
    first = run.records[0]
    return {"prompt_len": first.scheduled[0].num_tokens, "block_size": run.block_size, "num_blocks": run.num_blocks,
            "max_tokens": len(run.outputs[run.request_ids[0]].output_token_ids)}


def _tables(tables: dict[str, list[int]]) -> str:
    return ", ".join(f"{s} {t}" for s, t in tables.items())


def facts(ctx) -> dict:
    story = busy_story()
    return {**_life_facts(ctx), **kernel_facts(), "busy_blocks": BUSY["num_blocks"], "busy_block_size": BUSY["block_size"],
            "busy_freed": " finished, then ".join(BUSY["freed"]),
            "busy_count": len(BUSY["tokens"]), "busy_each": max(BUSY["tokens"]), "busy_request": story.new, "busy_tokens": BUSY["new"],
            "busy_before": _tables(story.tables_before), "busy_table": str(story.bm.block_tables[story.new]),
            "trade_tokens": TRADE_TOKENS,
            "fresh_queue": ", ".join(map(str, list(BlockManager(BUSY["num_blocks"], BUSY["block_size"]).free_block_queue)[:3])),
            "v1_source": ("`vllm/v1/core/block_pool.py`, `BlockPool.free_blocks`: a freed block with a hash joins the "
                          "back of the `FreeKVCacheBlockQueue`, and a finished request's blocks are freed tail first"),
            "v0_order": ("vLLM V0, whose design this engine's paper semantics follow, did otherwise: its "
                         "`NaiveBlockAllocator` keeps the free block ids in a deque and hands out the block freed "
                         "**most recently** first (`popleft` to take, `appendleft` to give back: "
                         "`vllm/core/block/naive_block.py`, lines 138 and 152, in vLLM 0.10.0)."),
            }


def _band(pct: float) -> str:
    return next(label for lo, hi, label in KERNEL_BANDS if lo <= pct < hi)


def exercises(ctx) -> dict[str, Exercise]:
    run = _life(ctx)
    life = _life_facts(ctx)
    B = run.block_size
    _, alloc = run.first("allocate")
    prefill = run.records[0].snapshot
    last = alloc.blocks[-1]
    fill = prefill.fills[last]
    _, new_block = run.first("new_block")
    pos = new_block.data["position"]

    story = busy_story()
    bm, new = story.bm, story.new
    BB = bm.block_size
    table = bm.block_tables[new]
    n_blocks = len(table)
    freed = BUSY["freed"]
    table_order = [b for rid in freed for b in story.tables_before[rid]][:n_blocks]
    other_first = [b for rid in reversed(freed) for b in story.free_before if b in story.tables_before[rid]][:n_blocks]
    stack = list(reversed(story.free_before))[:n_blocks]
    v0 = v0_naive_order(story.tables_before, freed, BUSY["num_blocks"], n_blocks)
    v1_off = v1_uncached_order(story.tables_before, freed, BUSY["num_blocks"], n_blocks)
    logical, offset = divmod(WHERE_T, BB)
    phys = bm.slot(new, WHERE_T) // BB

    rows = {r["block size"]: r for r in tradeoff(TRADE_TOKENS, _llama_bpt())}
    rA = rows[TRADE_ASK]
    pick = {size: fill_pool(PICK["pool_slots"], PICK["tokens"], size) for size in PICK["sizes"]}
    counts = {size: r["requests that fit"] for size, r in pick.items()}
    best = max(counts.values())
    winners = [size for size in PICK["sizes"] if counts[size] == best]
    small, mid, large = PICK["sizes"]
    tie = f"{small} and {mid} fit the same number"
    pick_options = [str(small), str(mid), str(large), tie]
    pick_answer = tie if winners == [small, mid] else str(winners[0])
    summary = "; ".join(f"B = {size}: {r['blocks per request']} block{'s' * (r['blocks per request'] != 1)} per "
                        f"request, {r['empty slots per request']} empty, {r['requests that fit']} fit"
                        for size, r in pick.items())
    pick_msgs = {
        str(small): (f"Blocks of {small} never leave more empty than blocks of {mid}, but here a {PICK['tokens']}-token "
                     f"request fills its blocks exactly at both sizes ({summary})." if counts[small] == counts[mid]
                     else f"{summary}."),
        str(mid): (f"At {mid} a request fills its blocks exactly, but so it does at {small} ({summary})."
                   if counts[small] == counts[mid] else f"{summary}."),
        str(large): (f"A {PICK['tokens']}-token request takes one whole block of {large} and leaves "
                     f"{pick[large]['empty slots per request']} of its slots empty ({summary})."),
        tie: f"They do not: {summary}.",
    }

    k = kernel_sweep()
    k_rel = k.relative(KERNEL_ASK)
    k_answer = _band(k_rel)
    k_msgs = {
        KERNEL_BANDS[0][2]: "Fewer tokens per block does not make the kernel faster: it reads the same keys and values.",
        KERNEL_BANDS[1][2]: (f"Not here: the measured difference is {_signed(k_rel)}, outside that band."),
        KERNEL_BANDS[2][2]: ("Sixteen times the table entries sounds expensive, but the kernel reads keys and values "
                             "in tiles of many tokens whatever the block size, and the table lookups are a small "
                             "part of the bytes it moves."),
        KERNEL_BANDS[3][2]: ("The lookups would make the step half as long again only if the kernel spent a good "
                             "part of its time on them; it spends it reading keys and values, the same bytes at any "
                             "block size."),
    }
    return {
        "prefill_blocks": Exercise(
            "prefill_blocks", f"Prefill writes the keys and values of all {life['prompt_len']} prompt tokens. How "
            f"many blocks of {B} does it take?", "number", len(alloc.blocks), unit="blocks",
            explanation=(f"ceil({life['prompt_len']} / {B}) = {len(alloc.blocks)}: the engine took blocks "
                         f"{alloc.blocks} from the free list."),
            slips=[Slip("rounded-down", life["prompt_len"] // B,
                        f"{life['prompt_len']} / {B} rounded **down** leaves the last {life['prompt_len'] % B} prompt "
                        "tokens without a block: a partly filled block is still a whole block."),
                   Slip("reserved-reply", -(-(life["prompt_len"] + life["max_tokens"]) // B),
                        f"You made room for the {life['max_tokens']} tokens to come as well. Paging reserves nothing "
                        "ahead: prefill takes blocks for the prompt only.")]),
        "last_fill": Exercise(
            "last_fill", "How many tokens does the **last** of those blocks hold after prefill?", "number",
            fill, unit="tokens",
            explanation=(f"Block {last} holds {fill} of {B} slots; the other "
                         f"{B - fill} wait for the reply's tokens. The engine said: *{alloc.message}*"),
            slips=[Slip("full-block", B, "Only the blocks before the last are full; the last holds what is left of "
                        "the prompt."),
                   Slip("first-reply-token", fill + 1,
                        "You counted the token prefill picked. Its key and value are stored only when it is fed "
                        "back in, at the first decode step.")]),
        "fourth_block": Exercise(
            "fourth_block", "Decode writes one token per step into the last block. At which **token position** "
            "(counting the prompt from 0) does the request take a fourth block?", "number", pos,
            explanation=(f"Positions up to {pos - 1} fit in the first three blocks; token "
                         f"{pos} starts logical block {new_block.data['logical_block']}. "
                         f"The engine said: *{new_block.message}*"),
            slips=[Slip("last-slot", pos - 1, f"Position {pos - 1} is the last slot of the third block: it still fits."),
                   Slip("counted-from-1", pos + 1, "Positions count from 0, so the first slot of the fourth block "
                        f"is position 3 × {B}.")],
            answer_phrases=[f"token {pos} starts logical block", f"a fourth block at token {pos}",
                            f"4th at token {pos}", "takes one more when the last is full",
                            "only when the last block is full", "only when the last one is full"]),
        "free_list_table": Exercise(
            "free_list_table",
            f"**Be the block manager.** {new} arrives with a prompt of {BUSY['new']} tokens. Write its block "
            "table, as this engine's free queue gives it.", "list", table,
            explanation=(f"The free list held {story.free_before} ({freed[0]}'s blocks first, each request's last "
                         f"block first); ceil({BUSY['new']} / {BB}) = {n_blocks} blocks come from its front. The "
                         f"engine said: *{story.message}*"),
            tags={"allocator", "transfer"},
            slips=_distinct_slips(table, [
                Slip("v0-most-recent-first", v0,
                     "That is the order of **vLLM V0**'s `NaiveBlockAllocator`, which hands out the most recently "
                     "freed block first" + (" (and of V1 with prefix caching off)" if v1_off == v0 else "")
                     + f". This engine's free list is a queue, as V1's is for cached blocks: {freed[0]}, freed "
                     "first, leaves first."),
                Slip("v1-caching-off", v1_off,
                     "That is vLLM V1's order with prefix caching **off**, where every freed block goes to the "
                     "front. This engine's free list puts freed blocks at the back."),
                Slip("table-order", table_order,
                     "You gave the freed blocks back in table order (or took the lowest ids). A finished request's "
                     "blocks join the free list **last block first**."),
                Slip("wrong-request-first", other_first,
                     f"{freed[0]} finished before {freed[1]}, so its blocks joined the free list first and leave "
                     "it first."),
                Slip("newest-first", stack,
                     "You read the queue from its back (the most recently freed block first). In this engine the "
                     "block freed longest ago leaves first."),
                Slip("one-block-short", table[:-1],
                     f"{BUSY['new']} tokens need {n_blocks} blocks: the last {BUSY['new'] % BB} tokens need a "
                     "block of their own."),
            ])),
        "where_block": Exercise(
            "where_block", f"In {new}'s table {table}, which **physical block** holds token {WHERE_T}?", "number",
            phys,
            explanation=(f"{WHERE_T} // {BB} = logical block {logical}; the table's entry {logical} is "
                         f"physical block {table[logical]}."),
            slips=[Slip("logical-block", logical,
                        f"That is the **logical** block number ({WHERE_T} // {BB}); the table maps it to a physical "
                        "block."),
                   Slip("counted-from-1", table[logical - 1],
                        f"You counted the table's entries from 1. Entry 0 is the first one, so logical block "
                        f"{logical} is the entry after {table[logical - 1]}.")],
            answer_phrases=[f"token {WHERE_T} lives in physical block {phys}", f"token {WHERE_T} is in block {phys}",
                            f"entry {logical} is physical block {phys}"]),
        "where_slot": Exercise(
            "where_slot", "And which **slot** of the pool holds it?", "number",
            bm.slot(new, WHERE_T),
            explanation=(f"offset {WHERE_T} % {BB} = {offset}; slot {table[logical]} × {BB} + "
                         f"{offset} = {bm.slot(new, WHERE_T)}: token {WHERE_T} is in slot {bm.slot(new, WHERE_T)}, as "
                         "the engine's slot mapping says."),
            slips=[Slip("position", WHERE_T,
                        f"{WHERE_T} is the token's position in the request; its slot in the pool goes through the "
                        "block table."),
                   Slip("no-offset", phys * BB,
                        f"That is the first slot of block {phys}; add the offset {WHERE_T} % {BB} inside it.")],
            answer_phrases=[f"token {WHERE_T} is in slot {bm.slot(new, WHERE_T)}",
                            f"token {WHERE_T} lives in slot {bm.slot(new, WHERE_T)}"]),
        "trade_pick": Exercise(
            "trade_pick",
            f"A pool holds {PICK['pool_slots']:,} token slots, and every request is exactly {PICK['tokens']} tokens "
            f"long (prompt + reply). Cut into blocks of {small}, {mid} or {large} tokens: which block size lets the "
            "most requests hold their tokens at once?", "choice", pick_answer, options=pick_options,
            explanation=f"The engine's block manager filled the pool at each size: {summary}.",
            tags={"transfer"},
            slips=[Slip(f"option-{o}", o, pick_msgs[o]) for o in pick_options if o != pick_answer],
            answer_phrases=[pick_answer, f"{pick_answer} of requests"] if pick_answer == tie else
                           [f"blocks of {pick_answer} fit the most", f"b = {pick_answer} fits the most"]),
        "trade_256": Exercise(
            "trade_256", f"One request of {TRADE_TOKENS} tokens, blocks of {TRADE_ASK}: what percentage of the "
            "request's allocation is empty? (Within 3 points.)", "number", rA["empty %"], tolerance=3.0, unit="%",
            explanation=(f"{rA['blocks']} blocks = {rA['slots']} slots, {rA['empty slots']} empty = "
                         f"{rA['empty %']}% ({rA['empty bytes']} at Llama-2-7B's size), for every such request."),
            slips=[Slip("half-block", round(metrics.pct(TRADE_ASK / 2, rA["slots"]), 1),
                        f"That is the average rule, half a block ({TRADE_ASK // 2} slots); this request's own length "
                        "decides how much of its last block stays empty."),
                   Slip("worst-case", round(metrics.pct(TRADE_ASK - 1, rA["slots"]), 1),
                        f"That is the worst case, {TRADE_ASK - 1} empty slots; this request's own length decides."),
                   Slip("share-of-tokens", round(metrics.pct(rA["empty slots"], TRADE_TOKENS), 1),
                        f"You divided by the {TRADE_TOKENS} tokens; the share is of the {rA['slots']} allocated "
                        "slots.")]),
        "kernel_speed": Exercise(
            "kernel_speed",
            f"This project's Triton paged-attention kernel was timed on an {k.gpu}, {k.batch} requests of "
            f"{k.context:,} tokens each, at several block sizes. At *B* = {KERNEL_ASK}, the kernel looks up "
            f"{KERNEL_REF // KERNEL_ASK} times as many table entries as at *B* = {KERNEL_REF}. Compared with "
            f"*B* = {KERNEL_REF}, one decode step's attention takes...", "choice", k_answer,
            options=[label for *_, label in KERNEL_BANDS],
            explanation=(f"Measured: {k.times[KERNEL_ASK]:.1f} µs at *B* = {KERNEL_ASK} against "
                         f"{k.times[KERNEL_REF]:.1f} µs at *B* = {KERNEL_REF}, {_signed(k_rel)} "
                         f"({k.gpu}, run of {k.date}, `{k.source}`). The kernel gathers keys and values in tiles of "
                         "many tokens, row by row through the table, whatever the block size."),
            source=f"the {k.gpu} measurement ({k.date})",
            slips=[Slip(f"band-{i}", label, k_msgs[label]) for i, (*_, label) in enumerate(KERNEL_BANDS)
                   if label != k_answer],
            # Worded verdicts of the measurement (docs/benchmarks.md once said "block size barely matters").
            answer_phrases=[k_answer] + (["barely matters", "not a speed one", "does not change the kernel's speed",
                                          "block size does not matter to the kernel"]
                                         if k_answer == KERNEL_BANDS[1][2] else [])),
    }


def _distinct_slips(expected, slips: list[Slip]) -> list[Slip]:
    """The slips whose answers differ from ``expected`` and from every earlier slip's (the first of equal
    ones is kept: V0's order and another usual slip can give the same table)."""
    seen, out = [expected], []
    for slip in slips:
        if slip.answer not in seen:
            seen.append(slip.answer)
            out.append(slip)
    return out


def reveal_free_list_table(ctx) -> None:
    import streamlit as st

    from viz import block_pool_figure

    story = busy_story()
    bm, new = story.bm, story.new
    st.plotly_chart(block_pool_figure(manager_snapshot(bm), sorted(story.tables_before) + [new], selected=new,
                                      highlight=bm.block_tables[new], slot_mode=True,
                                      title=f"{new}'s blocks framed; free list before it came: {story.free_before}"),
                    width="stretch", key="l3_reveal_free_list")
    st.caption(f"Free list now, front first: {list(bm.free_block_queue)}.")


def reveal_trade_pick(ctx) -> None:
    import pandas as pd
    import streamlit as st

    rows = [fill_pool(PICK["pool_slots"], PICK["tokens"], size) for size in PICK["sizes"]]
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    st.caption(f"Each row is a BlockManager of {PICK['pool_slots']:,} slots taking {PICK['tokens']}-token requests "
               "until the next one does not fit.")


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
