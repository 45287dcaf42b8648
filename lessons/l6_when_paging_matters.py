"""Lesson 6: when paging matters, and a quiz on the misconceptions. Every answer is decided by an
experiment run on the engine when the page loads (the reveal says which), not typed into the lesson."""

from __future__ import annotations


from engine import EngineConfig, LLMEngine
from lessons import kv_math
from lessons.common import scenario_run
from lessons.exercise import Exercise

TF = ["true", "false"]
SHORT = {"seed": 3, "n": 16, "lo": 20, "hi": 257, "max_len": 256, "block_size": 16}


def _tf(claim_holds: bool) -> str:
    return TF[0] if claim_holds else TF[1]


def slots_per_byte(loaded) -> dict:
    """Token slots a paged pool and a contiguous region get from the same KV budget (1 MiB)."""
    out = {}
    for allocator in ("paged", "contiguous"):
        e = LLMEngine(EngineConfig(device="auto", kv_budget_bytes=2**20, block_size=16, allocator=allocator,
                                   max_model_len=256), loaded)
        cache = e.kv_cache
        nbytes = sum(t.numel() * t.element_size() for t in cache.key_cache + cache.value_cache)
        out[allocator] = {"slots": cache.num_blocks * cache.block_size, "bytes": nbytes}
    return out


def outputs_match(loaded) -> tuple[bool, int]:
    """Greedy outputs of lesson 5's requests, paged vs contiguous: (identical?, tokens compared)."""
    from lessons.l5_out_of_memory import ROOMY_BLOCKS, SCENARIO

    paged = scenario_run(loaded, SCENARIO, num_blocks=ROOMY_BLOCKS)
    contiguous = scenario_run(loaded, SCENARIO, num_blocks=ROOMY_BLOCKS, allocator="contiguous")
    same = all(paged.outputs[r].output_token_ids == contiguous.outputs[r].output_token_ids for r in paged.request_ids)
    return same, sum(len(o.output_token_ids) for o in paged.outputs.values())


def short_waste() -> tuple:
    import numpy as np

    from lessons.l2_contiguous_waste import waste_run

    s = SHORT
    lengths = np.random.default_rng(s["seed"]).integers(s["lo"], s["hi"], s["n"]).tolist()
    return lengths, waste_run(lengths, s["max_len"], s["block_size"])


def batch_one() -> tuple:
    from lessons.l2_contiguous_waste import waste_run

    s = SHORT
    return waste_run([s["max_len"]], s["max_len"], s["block_size"])


def facts(ctx) -> dict:
    from lessons.l1_kv_cache import CONTEXT, GPU_QUESTION

    p = kv_math.model_presets()["llama-2-7b"]
    g = kv_math.geometry(p.config, p.dtype)
    gpu = next(x for x in kv_math.gpus() if x.name == GPU_QUESTION)
    fit = kv_math.gpu_fit(gpu.memory_bytes, kv_math.parameter_count(p) * g.dtype_bytes, g.bytes_per_token, CONTEXT)
    return {"fit_requests": fit.requests, "fit_context": f"{CONTEXT:,}"}


def exercises(ctx) -> dict[str, Exercise]:
    from lessons.l3_block_tables import busy_pool
    from lessons.l5_out_of_memory import pressure_run

    capacity = ctx.run(slots_per_byte)
    per_slot = {k: v["bytes"] / v["slots"] for k, v in capacity.items()}
    same, compared = ctx.run(outputs_match)
    tight = ctx.run(pressure_run, "recompute")
    swaps = len(tight.events("swap_out"))
    swapped_blocks = sum(len(e.blocks) for e in ctx.run(pressure_run, "swap").events("swap_out"))
    preempts = tight.events("preempt")
    bm, new = busy_pool()
    table = bm.block_tables[new]
    consecutive = all(b2 == b1 + 1 for b1, b2 in zip(table, table[1:]))
    lengths, short = short_waste()
    one = batch_one()
    return {
        "q_compress": Exercise(
            "q_compress", "*Paging compresses the KV cache: a token takes fewer bytes in a block.*", "choice",
            _tf(per_slot["paged"] < per_slot["contiguous"]), options=TF,
            explanation=(f"The engine built a paged pool and a contiguous region from the same 1 MiB budget (it "
                         "sizes both in whole blocks of 16, so the region has as many slots as the pool): "
                         f"{capacity['paged']['slots']:,} vs {capacity['contiguous']['slots']:,} token slots, "
                         f"{per_slot['paged']:,.0f} vs {per_slot['contiguous']:,.0f} bytes per slot. Paging stores the "
                         "same numbers; it only stops wasting slots.")),
        "q_outputs": Exercise(
            "q_outputs", "*Paging changes the model's outputs a little, because attention reads keys and values "
            "from scattered blocks.*", "choice", _tf(not same), options=TF,
            explanation=(f"The engine ran lesson 5's five requests greedily on both allocators: "
                         f"{'all' if same else 'not all'} {compared} generated tokens are identical. The tests go "
                         "further: every step's logits match transformers' own generate.")),
        "q_cpu": Exercise(
            "q_cpu", "*Paging moves the KV cache to CPU memory.*", "choice", _tf(swaps > 0), options=TF,
            explanation=(f"In lesson 5's tight run with recompute, the engine made {swaps} swaps to the CPU: every "
                         "block stayed in the GPU pool, also under pressure. Only the run with the *swap* policy "
                         f"copied blocks to the CPU ({swapped_blocks} blocks, only while a request was preempted). "
                         "Swapping is a separate policy that paging makes easy, not paging itself.")),
        "q_no_queue": Exercise(
            "q_no_queue", "*With paging, a server never has to queue or preempt requests.*", "choice",
            _tf(not preempts), options=TF,
            explanation=(f"Lesson 5's tight pool: {len(preempts)} preemption{'s' * (len(preempts) != 1)} and "
                         f"{', '.join(sorted({e.request_id for e in tight.events('wait')}))} waiting at the door at times, in the "
                         "engine's own run. Paging uses memory better; it does not make memory endless.")),
        "q_chunked": Exercise(
            "q_chunked", "*Paging is contiguous allocation in smaller chunks: a request's blocks sit next to "
            "each other.*", "choice", _tf(consecutive), options=TF,
            explanation=(f"Lesson 3's busy pool gave {new} the blocks {table}: any free block, in any order. The "
                         "block table is what makes that possible, and it is why no gaps form.")),
        "q_short": Exercise(
            "q_short", "*Paging only helps with very long contexts.*", "choice",
            _tf(short.contig_pct - short.paged_pct < 10), options=TF,
            explanation=(f"{len(lengths)} short requests ({min(lengths)} to {max(lengths)} tokens, maximum length "
                         f"{SHORT['max_len']}): contiguous allocation leaves {short.contig_pct:.1f}% of its "
                         f"reservations empty, paging {short.paged_pct:.1f}%. What matters is that lengths vary.")),
        "q_batch1": Exercise(
            "q_batch1", "*For a single request that always runs to the maximum length, paging saves almost no "
            "memory.*", "choice", _tf(abs(one.contig_pct - one.paged_pct) < 5), options=TF,
            explanation=(f"One request of {SHORT['max_len']} tokens: contiguous {one.contig_pct:.1f}% empty, "
                         f"paged {one.paged_pct:.1f}%. With one request of known length there is nothing to win; "
                         "paging pays off with many requests of varying length.")),
    }


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)
