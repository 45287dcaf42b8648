"""Lesson 1: the KV cache and its size.

Figures come from model configs through ``lessons.kv_math`` (the engine's ``KVGeometry``), from a run of the
embedded model on the engine (what one step stores: the tokens the engine computed), from ``kv_math.gpu_fit``
(how many requests fit on a GPU) and from the engine's ``ContiguousAllocator`` admitting requests whose whole
cache must fit (the learner acts as the scheduler). Every wrong answer the usual slips give is computed from
the same figures (``Slip``).
"""

from __future__ import annotations

import math

from engine.contiguous import ContiguousAllocator
from lessons import kv_math
from lessons.exercise import Exercise, Slip

CONTEXT = 4096  # tokens per request in the GPU-fit question
GPU_QUESTION = "NVIDIA H100 (80 GB)"
CONFIG_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "torch_dtype")
# The scheduler question: a model, the memory left for KV (bytes) and the requests' final lengths (tokens),
# in arrival order. Inputs of the question, not answers: the engine's allocator decides who runs.
ADMIT = {"model": "llama-3-8b", "budget_bytes": 2**30, "lengths": [2000, 3000, 2500, 1500, 600]}

RECAP = [
    "Each token keeps one key and one value vector per layer and per **KV head**: "
    "2 × layers × KV heads × head_dim × bytes per number, {{ tiny_bytes_per_token }} bytes for the embedded "
    "model and {{ llama2_kib }} KiB for Llama-2-7B.",
    "Only keys and values are stored, never queries, so grouped-query attention cuts the cache by the ratio of "
    "query heads to KV heads: Llama-3-8B needs {{ llama3_kib }} KiB per token.",
    "A step stores the keys and values of the tokens it feeds in; the token it picks gets its own only at the "
    "next step, so a finished request never stores its last token.",
    "Decode steps are memory-bandwidth bound, so throughput grows with the batch, and the batch is set by how "
    "many caches fit beside the weights: {{ h100_requests }} requests of {{ context }} tokens of Llama-2-7B "
    "on an H100 sold as {{ h100_memory }} (the {{ h100_reported_gib }} GiB the card reports would hold "
    "{{ h100_reported_requests }}).",
]


def _tiny(ctx):
    from engine.model_loader import geometry_from_config

    model = ctx.loaded[0]
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return geometry_from_config(model.config, dtype)


# --------------------------------------------------------------------------------------------- runs
def _run(ctx):
    """The embedded model on a 40-token prompt writing 12 tokens (the life-of-a-request scenario). Lesson 3
    steps through the same run with the same function, so the app computes it once for both."""
    from lessons.l3_block_tables import life_run

    return ctx.run(life_run)


def ordinal(n: int) -> str:
    """1 -> "1st", 2 -> "2nd", 12 -> "12th"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def stored_tokens(run) -> list[tuple[int, str, int, int]]:
    """Per step of a one-request run: (step, kind, tokens whose K/V the step computed and stored, tokens
    stored so far), from the records' scheduled sequences."""
    rows, total = [], 0
    for rec in run.records:
        n = sum(s.num_tokens for s in rec.scheduled)
        total += n
        rows.append((rec.step, rec.kind, n, total))
    return rows


def admission(lengths: list[int], budget_tokens: int, overtake: bool = False) -> tuple[list[int], list[str]]:
    """Admit requests (final lengths, in arrival order) while the engine's ``ContiguousAllocator`` can hold
    each one's whole cache in ``budget_tokens`` slots; first come, first served stops at the first that
    does not fit (``overtake``: a later, smaller one may still go in, the slip). Returns (the admitted
    request numbers, 1-based; one sentence per request: the allocator's decision)."""
    region = ContiguousAllocator(budget_tokens, max(1, min(max(lengths), budget_tokens)))
    admitted, lines = [], []
    stopped = False
    for i, L in enumerate(lengths, start=1):
        if stopped:
            lines.append(f"R{i}: waits behind the request at the head of the queue")
            continue
        if L > budget_tokens:
            why = f"refused: {L:,} tokens are more than the {budget_tokens:,} that fit"
        else:
            why = region.admission_refusal([[0]], L)
            if why is not None:  # the allocator's own words ("largest gap") are lesson 2's; say it in lesson 1's
                why = (f"refused: it needs {L:,} token slots and only {budget_tokens - region.reserved_slots:,} of "
                       f"the {budget_tokens:,} are free")
        if why is None:
            region.allocate(f"R{i}", L, reservation=L)
            admitted.append(i)
            lines.append(f"R{i}: admitted, {region.reserved_slots:,} of {budget_tokens:,} token slots now held")
        else:
            lines.append(f"R{i}: {why}")
            stopped = not overtake
    return admitted, lines


# -------------------------------------------------------------------------------------------- lesson
def _config_text(preset) -> str:
    d = dict(preset.config_fields)
    return ", ".join(f"`{k}: {d[k]}`" for k in CONFIG_FIELDS if k in d)


def _bytes(g, kv_heads: int | None = None, factor: int = 2, head_dim: int | None = None, dtype_bytes: int | None = None,
           layers: int | None = None) -> int:
    """Bytes per token from the geometry ``g``, with one of its terms replaced (the slips)."""
    return (factor * (g.num_layers if layers is None else layers) * (g.num_kv_heads if kv_heads is None else kv_heads)
            * (g.head_dim if head_dim is None else head_dim) * (g.dtype_bytes if dtype_bytes is None else dtype_bytes))


def _rounding_options() -> dict[str, float]:
    """Option -> the ratio (claimed / exact) it stands for."""
    return {"about right": 1.0, "about twice the exact value": 2.0, "about half the exact value": 0.5,
            "about ten times the exact value": 10.0}


def _models():
    presets = kv_math.model_presets()
    llama2, llama3 = presets["llama-2-7b"], presets["llama-3-8b"]
    return llama2, kv_math.geometry(llama2.config, llama2.dtype), llama3, kv_math.geometry(llama3.config, llama3.dtype)


def _h100():
    llama2, g2, _, _ = _models()
    gpu = next(g for g in kv_math.gpus() if g.name == GPU_QUESTION)
    params = kv_math.parameter_count(llama2)
    return gpu, params, kv_math.gpu_fit(gpu.memory_bytes, params * g2.dtype_bytes, g2.bytes_per_token, CONTEXT)


def memory_convention(gpu: kv_math.Gpu) -> str:
    """How the lesson reads a GPU's memory, said wherever a fit is: the vendor's GB, 10^9 bytes each
    (``kv_math.GB``, which ``Gpu.memory_bytes`` uses), e.g. "80 GB = 80 × 10^9 bytes"."""
    if gpu.memory_bytes != int(gpu.memory_gb * 10**9):
        raise ValueError(f"{gpu.name}: memory_bytes {gpu.memory_bytes:,} is not {gpu.memory_gb:g} × 10^9 bytes")
    return f"{gpu.memory_gb:g} GB = {gpu.memory_gb:g} × 10^9 bytes"


def _h100_reported():
    """What the same H100 reports (the total memory in the start-up log lesson 9 quotes, vLLM PR #10511),
    in GiB, and how many requests that would hold."""
    from lessons.l9_planning_memory import PROFILE

    _, g2, _, _ = _models()
    _, params, _ = _h100()
    gib = PROFILE["total_gpu_memory"]
    return gib, kv_math.gpu_fit(round(gib * 2**30), params * g2.dtype_bytes, g2.bytes_per_token, CONTEXT).requests


def facts(ctx) -> dict:
    g = _tiny(ctx)
    run = _run(ctx)
    llama2, g2, _, g3 = _models()
    gpu, _, fit = _h100()
    reported_gib, reported = _h100_reported()
    return {"tiny_layers": g.num_layers, "tiny_kv_heads": g.num_kv_heads, "tiny_head_dim": g.head_dim,
            "tiny_dtype": g.dtype, "tiny_dtype_bytes": g.dtype_bytes, "tiny_bytes_per_token": g.bytes_per_token,
            "run_prompt": run.records[0].scheduled[0].num_tokens,
            "run_new": len(run.outputs[run.request_ids[0]].output_token_ids),
            "llama2_kib": f"{g2.bytes_per_token / 1024:g}", "llama3_kib": f"{g3.bytes_per_token / 1024:g}",
            "h100_requests": fit.requests, "context": f"{CONTEXT:,}", "h100_memory": memory_convention(gpu),
            "h100_reported_gib": f"{reported_gib:g}", "h100_reported_requests": reported,
            "dtype_sizes": _dtype_sizes(llama2.config)}


def _dtype_sizes(config) -> str:
    """"float16 and bfloat16 take 2 bytes, float32 takes 4", from the engine's element sizes."""
    by_size: dict[int, list[str]] = {}
    for d in kv_math.KV_DTYPES:
        by_size.setdefault(kv_math.geometry(config, d).dtype_bytes, []).append(d)
    parts = [f"{' and '.join(names)} {'take' if len(names) > 1 else 'takes'} {size}"
             for size, names in sorted(by_size.items())]
    return ", ".join([parts[0] + " bytes"] + parts[1:])


def exercises(ctx) -> dict[str, Exercise]:
    llama2, g2, llama3, g3 = _models()
    kib2, kib3 = g2.bytes_per_token / 1024, g3.bytes_per_token / 1024
    hidden3 = dict(llama3.config_fields)["hidden_size"]

    # rounding: "about 1 MB per token" read as 1 MiB, against Llama-2-7B's exact figure
    ratio = 2**20 / g2.bytes_per_token
    options = _rounding_options()
    closest = min(options, key=lambda o: abs(math.log(options[o] / ratio)))
    rounding_msgs = {
        "about right": (f"1 MiB would be right only if each number took {g2.dtype_bytes * 2} bytes or the model had "
                        f"{g2.num_layers * 2} layers; in {llama2.dtype} it is {kib2:g} KiB."),
        "about half the exact value": ("The other way round: the claim is *larger* than what the config gives, "
                                       f"{kib2:g} KiB."),
        "about ten times the exact value": f"Not that far off: 1 MiB is {ratio:g} times the exact {kib2:g} KiB.",
        "about twice the exact value": f"1 MiB is {ratio:g} times the exact {kib2:g} KiB.",
    }

    # one step stores the tokens it feeds in: the run's records
    g = _tiny(ctx)
    run = _run(ctx)
    prompt = run.records[0].scheduled[0].num_tokens
    new = len(run.outputs[run.request_ids[0]].output_token_ids)
    steps = stored_tokens(run)
    stored = steps[-1][3]
    held = stored * g.bytes_per_token

    # the GPU fit, and its slips (each term left out in turn)
    gpu, params, fit = _h100()
    weights = params * g2.dtype_bytes
    no_util = kv_math.gpu_fit(gpu.memory_bytes, weights, g2.bytes_per_token, CONTEXT, 1.0).requests
    no_weights = kv_math.gpu_fit(gpu.memory_bytes, 0, g2.bytes_per_token, CONTEXT).requests
    one_mib = kv_math.gpu_fit(gpu.memory_bytes, weights, 2**20, CONTEXT).requests
    gib = kv_math.gpu_fit(int(gpu.memory_gb * 2**30), weights, g2.bytes_per_token, CONTEXT).requests
    # What the card reports. The question names the vendor's GB (10^9 bytes); reading it as GiB is a slip of
    # its own, named first.
    reported_gib, reported = _h100_reported()

    # the scheduler: who runs in the first batch
    admit_model = kv_math.model_presets()[ADMIT["model"]]
    ga = kv_math.geometry(admit_model.config, admit_model.dtype)
    budget = ADMIT["budget_bytes"]
    admitted, _ = admission(ADMIT["lengths"], budget // ga.bytes_per_token)
    overtaken, _ = admission(ADMIT["lengths"], budget // ga.bytes_per_token, overtake=True)
    no_gqa, _ = admission(ADMIT["lengths"], budget // _bytes(ga, kv_heads=ga.num_heads))
    lengths = ", ".join(f"R{i} {L:,}" for i, L in enumerate(ADMIT["lengths"], start=1))

    return {
        "llama3_kib": Exercise(
            "llama3_kib",
            f"These are the fields that matter in **{llama3.name}**'s `config.json` (it has no `head_dim` field): "
            f"{_config_text(llama3)}. How many **KiB** (1 KiB = 1,024 bytes) does one token's KV cache take?",
            "number", kib3, unit="KiB",
            explanation=(f"head_dim = {hidden3:,} / {g3.num_heads} = {g3.head_dim}; 2 × {g3.num_layers} layers × "
                         f"{g3.num_kv_heads} KV heads × {g3.head_dim} × {g3.dtype_bytes} bytes = "
                         f"{g3.bytes_per_token:,} bytes = {kib3:g} KiB. The {g3.num_heads} query heads share "
                         f"{g3.num_kv_heads} KV heads, and only keys and values are kept."),
            slips=[
                Slip("query-heads", _bytes(g3, kv_heads=g3.num_heads) / 1024,
                     f"You counted the **query** heads ({g3.num_heads}). Queries are used once and never stored; "
                     f"only the {g3.num_kv_heads} KV heads keep a key and a value per token."),
                Slip("no-k-and-v", _bytes(g3, factor=1) / 1024,
                     "You stored one vector per head; there are two, a **key and a value**."),
                Slip("hidden-size", _bytes(g3, head_dim=hidden3) / 1024,
                     f"You used `hidden_size` ({hidden3:,}) as the length of one head's vector; each head gets "
                     f"`hidden_size / num_attention_heads` = {g3.head_dim} numbers."),
                Slip("four-bytes", _bytes(g3, dtype_bytes=4) / 1024,
                     f"You took 4 bytes per number; {llama3.dtype} takes {g3.dtype_bytes}."),
            ],
        ),
        "rounding": Exercise(
            "rounding",
            f"**{llama2.name}**'s config has {_config_text(llama2)}. Some popular write-ups say a 7B model like this "
            "one needs \"about 1 MB of KV cache per token\". Reading 1 MB as 1 MiB (1,048,576 bytes), compared "
            "with the exact figure from the config, the claim is...", "choice", closest, options=list(options),
            explanation=(f"2 × {g2.num_layers} × {g2.num_kv_heads} × {g2.head_dim} × {g2.dtype_bytes} = "
                         f"{g2.bytes_per_token:,} bytes = {kib2:g} KiB; 1 MiB is {ratio:g} times that. Rounding up "
                         "like this halves the number of requests you would think fit: always compute from the "
                         f"config. ({g2.num_kv_heads} KV heads, one per query head: {kib2 / kib3:g}x "
                         f"{llama3.name}'s {kib3:g} KiB.)"),
            slips=[Slip(f"option-{i}", o, rounding_msgs[o]) for i, o in enumerate(options) if o != closest],
            answer_phrases=[closest, f"1 MiB is {ratio:g} times the exact", f"1 MiB is {ratio:g} times that"],
        ),
        "run_bytes": Exercise(
            "run_bytes",
            f"The engine has just picked the {ordinal(new)} and last new token of that request. How many **bytes** of KV "
            "cache does the request store at that moment (before it hands its memory back)?", "number", held,
            unit="bytes",
            explanation=(f"Prefill stored the {prompt} prompt tokens and picked the first new token; each of the "
                         f"next {len(steps) - 1} steps stored the token picked before it and picked one more. "
                         f"So {stored} tokens are stored × {g.bytes_per_token:,} bytes = {held:,} bytes; the "
                         f"{ordinal(new)} new token was never fed back in, so it has no key or value."),
            tags={"transfer"},
            slips=[
                Slip("last-token", (prompt + new) * g.bytes_per_token,
                     f"You counted all {prompt + new} tokens. The last token picked has no key or value yet: "
                     "they would be computed when it is fed back in, and the request stopped first."),
                Slip("prompt-only", prompt * g.bytes_per_token,
                     "That is the prompt alone; every decode step also stored the token it fed in."),
                Slip("one-layer", held // g.num_layers,
                     f"That is one layer's share; all {g.num_layers} layers keep their own keys and values."),
            ],
        ),
        "h100_fit": Exercise(
            "h100_fit",
            f"An **{gpu.name}** serves {llama2.name} in {llama2.dtype}. Take its memory as the vendor states "
            f"it, {memory_convention(gpu)} (not GiB). The server may use "
            f"{kv_math.VLLM_GPU_MEMORY_UTILIZATION:.0%} of the memory (vLLM's default), the weights take "
            f"{params:,} parameters × {g2.dtype_bytes} bytes, and the rest holds KV cache. How many requests of "
            f"**{CONTEXT:,} tokens** fit at once? (Within 5% counts.)",
            "number", fit.requests, rel_tolerance=0.05, unit="requests",
            explanation=(f"{gpu.memory_gb:g} GB × {kv_math.VLLM_GPU_MEMORY_UTILIZATION:g} = {fit.usable_bytes / 1e9:,.1f} "
                         f"GB usable; weights {fit.weight_bytes / 1e9:,.1f} GB; KV cache {fit.kv_bytes / 1e9:,.1f} GB "
                         f"= {fit.tokens:,} tokens of {g2.bytes_per_token:,} bytes; ÷ {CONTEXT:,} = "
                         f"**{fit.requests} requests**. That is all, on a GPU sold as {memory_convention(gpu)}: the "
                         "cache, not the weights, limits the batch. Real servers fit a little fewer (activations, "
                         f"CUDA context). The card itself reports {reported_gib:g} GiB, which would hold "
                         f"{reported}."),
            tags={"transfer"},
            slips=[
                Slip("gib", gib,
                     f"You read {gpu.memory_gb:g} GB as {gpu.memory_gb:g} **GiB** ({gpu.memory_gb:g} × 2^30 bytes, "
                     f"{2**30 / 10**9 - 1:.0%} more). The question takes the vendor's GB, 10^9 bytes. (The card itself reports "
                     f"{reported_gib:g} GiB, as lesson 9's log shows, which would give {reported}.)"),
                Slip("all-memory", no_util,
                     f"You gave the cache all {gpu.memory_gb:g} GB; the server may use only "
                     f"{kv_math.VLLM_GPU_MEMORY_UTILIZATION:.0%} of it."),
                Slip("no-weights", no_weights, "You left out the weights: they sit in the same memory, "
                     f"{fit.weight_bytes / 1e9:,.1f} GB of it."),
                Slip("one-mib", one_mib, "You took 1 MiB per token, the rounded figure; the config gives "
                     f"{kib2:g} KiB."),
            ],
        ),
        "admit_batch": Exercise(
            "admit_batch",
            f"**Be the scheduler.** A server runs {admit_model.name} and has "
            f"{kv_math.human_bytes(budget)} left for KV cache. Suppose it knows each request's final length "
            f"(prompt + reply) and admits a request only if that whole cache fits in what is still free. Five "
            f"requests arrive, in this order: {lengths} tokens. First come, first served: the requests are "
            "admitted in arrival order, and once one does not fit, the ones behind it wait too. Which requests run "
            "in the first batch? (Their numbers, e.g. 1, 4.)", "set", admitted,
            explanation=(f"{kv_math.human_bytes(budget)} ÷ {kv_math.human_bytes(ga.bytes_per_token)} per token "
                         f"= {budget // ga.bytes_per_token:,} tokens of cache. The engine's allocator, request by "
                         "request:"),
            tags={"allocator", "transfer"},
            slips=[
                Slip("overtake", overtaken,
                     "You let a later, smaller request overtake the one that did not fit. First come, first "
                     "served keeps the order: the head of the queue waits, and everyone behind it waits too."),
                Slip("query-heads", no_gqa,
                     f"You sized the tokens with {ga.num_heads} heads; {admit_model.name} keeps keys and values for "
                     f"only {ga.num_kv_heads} KV heads, {kv_math.human_bytes(ga.bytes_per_token)} per token."),
            ],
        ),
    }


# ------------------------------------------------------------------------------------------- reveals
def run_bytes_rows(ctx) -> list[dict]:
    """The run-bytes reveal's table: one row per engine step; the bytes written as the text writes them
    (104,448, not 104448)."""
    g = _tiny(ctx)
    return [{"step": s, "kind": k, "tokens fed in (K/V stored)": n, "tokens stored so far": t,
             "bytes of KV": f"{t * g.bytes_per_token:,}"} for s, k, n, t in stored_tokens(_run(ctx))]


def reveal_run_bytes(ctx) -> None:
    import pandas as pd
    import streamlit as st

    rows = run_bytes_rows(ctx)
    # every row shown, none behind a scroll bar (Streamlit draws a row in 35 px, plus the header)
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch", height=35 * (len(rows) + 1) + 3)
    st.caption("From the engine's step records: the tokens each step computed, one row per step.")


def reveal_admit_batch(ctx) -> None:
    import streamlit as st

    model = kv_math.model_presets()[ADMIT["model"]]
    g = kv_math.geometry(model.config, model.dtype)
    _, lines = admission(ADMIT["lengths"], ADMIT["budget_bytes"] // g.bytes_per_token)
    st.markdown("\n".join(f"- {line}" for line in lines))


# ----------------------------------------------------------------------------------------------- widget
LOADED = "the embedded model (loaded)"


def widget_calculator(ctx) -> None:
    import streamlit as st

    from lessons.render import keep

    from viz import gpu_memory_figure

    presets = kv_math.model_presets()
    names = [LOADED] + [p.name for p in presets.values()]
    with st.container(border=True):
        c1, c2 = st.columns([2, 1])
        keep(keep_l1_model=names[1], keep_l1_batch=32, keep_l1_ctx=4096, keep_l1_gpu=kv_math.gpus()[0].name,
             keep_l1_util=kv_math.VLLM_GPU_MEMORY_UTILIZATION)
        choice = c1.selectbox("Model config", names, key="keep_l1_model")
        if choice == LOADED:
            model = ctx.loaded[0]
            config, default_dtype = model.config, str(next(model.parameters()).dtype).replace("torch.", "")
            params, source, note = sum(p.numel() for p in model.parameters()), "`assets/tiny_model/config.json`", ""
        else:
            preset = next(p for p in presets.values() if p.name == choice)
            config, default_dtype = preset.config, preset.dtype
            params = kv_math.parameter_count(preset)
            source, note = f"[{preset.source}]({preset.source})", preset.note
        dtypes = list(kv_math.KV_DTYPES)
        keep(**{f"keep_l1_dtype_{choice}": default_dtype})
        dtype = c2.selectbox("KV cache stored as", dtypes, key=f"keep_l1_dtype_{choice}",
                             help="The weights stay in the model's own type; only the cache changes")
        g = kv_math.geometry(config, dtype)
        weight_bytes = params * kv_math.geometry(config, default_dtype).dtype_bytes
        st.caption(f"Config: {source} · {params:,} parameters (counted from the config), weights in {default_dtype} "
                   f"· {note}")
        st.latex(rf"2 \times {g.num_layers} \times {g.num_kv_heads} \times {g.head_dim} \times {g.dtype_bytes}"
                 rf" = {g.bytes_per_token:,}\ \text{{bytes per token}} = \text{{{kv_math.human_bytes(g.bytes_per_token)}}}"
                 .replace(",", "{,}"))
        c3, c4 = st.columns(2)
        batch = c3.number_input("Requests in the batch", 1, 4096, key="keep_l1_batch")
        context = c4.number_input("Tokens per request (prompt + reply)", 1, 1_048_576, step=256, key="keep_l1_ctx")
        total = int(batch) * int(context) * g.bytes_per_token
        st.markdown(f"{batch:,} requests × {context:,} tokens × {g.bytes_per_token:,} bytes = "
                    f"**{kv_math.human_bytes(total)}** of KV cache ({total / 1e9:,.1f} GB).")
        gpu_names = [x.name for x in kv_math.gpus()]
        c5, c6 = st.columns(2)
        gpu = kv_math.gpus()[gpu_names.index(c5.selectbox("GPU", gpu_names, key="keep_l1_gpu"))]
        util = c6.slider("Share of GPU memory the server may use", 0.5, 1.0, step=0.05, key="keep_l1_util", help="vLLM's gpu_memory_utilization; its default is 0.9")
        fit = kv_math.gpu_fit(gpu.memory_bytes, weight_bytes, g.bytes_per_token, int(context), util)
        if not fit.weights_fit:
            st.error(f"The weights alone ({fit.weight_bytes / 1e9:,.1f} GB) do not fit in "
                     f"{fit.usable_bytes / 1e9:,.1f} GB: this model needs a bigger GPU, several GPUs, or smaller "
                     "numbers (quantisation).")
        parts = {"weights": fit.weight_bytes, "KV cache": fit.kv_bytes,
                 "not used by the server": gpu.memory_bytes - fit.usable_bytes}
        st.plotly_chart(gpu_memory_figure(parts, f"{gpu.name} at {util:.0%}"), width="stretch", key="l1_gpu_fig",
                        config={"displayModeBar": False})
        m = st.columns(3)
        m[0].metric("KV cache room", f"{fit.kv_bytes / 1e9:,.1f} GB")
        m[1].metric("tokens that fit", f"{fit.tokens:,}")
        m[2].metric(f"requests of {int(context):,} token{'s' * (int(context) != 1)}", f"{fit.requests:,}")
        st.caption(f"GPU memory: the vendor's figure ([source]({gpu.source})), 1 GB = 10^9 bytes. "
                   "Activations and the CUDA context are ignored here, so a real server fits a little fewer.")


if __name__ == "__main__":
    from lessons.render import render_lesson

    render_lesson(__file__)
