"""Lesson 9: planning memory, from a GPU to how many requests fit.

Part 1 follows vLLM's start-up arithmetic (``kv_math.plan_kv_cache``; the sources are in ``KVPlan``'s
docstring): a real model config (``lessons/data/models``) on a real GPU (``lessons/data/gpus.json``) ->
weights, KV budget, blocks, and the "Maximum concurrency" line vLLM logs. The activation and non-PyTorch
figures are the ones vLLM's own start-up profile logged for Llama-3-8B (``PROFILE``, quoted with its source);
everything else is computed here from the config and the GPU.

Part 2 checks the prediction on the embedded model: a pool with the same ratio of blocks to a request's
blocks as the real GPU (``scaled_blocks``), more requests than it can hold at full length, all arriving at
once, run by the engine with vLLM V1's scheduler. Every expected answer, and every usual wrong answer
(``Slip``), is read from those runs or computed by ``kv_math`` with the mistaken rule.
"""

from __future__ import annotations

import math

from engine import SamplingParams
from engine.scenarios.presets import PRESSURE_LONG_TEXT, PRESSURE_TEXTS, exact_prompt
from lessons import kv_math
from lessons.common import EngineRun, run_engine
from lessons.exercise import Exercise, Slip

GIB = kv_math.GIB
MODEL = "qwen2.5-7b"             # the questions' model (lessons/data/models)
GPU = "NVIDIA A100 (80 GB)"      # the questions' GPU (lessons/data/gpus.json)
BLOCK_SIZE = 16                  # vLLM's default block size
SHORT_LEN = 1000                 # the transfer question's --max-model-len (not a multiple of the block size)

# vLLM's start-up memory profile of Llama-3-8B on one H100, as a vLLM maintainer posted it (vLLM PR #10511,
# "overhaul memory profiling"). Quoted figures, in GiB as logged; the lesson recomputes the weights from
# the config and applies the activation and non-PyTorch figures to a model of the same size.
PROFILE = {
    "source": "https://github.com/vllm-project/vllm/pull/10511",
    "model": "llama-3-8b",
    "total_gpu_memory": 79.22,
    "gpu_memory_utilization": 0.90,
    "usable": 71.29,
    "model weights": 14.96,
    "non_torch_memory": 1.79,
    "PyTorch activation peak memory": 1.26,
    "available_kv_cache_memory": 53.29,
}
VLLM_SOURCE = ".peer-venv/lib/python3.11/site-packages/vllm/v1/core/kv_cache_utils.py"

# Part 2: the embedded model. Every request: a PROMPT-token prompt, OUTPUT tokens written (greedy, no early
# stop), so PROMPT + OUTPUT = the request's max length, as max_model_len counts it.
PROMPT, OUTPUT = 20, 20
HEAVY_PROMPT = 36               # the transfer: same length, a longer prompt and a shorter reply
SMALL_BLOCK = 8                 # the transfer: the same bytes in blocks of 8
EXTRA_REQUESTS = 2              # more requests than the door admits, so some wait

RECAP = [
    "vLLM's **KV budget** is what is left of `gpu_memory_utilization` × GPU memory after the weights, the peak "
    "activations of its start-up profile and the memory outside PyTorch: {{ q_budget }} for {{ q_model }} "
    "on an {{ q_gpu }}.",
    "The budget is cut into blocks of block_size × bytes per token; a request of `max_model_len` tokens "
    "needs ⌈max_model_len / block_size⌉ **whole** blocks, and the *maximum concurrency* vLLM logs is the "
    "blocks divided by that.",
    "The scheduler admits a request when its **prompt's** blocks are free, so more requests start than the "
    "formula says ({{ admitted }} instead of {{ formula_whole }} here); the pool then runs out at a block "
    "boundary, and the newest are preempted until the formula's number remain.",
    "Counting tokens instead of blocks overestimates what fits: a request's partly empty last block is "
    "memory nobody else can use.",
]


# ------------------------------------------------------------------------------------- part 1: a real GPU
def _preset(key: str):
    return kv_math.model_presets()[key]


def _gpu(name: str) -> kv_math.Gpu:
    return next(g for g in kv_math.gpus() if g.name == name)


def weight_bytes(preset) -> int:
    """Parameters (counted from the config on the meta device) x bytes per parameter of its dtype."""
    return kv_math.parameter_count(preset) * kv_math.geometry(preset.config, preset.dtype).dtype_bytes


def profile_bytes() -> tuple[int, int]:
    """(peak activations, memory outside PyTorch) of the quoted profile, in bytes."""
    return (round(PROFILE["PyTorch activation peak memory"] * GIB), round(PROFILE["non_torch_memory"] * GIB))


def real_plan(max_model_len: int | None = None, utilization: float = kv_math.VLLM_GPU_MEMORY_UTILIZATION,
              with_profile: bool = True, memory_bytes: int | None = None) -> kv_math.KVPlan:
    """The questions' plan: ``MODEL`` on ``GPU``, block size 16, the profile's activations and other memory;
    ``max_model_len`` defaults to the config's ``max_position_embeddings`` (vLLM's default). The keyword
    arguments give the plans of the usual slips (no profile, the whole memory, ...)."""
    preset = _preset(MODEL)
    act, other = profile_bytes() if with_profile else (0, 0)
    length = max_model_len or preset.config.max_position_embeddings
    return kv_math.plan_kv_cache(memory_bytes or _gpu(GPU).memory_bytes, weight_bytes(preset),
                                 kv_math.bytes_per_token(preset.config, preset.dtype), length, BLOCK_SIZE,
                                 utilization, act, other)


def example_plan() -> kv_math.KVPlan:
    """The worked example: the profile's own GPU and model (its logged total memory), vLLM's arithmetic."""
    preset = _preset(PROFILE["model"])
    act, other = profile_bytes()
    return kv_math.plan_kv_cache(round(PROFILE["total_gpu_memory"] * GIB), weight_bytes(preset),
                                 kv_math.bytes_per_token(preset.config, preset.dtype),
                                 preset.config.max_position_embeddings, BLOCK_SIZE,
                                 PROFILE["gpu_memory_utilization"], act, other)


def gib(n: float) -> float:
    return n / GIB


def _distinct(ex_kind_tol: tuple, expected, candidates: list[Slip]) -> list[Slip]:
    """The slips whose answers differ from the engine's and from each other by more than the tolerance
    (a slip equal to the right answer would be refused by ``Exercise``; two equal slips could not both be
    recognised)."""
    kind, tol, rel = ex_kind_tol
    probe = Exercise("probe", "", kind, expected, tolerance=tol, rel_tolerance=rel)
    kept: list[Slip] = []
    for slip in candidates:
        value = probe.parse(slip.answer)
        if probe._matches(value) or any(probe._matches(value, probe.parse(k.answer)) for k in kept):
            continue
        kept.append(slip)
    return kept


def _number(id_, question, expected, unit, slips, tolerance=0.0, rel_tolerance=0.0, **kw) -> Exercise:
    return Exercise(id_, question, "number", expected, unit=unit, tolerance=tolerance, rel_tolerance=rel_tolerance,
                    slips=_distinct(("number", tolerance, rel_tolerance), expected, slips), **kw)


def real_exercises() -> dict[str, Exercise]:
    preset, gpu = _preset(MODEL), _gpu(GPU)
    g = kv_math.geometry(preset.config, preset.dtype)
    params = kv_math.parameter_count(preset)
    plan = real_plan()
    act, other = profile_bytes()
    no_profile = real_plan(with_profile=False)
    whole = real_plan(utilization=1.0)
    after = 0.9 * (gpu.memory_bytes - plan.weight_bytes - act - other)  # 90% of what is left, not of the GPU
    short = real_plan(SHORT_LEN)
    L = plan.max_model_len
    W = gib(plan.weight_bytes)
    budget = gib(plan.kv_bytes)
    gb_blocks = int(budget * 10**9) // plan.bytes_per_block
    return {
        "p_weights": _number(
            "p_weights",
            f"**{preset.name}** has {params:,} parameters (counted from its config) stored in {preset.dtype}. "
            f"How many **GiB** (2^30 bytes) do its weights take on the GPU?",
            W, "GiB", rel_tolerance=0.01,
            slips=[Slip("gb", plan.weight_bytes / 10**9,
                        "That is the size in **GB** (10^9 bytes); vLLM logs GiB, 2^30 = 1,073,741,824 bytes."),
                   Slip("fp32", params * 4 / GIB,
                        f"That is 4 bytes per parameter (float32); {preset.dtype} takes {g.dtype_bytes}.")],
            explanation=(f"{params:,} × {g.dtype_bytes} bytes = {plan.weight_bytes:,} bytes = **{W:.2f} GiB** "
                         f"({plan.weight_bytes / 1e9:.2f} GB)."),
        ),
        "p_budget": _number(
            "p_budget",
            f"{preset.name} runs on an **{gpu.name}** ({gpu.memory_gb:g} × 10^9 bytes) with vLLM's default "
            f"`gpu_memory_utilization` {kv_math.VLLM_GPU_MEMORY_UTILIZATION:g}. Assume its start-up profile "
            f"measures what it measured for Llama-3-8B (a model of the same size): "
            f"{PROFILE['PyTorch activation peak memory']:g} GiB of peak activations and "
            f"{PROFILE['non_torch_memory']:g} GiB outside PyTorch. What does vLLM log as "
            "*Available KV cache memory*, in **GiB**?",
            budget, "GiB", rel_tolerance=0.01,
            slips=[Slip("no-profile", gib(no_profile.kv_bytes),
                        "That leaves out the peak activations and the memory outside PyTorch, as lesson 1 did: "
                        "vLLM measures them at start-up and keeps them out of the budget."),
                   Slip("whole-gpu", gib(whole.kv_bytes),
                        f"That starts from the whole GPU; vLLM only asks for "
                        f"{kv_math.VLLM_GPU_MEMORY_UTILIZATION:.0%} of it (`gpu_memory_utilization`)."),
                   Slip("util-last", gib(after),
                        f"That takes {kv_math.VLLM_GPU_MEMORY_UTILIZATION:.0%} of what is left after the weights "
                        f"and the profile; vLLM takes {kv_math.VLLM_GPU_MEMORY_UTILIZATION:.0%} of the whole GPU "
                        "first, then subtracts.")],
            explanation=(f"{gpu.memory_gb:g} GB × {kv_math.VLLM_GPU_MEMORY_UTILIZATION:g} = {plan.requested_bytes:,} "
                         f"bytes = {gib(plan.requested_bytes):.2f} GiB; minus weights {W:.2f} GiB, activations "
                         f"{gib(act):.2f} GiB and {gib(other):.2f} GiB outside PyTorch = **{budget:.2f} GiB**. vLLM "
                         f"would log: `{plan.log_lines()[0]}`"),
        ),
        "p_blocks": _number(
            "p_blocks",
            f"{preset.name} stores {plan.bytes_per_token:,} bytes of KV cache per token (lesson 1's formula: "
            f"{g.num_layers} layers, {g.num_kv_heads} KV heads, head_dim {g.head_dim}, {g.dtype_bytes} bytes). "
            f"With blocks of {BLOCK_SIZE} tokens, how many **blocks** does a budget of {budget:.2f} GiB hold?",
            plan.num_blocks, "blocks", rel_tolerance=0.005,
            slips=[Slip("tokens", plan.kv_bytes // plan.bytes_per_token,
                        f"That is the number of **tokens**; a block holds {BLOCK_SIZE} of them."),
                   Slip("gb", gb_blocks,
                        "That reads the budget as GB (10^9 bytes) while the block size is in bytes; a GiB is "
                        "2^30 bytes.")],
            explanation=(f"One block = {BLOCK_SIZE} × {plan.bytes_per_token:,} = {plan.bytes_per_block:,} bytes "
                         f"({kv_math.human_bytes(plan.bytes_per_block)}); "
                         f"{plan.kv_bytes:,} // {plan.bytes_per_block:,} "
                         f"= **{plan.num_blocks:,} blocks**, {plan.slots:,} token slots."),
        ),
        "p_concurrency": _number(
            "p_concurrency",
            f"vLLM's default `max_model_len` for {preset.name} is its config's {L:,} tokens. With the "
            f"{plan.num_blocks:,} blocks of {BLOCK_SIZE}, what does it log as *Maximum concurrency for {L:,} "
            "tokens per request*? (Two decimals, as vLLM prints it.)",
            plan.max_concurrency, "x", tolerance=0.01,
            slips=[Slip("floor", math.floor(plan.max_concurrency),
                        "vLLM logs the ratio with two decimals, not the whole requests it rounds down to."),
                   Slip("no-profile", no_profile.max_concurrency,
                        "That is the concurrency without the activations and the memory outside PyTorch."),
                   Slip("blocks-per-token", plan.num_blocks / L,
                        f"That divides blocks by tokens; a request of {L:,} tokens needs {L:,} / {BLOCK_SIZE} "
                        "blocks.")],
            explanation=(f"A request of {L:,} tokens needs ⌈{L:,} / {BLOCK_SIZE}⌉ = {plan.blocks_per_request:,} "
                         f"blocks; {plan.num_blocks:,} / {plan.blocks_per_request:,} = "
                         f"**{plan.max_concurrency:.2f}**. vLLM would log: `{plan.log_lines()[1]}`. Its code "
                         f"(`get_max_concurrency_for_kv_cache_config` in `{VLLM_SOURCE.split('site-packages/')[1]}`) "
                         "counts a request in **whole blocks** (`cdiv`), then logs the tokens as "
                         "int(concurrency × max_model_len)."),
        ),
        "p_maxlen": _number(
            "p_maxlen",
            f"The same server is started with `--max-model-len {SHORT_LEN:,}` (a chat service with short "
            f"requests). Same {plan.num_blocks:,} blocks of {BLOCK_SIZE}. What does vLLM log as *Maximum "
            f"concurrency for {SHORT_LEN:,} tokens per request*? (Two decimals.)",
            short.max_concurrency, "x", tolerance=0.01, tags={"transfer"},
            slips=[Slip("tokens", plan.slots / SHORT_LEN,
                        f"That divides the token slots by {SHORT_LEN:,}; a request takes whole blocks, "
                        f"⌈{SHORT_LEN:,} / {BLOCK_SIZE}⌉ = {short.blocks_per_request} of them, and its last one "
                        f"holds only {SHORT_LEN - (short.blocks_per_request - 1) * BLOCK_SIZE} tokens."),
                   Slip("floor", math.floor(short.max_concurrency),
                        "vLLM logs the ratio with two decimals, not the whole requests it rounds down to.")],
            explanation=(f"⌈{SHORT_LEN:,} / {BLOCK_SIZE}⌉ = {short.blocks_per_request} blocks per request "
                         f"(the last one {SHORT_LEN - (short.blocks_per_request - 1) * BLOCK_SIZE}/{BLOCK_SIZE} "
                         "full); "
                         f"{plan.num_blocks:,} / {short.blocks_per_request} = **{short.max_concurrency:.2f}**. vLLM "
                         f"would log: `{short.log_lines()[1]}`: {short.kv_cache_tokens:,} tokens, fewer than the "
                         f"{plan.slots:,} slots, because each request's last block has "
                         f"{short.blocks_per_request * BLOCK_SIZE - SHORT_LEN} slots nobody uses."),
        ),
    }


# ------------------------------------------------------------------------------- part 2: the engine check
def logged_concurrency() -> float:
    """The real plan's maximum concurrency as vLLM logs it (two decimals)."""
    return round(real_plan().max_concurrency, 2)


def scaled_blocks(block_size: int = BLOCK_SIZE) -> int:
    """A pool holding the real plan's logged concurrency worth of the small requests' blocks (whole blocks:
    rounded down), for blocks of ``block_size`` holding the same bytes as ``BLOCK_SIZE``-token blocks."""
    need = -(-(PROMPT + OUTPUT) // BLOCK_SIZE)
    return math.floor(logged_concurrency() * need + 1e-9) * (BLOCK_SIZE // block_size)


def num_requests() -> int:
    """More requests than the door admits on their prompts."""
    return scaled_blocks() // -(-PROMPT // BLOCK_SIZE) + EXTRA_REQUESTS


def planning_run(loaded, num_blocks: int, block_size: int, prompt_len: int, output_len: int, n: int) -> EngineRun:
    """``n`` requests of a ``prompt_len``-token prompt writing ``output_len`` tokens (greedy, no early stop),
    all arriving before the first step, in ``num_blocks`` blocks of ``block_size``: vLLM V1's scheduler, no
    prefix caching (the prompts would share nothing anyway), no watermark."""
    tokenize = lambda t: loaded[1](t, add_special_tokens=False)["input_ids"]  # noqa: E731
    texts = PRESSURE_TEXTS + [PRESSURE_LONG_TEXT]
    requests = [(exact_prompt(tokenize, texts[i % len(texts)], prompt_len),
                 SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)) for i in range(n)]
    return run_engine(loaded, requests, label=f"{n} requests in {num_blocks} blocks of {block_size}",
                      semantics="v1", block_size=block_size, num_blocks=num_blocks,
                      max_model_len=prompt_len + output_len, enable_prefix_caching=False, watermark=0.0)


def main_run(ctx) -> EngineRun:
    return ctx.run(planning_run, scaled_blocks(), BLOCK_SIZE, PROMPT, OUTPUT, num_requests())


def heavy_run(ctx) -> EngineRun:
    return ctx.run(planning_run, scaled_blocks(), BLOCK_SIZE, HEAVY_PROMPT, PROMPT + OUTPUT - HEAVY_PROMPT,
                   num_requests())


def small_block_run(ctx) -> EngineRun:
    return ctx.run(planning_run, scaled_blocks(SMALL_BLOCK), SMALL_BLOCK, PROMPT, OUTPUT, num_requests())


def number_of(request_id: str) -> int:
    """"R7" -> 7."""
    return int(request_id.lstrip("R"))


def first_admitted(run: EngineRun) -> list[str]:
    return [e.request_id for e in run.records[0].events if e.kind == "admit"]


def preempted(run: EngineRun) -> list[str]:
    """Requests preempted at least once, in the order of their first preemption."""
    return list(dict.fromkeys(e.request_id for e in run.events("preempt")))


def first_preemption(run: EngineRun) -> dict:
    """The first step that preempts: its record index, the victims, and the pool just before it (running
    requests in admission order, free blocks, blocks each running request holds), and the token position
    that needed a new block."""
    i, _ = run.first("preempt")
    rec, before = run.records[i], run.records[i - 1].snapshot
    held = {s.request_id: len(s.block_table) for s in before.sequences if s.status == "running"}
    position = next((e.data.get("position") for e in rec.events if e.kind == "new_block"), None)
    return {"index": i, "step": rec.step, "victims": [e.request_id for e in rec.events if e.kind == "preempt"],
            "running": [r for r in before.running], "free": before.num_free_blocks, "held": held,
            "position": position, "survivors": list(rec.snapshot.running)}


def naive_victims(fp: dict) -> list[str]:
    """The victims if each one only freed its blocks while still needing a new one: preempt the newest until
    the free blocks cover one per request *including* the victims."""
    running, free = fp["running"], fp["free"]
    for v in range(len(running) + 1):
        freed = sum(fp["held"][r] for r in running[len(running) - v:])
        if free + freed >= len(running):
            return running[len(running) - v:]
    return running


def facts(ctx) -> dict:
    ex = example_plan()
    preset = _preset(PROFILE["model"])
    plan = real_plan()
    run = main_run(ctx)
    need = -(-(PROMPT + OUTPUT) // BLOCK_SIZE)
    return {
        "ex_model": preset.name, "ex_total": f"{PROFILE['total_gpu_memory']:g} GiB",
        "ex_util": f"{PROFILE['gpu_memory_utilization']:.2f}", "ex_usable": f"{PROFILE['usable']:.2f} GiB",
        "ex_weights_log": f"{PROFILE['model weights']:.2f} GiB",
        "ex_non_torch": f"{PROFILE['non_torch_memory']:.2f} GiB",
        "ex_act": f"{PROFILE['PyTorch activation peak memory']:.2f} GiB",
        "ex_kv_log": f"{PROFILE['available_kv_cache_memory']:.2f} GiB", "ex_source": PROFILE["source"],
        "ex_params": f"{kv_math.parameter_count(preset):,}", "ex_weights": f"{gib(ex.weight_bytes):.2f} GiB",
        "ex_requested": f"{gib(ex.requested_bytes):.2f} GiB", "ex_kv": f"{gib(ex.kv_bytes):.2f} GiB",
        "ex_bpt": f"{ex.bytes_per_token:,} bytes", "ex_block_bytes": f"{ex.bytes_per_block:,} bytes",
        "ex_block_human": kv_math.human_bytes(ex.bytes_per_block), "ex_blocks": f"{ex.num_blocks:,}",
        "ex_len": f"{ex.max_model_len:,}", "ex_per_request": f"{ex.blocks_per_request:,}",
        "ex_concurrency": f"{ex.max_concurrency:.2f}x", "ex_log": "\n".join(ex.log_lines()),
        "ex_tokens": f"{ex.kv_cache_tokens:,}", "vllm_file": VLLM_SOURCE.split("site-packages/")[1],
        "ex_dtype": preset.dtype, "ex_dtype_bytes": kv_math.geometry(preset.config, preset.dtype).dtype_bytes,
        "default_util": f"{kv_math.VLLM_GPU_MEMORY_UTILIZATION:g}", "real_len": f"{plan.max_model_len:,}",
        "block_size": BLOCK_SIZE, "q_model": _preset(MODEL).name, "q_gpu": GPU,
        "q_budget": f"{gib(plan.kv_bytes):.2f} GiB", "real_ratio": f"{logged_concurrency():.2f}",
        "scaled_exact": f"{logged_concurrency() * need:.2f}",
        "prompt": PROMPT, "output": OUTPUT, "length": PROMPT + OUTPUT, "need": need, "n_requests": len(run.request_ids),
        "tiny_blocks": run.num_blocks, "tiny_concurrency": f"{run.num_blocks / need:.2f}x",
        "formula_whole": run.num_blocks // need, "admitted": len(first_admitted(run)),
        "small_block": SMALL_BLOCK, "small_blocks": scaled_blocks(SMALL_BLOCK), "heavy_prompt": HEAVY_PROMPT,
        "heavy_output": PROMPT + OUTPUT - HEAVY_PROMPT,
    }


def engine_exercises(ctx) -> dict[str, Exercise]:
    run, heavy, small = main_run(ctx), heavy_run(ctx), small_block_run(ctx)
    ids, L, B = run.request_ids, PROMPT + OUTPUT, BLOCK_SIZE
    need = -(-L // B)
    prompt_blocks = -(-PROMPT // B)
    formula = run.num_blocks // need
    by_tokens = run.num_blocks * B // L
    admitted = first_admitted(run)
    fp = first_preemption(run)
    victims = sorted(number_of(r) for r in fp["victims"])
    running = fp["running"]
    naive = naive_victims(fp)
    token_victims = running[by_tokens:]
    main_preemptions = len(run.events("preempt"))
    heavy_preemptions = len(heavy.events("preempt"))
    heavy_admitted = first_admitted(heavy)
    never = [r for r in small.request_ids if r not in preempted(small)]
    main_never = [r for r in ids if r not in preempted(run)]
    small_fp = first_preemption(small) if small.events("preempt") else None
    small_need = -(-L // SMALL_BLOCK)

    def nums(rs):
        return sorted(number_of(r) for r in rs)

    victim_slips = [Slip("oldest", nums(running[:len(victims)]),
                         "Those are the **oldest** running requests; first come, first served keeps them and "
                         "preempts the most recently admitted."),
                    Slip("victim-still-needs", nums(naive),
                         "Too many: a preempted request gives back its blocks **and** no longer needs a new one, "
                         "so each victim counts twice."),
                    Slip("tokens", nums(token_victims),
                         f"Too few: that keeps {by_tokens} = {run.num_blocks} × {B} slots // {L} tokens, as if "
                         f"requests could share blocks; each request holds whole blocks.")]
    victim_slips = [s for s in victim_slips if s.answer and s.answer != victims]
    victim_slips = [s for k, s in enumerate(victim_slips) if s.answer not in [t.answer for t in victim_slips[:k]]]
    return {
        "e_admit": _number(
            "e_admit", f"All {len(ids)} requests arrive before the first step. How many does the first step "
            "admit?", len(admitted), "requests",
            slips=[Slip("formula", formula,
                        f"That is the formula's {formula}: it budgets every request at its full {L} tokens. The "
                        f"scheduler only needs the **prompt's** blocks free to admit a request."),
                   Slip("tokens", by_tokens,
                        f"That divides the slots by {L} tokens, the full length; admission looks at the "
                        f"prompt's blocks only."),
                   Slip("all", len(ids),
                        f"Not all: their prompts would need {len(ids)} × {prompt_blocks} = "
                        f"{len(ids) * prompt_blocks} blocks, and the pool has {run.num_blocks}.")],
            explanation=(f"Each {PROMPT}-token prompt takes ⌈{PROMPT}/{B}⌉ = {prompt_blocks} blocks, so "
                         f"{len(admitted)} prompts take {len(admitted) * prompt_blocks} of the {run.num_blocks} "
                         f"blocks and the rest wait at the door: more than the formula's {formula}, because the "
                         "scheduler does not reserve the replies' blocks ahead. "
                         + " ".join(f"*{e.message}*" for e in run.records[0].events if e.kind == "wait")),
        ),
        "e_victims": Exercise(
            "e_victims",
            f"Each running request now holds {fp['position']} tokens in {fp['position'] // B} full blocks, and "
            f"{fp['free']} block{'s' * (fp['free'] != 1)} {'is' if fp['free'] == 1 else 'are'} free. At step "
            f"{fp['step']} every running request writes its token {fp['position']}, the first of a new block. "
            f"You are vLLM V1's scheduler: going through the running requests in admission order "
            f"({', '.join(running)}), when one needs a block and none is free, you preempt the most recently "
            "admitted running request, and repeat. **Which requests do you preempt in this step?** (Their "
            "numbers, e.g. 3, 5 for R3 and R5.)",
            "set", victims, tags={"allocator"}, slips=victim_slips,
            explanation=(f"The engine preempted {', '.join(fp['victims'])}: each victim frees its "
                         f"{fp['held'][fp['victims'][0]]} blocks and needs no new one, so "
                         f"{len(fp['survivors'])} requests keep running: exactly the formula's "
                         f"{run.num_blocks} // {need} = {formula}. But the pool ran out at token "
                         f"{fp['position']}, before anyone reached {L}: the formula budgets prompt **and** "
                         f"output, while blocks are taken one at a time as the reply grows. Counting tokens "
                         f"instead of blocks ({run.num_blocks} × {B} / {L} = {run.num_blocks * B / L:.1f}) would "
                         f"have promised {by_tokens}: the {need * B - L} empty slots of each last block are "
                         "memory nobody else can use."),
        ),
        "t_heavy": _number(
            "t_heavy",
            f"Same pool of {run.num_blocks} blocks of {B}, same {len(ids)} requests of {L} tokens, but now each "
            f"has a **{HEAVY_PROMPT}-token prompt** and writes {L - HEAVY_PROMPT} tokens. How many preemptions "
            "happen in the whole run?", heavy_preemptions, "preemptions", tags={"transfer"},
            slips=[Slip("same-length", main_preemptions,
                        f"That is what the {PROMPT}-token prompts caused. With {HEAVY_PROMPT}-token prompts the "
                        f"prompt alone takes ⌈{HEAVY_PROMPT}/{B}⌉ = {-(-HEAVY_PROMPT // B)} blocks, all a request "
                        "will ever need."),
                   Slip("waiting", len(ids) - len(heavy_admitted),
                        "Those requests **wait at the door**; they are never admitted early, so nobody has to "
                        "be preempted for them.")],
            explanation=(f"The door admits {len(heavy_admitted)} requests (⌈{HEAVY_PROMPT}/{B}⌉ = "
                         f"{-(-HEAVY_PROMPT // B)} blocks each), the formula's number, and their {L - HEAVY_PROMPT} "
                         f"new tokens fit in the room left in their last block: "
                         f"**{heavy_preemptions} preemptions**. The formula was right from the start because "
                         "the prompt already took every block the request would need."),
        ),
        "t_small": _number(
            "t_small",
            f"Back to the {PROMPT}-token prompts writing {OUTPUT} tokens, but the same bytes are cut into blocks "
            f"of **{SMALL_BLOCK} tokens**: {small.num_blocks} blocks. Of the {len(ids)} requests, how many are "
            "**never** preempted?", len(never), "requests", tags={"transfer"},
            slips=[Slip("same-as-16", len(main_never),
                        f"That is the count with blocks of {B}. With blocks of {SMALL_BLOCK} a request at its "
                        f"full {L} tokens takes ⌈{L}/{SMALL_BLOCK}⌉ = {small_need} blocks, and the door, the "
                        "block boundaries and the survivors all change."),
                   Slip("none-preempted", len(small.request_ids),
                        f"Smaller blocks waste less, but all {len(first_admitted(small))} admitted requests "
                        f"would need {len(first_admitted(small)) * small_need} blocks at full length: some must "
                        "still go."),
                   Slip("first-step-only", len(small.request_ids) - len(small_fp["victims"]) if small_fp else 0,
                        f"That counts only the first preemption step; when the requests cross the next "
                        f"{SMALL_BLOCK}-token boundary the pool runs out again.")],
            explanation=(f"The engine preempted {', '.join(preempted(small)) or 'nobody'}; "
                         f"**{len(never)}** never were. At full length a request takes {small_need} blocks of "
                         f"{SMALL_BLOCK}, and {small.num_blocks} // {small_need} = "
                         f"{small.num_blocks // small_need} fit together (vLLM would log "
                         f"{small.num_blocks / small_need:.2f}x, against {run.num_blocks / need:.2f}x with blocks "
                         f"of {B}): the last block of a {L}-token request is now "
                         f"{'full' if L % SMALL_BLOCK == 0 else 'fuller'}, so the same bytes hold more requests."),
        ),
    }


def exercises(ctx) -> dict[str, Exercise]:
    return {**real_exercises(), **engine_exercises(ctx)}


# ------------------------------------------------------------------------------------------------ reveals
def reveal_p_budget(ctx) -> None:
    import streamlit as st

    from viz import gpu_memory_figure

    plan, gpu = real_plan(), _gpu(GPU)
    parts = {"weights": plan.weight_bytes, "activations + other": plan.activation_bytes + plan.other_bytes,
             "KV cache": plan.kv_bytes, "not used by the server": gpu.memory_bytes - plan.requested_bytes}
    st.plotly_chart(gpu_memory_figure(parts, f"{_preset(MODEL).name} on an {gpu.name}, "
                                             f"gpu_memory_utilization {kv_math.VLLM_GPU_MEMORY_UTILIZATION:g}"),
                    width="stretch", key="l9_reveal_budget", config={"displayModeBar": False})


def _tokenizer_decode(ctx):
    tokenizer = ctx.loaded[1]
    return lambda ids: tokenizer.decode(ids)


def reveal_e_admit(ctx) -> None:
    import streamlit as st

    from viz import block_pool_figure

    run = main_run(ctx)
    snap = run.records[0].snapshot
    st.plotly_chart(block_pool_figure(snap, run.request_ids, decode=_tokenizer_decode(ctx),
                                      title=f"after step 1: {snap.num_used_blocks}/{snap.num_blocks} blocks in use, "
                                            f"waiting: {', '.join(snap.waiting) or 'none'}"),
                    width="stretch", key="l9_reveal_admit", config={"displayModeBar": False})


def reveal_e_victims(ctx) -> None:
    import pandas as pd
    import streamlit as st

    from viz import block_pool_figure

    run = main_run(ctx)
    fp = first_preemption(run)
    rec = run.records[fp["index"]]
    freed = sorted({b for e in rec.events if e.kind == "preempt" for b in e.blocks})
    st.plotly_chart(block_pool_figure(rec.snapshot, run.request_ids, decode=_tokenizer_decode(ctx), highlight=freed,
                                      title=f"after step {fp['step']}: the victims' blocks (framed) now hold the "
                                            "survivors' new tokens"),
                    width="stretch", key="l9_reveal_victims", config={"displayModeBar": False})
    after = {s.request_id: s for s in rec.snapshot.sequences}
    rows = [{"request": r, "blocks before": fp["held"][r],
             "this step": "preempted" if r in fp["victims"] else "took a new block",
             "block table after": str(after[r].block_table) if r in after and r not in fp["victims"] else "-"}
            for r in fp["running"]]
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


# ------------------------------------------------------------------------------------------------ widgets
RUNS = {"prompts of {p}, blocks of {b}": "main", "prompts of {hp}, blocks of {b}": "heavy",
        "prompts of {p}, blocks of {sb}": "small"}


def widget_runs(ctx) -> None:
    import streamlit as st

    from lessons.widgets import step_through

    labels = {k.format(p=PROMPT, hp=HEAVY_PROMPT, b=BLOCK_SIZE, sb=SMALL_BLOCK): v for k, v in RUNS.items()}
    with st.container(border=True):
        label = st.radio("Run", list(labels), horizontal=True, key="keep_l9_run")
        which = labels[label]
        run = {"main": main_run, "heavy": heavy_run, "small": small_block_run}[which](ctx)
        # no text column: the prompts are cut to an exact token count, mid-word, so the replies read as
        # fragments; this table is about blocks
        step_through(run, f"l9_step_{which}", _tokenizer_decode(ctx), jump_kinds=("admit", "preempt", "finish"),
                     show_text=False)


def widget_planner(ctx) -> None:
    import streamlit as st

    from lessons.render import keep
    from viz import gpu_memory_figure

    presets = kv_math.model_presets()
    names = [p.name for p in presets.values()]
    gpu_names = [g.name for g in kv_math.gpus()]
    keep(keep_l9_model=_preset(MODEL).name, keep_l9_gpu=GPU, keep_l9_util=kv_math.VLLM_GPU_MEMORY_UTILIZATION,
         keep_l9_act=PROFILE["PyTorch activation peak memory"], keep_l9_other=PROFILE["non_torch_memory"],
         keep_l9_block=BLOCK_SIZE, keep_l9_len=0)
    with st.container(border=True):
        c1, c2 = st.columns(2)
        choice = c1.selectbox("Model config", names, key="keep_l9_model")
        preset = next(p for p in presets.values() if p.name == choice)
        gpu = _gpu(c2.selectbox("GPU", gpu_names, key="keep_l9_gpu"))
        c3, c4, c5 = st.columns(3)
        util = c3.slider("gpu_memory_utilization", 0.5, 1.0, step=0.05, key="keep_l9_util")
        act = c4.number_input("peak activations (GiB)", 0.0, 200.0, step=0.1, key="keep_l9_act")
        other = c5.number_input("outside PyTorch, CUDA graphs (GiB)", 0.0, 200.0, step=0.1, key="keep_l9_other")
        c6, c7 = st.columns(2)
        block = c6.selectbox("block_size", [8, 16, 32, 64], key="keep_l9_block")
        length = c7.number_input("max_model_len (0: the config's)", 0, 1_048_576, step=1024, key="keep_l9_len")
        plan = kv_math.plan_kv_cache(gpu.memory_bytes, weight_bytes(preset),
                                     kv_math.bytes_per_token(preset.config, preset.dtype),
                                     int(length) or preset.config.max_position_embeddings, int(block), util,
                                     round(act * GIB), round(other * GIB))
        if plan.kv_bytes == 0 or plan.num_blocks < plan.blocks_per_request:
            st.error(f"No room for even one request of {plan.max_model_len:,} tokens: vLLM refuses to start "
                     "(raise gpu_memory_utilization, lower max_model_len, or use a bigger GPU).")
        st.code("\n".join(plan.log_lines()), language="text")
        parts = {"weights": min(plan.weight_bytes, plan.requested_bytes),
                 "activations + other": max(0, min(plan.activation_bytes + plan.other_bytes,
                                                   plan.requested_bytes - plan.weight_bytes)),
                 "KV cache": plan.kv_bytes, "not used by the server": gpu.memory_bytes - plan.requested_bytes}
        st.plotly_chart(gpu_memory_figure(parts, f"{preset.name} on an {gpu.name}"), width="stretch",
                        key="l9_planner_fig", config={"displayModeBar": False})
        st.caption(f"{plan.num_blocks:,} blocks of {plan.block_size} × {plan.bytes_per_token:,} bytes; a request of "
                   f"{plan.max_model_len:,} tokens takes {plan.blocks_per_request:,} of them. GPU memory: the "
                   f"vendor's figure ([source]({gpu.source})) read as 10^9 bytes per GB. A real card reports more: the "
                   f"H100 (80 GB) in the log above has {PROFILE['total_gpu_memory']:g} GiB "
                   f"({PROFILE['total_gpu_memory'] * 2**30 / 1e9:.1f} × 10^9 bytes), so this planner's budget "
                   "is lower than a real start-up's; a real start-up also measures the activations and the rest "
                   "instead of taking them from you.")


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)
