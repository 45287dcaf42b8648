"""Lesson 1: the KV cache and its size. Figures from model configs through ``lessons.kv_math`` (which uses
the engine's ``KVGeometry``); the GPU fit from ``kv_math.gpu_fit``."""

from __future__ import annotations

import math

from lessons import kv_math
from lessons.exercise import Exercise

CONTEXT = 4096  # tokens per request in the GPU-fit question
GPU_QUESTION = "NVIDIA H100 (80 GB)"


def _tiny(ctx):
    from engine.model_loader import geometry_from_config

    model = ctx.loaded[0]
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return geometry_from_config(model.config, dtype)


def facts(ctx) -> dict:
    g = _tiny(ctx)
    return {"tiny_layers": g.num_layers, "tiny_kv_heads": g.num_kv_heads, "tiny_head_dim": g.head_dim,
            "tiny_dtype": g.dtype, "tiny_dtype_bytes": g.dtype_bytes, "tiny_bytes_per_token": g.bytes_per_token}


def _described(preset) -> tuple:
    g = kv_math.geometry(preset.config, preset.dtype)
    return g, (f"{g.num_layers} layers, {g.num_heads} query heads and {g.num_kv_heads} KV heads, head_dim "
               f"{g.head_dim}, stored in {preset.dtype} ({g.dtype_bytes} bytes per number)")


def _rounding_options() -> dict[str, float]:
    """Option -> the ratio (claimed / exact) it stands for."""
    return {"about right": 1.0, "about twice the exact value": 2.0, "about half the exact value": 0.5,
            "about ten times the exact value": 10.0}


def exercises(ctx) -> dict[str, Exercise]:
    presets = kv_math.model_presets()
    llama2, llama3 = presets["llama-2-7b"], presets["llama-3-8b"]
    g2, d2 = _described(llama2)
    g3, d3 = _described(llama3)
    kib2, kib3 = g2.bytes_per_token / 1024, g3.bytes_per_token / 1024
    ratio = 2**20 / g2.bytes_per_token  # "about 1 MB" read as 1 MiB
    options = _rounding_options()
    closest = min(options, key=lambda o: abs(math.log(options[o] / ratio)))
    gpu = next(g for g in kv_math.gpus() if g.name == GPU_QUESTION)
    params = kv_math.parameter_count(llama2)
    fit = kv_math.gpu_fit(gpu.memory_bytes, params * g2.dtype_bytes, g2.bytes_per_token, CONTEXT)
    return {
        "llama2_kib": Exercise(
            "llama2_kib",
            f"**Llama-2-7B** has {d2}. How many **KiB** (1 KiB = 1,024 bytes) does one token's KV cache take?",
            "number", kib2, unit="KiB",
            explanation=(f"2 × {g2.num_layers} × {g2.num_kv_heads} × {g2.head_dim} × {g2.dtype_bytes} = "
                         f"{g2.bytes_per_token:,} bytes = {kib2:g} KiB. One request of {CONTEXT:,} tokens holds "
                         f"{kv_math.human_bytes(CONTEXT * g2.bytes_per_token)} of cache."),
        ),
        "llama3_kib": Exercise(
            "llama3_kib",
            f"**Llama-3-8B** has {d3}. How many **KiB** per token?", "number", kib3, unit="KiB",
            explanation=(f"2 × {g3.num_layers} × {g3.num_kv_heads} × {g3.head_dim} × {g3.dtype_bytes} = "
                         f"{g3.bytes_per_token:,} bytes = {kib3:g} KiB: {g2.num_kv_heads // g3.num_kv_heads}x less "
                         f"than Llama-2-7B, because {g3.num_heads} query heads share {g3.num_kv_heads} KV heads. "
                         "The query heads are not stored, only keys and values are."),
        ),
        "rounding": Exercise(
            "rounding",
            "Some popular write-ups say a 7B model like Llama-2-7B needs \"about 1 MB of KV cache per token\". "
            "Reading 1 MB as 1 MiB (1,048,576 bytes), compared with the exact figure it is...", "choice", closest,
            options=list(options),
            explanation=(f"1 MiB = 1,048,576 bytes is {ratio:g} times the exact {g2.bytes_per_token:,} bytes. Rounding up like this "
                         "halves the number of requests you would think fit; always compute from the config."),
        ),
        "h100_fit": Exercise(
            "h100_fit",
            f"An **{gpu.name}** serves Llama-2-7B in {llama2.dtype}. The server may use "
            f"{kv_math.VLLM_GPU_MEMORY_UTILIZATION:.0%} of the memory (vLLM's default), the weights take "
            f"{params:,} parameters × {g2.dtype_bytes} bytes, and the rest holds KV cache. How many requests of "
            f"**{CONTEXT:,} tokens** fit at once? (Within 10% counts.)",
            "number", fit.requests, rel_tolerance=0.10, unit="requests",
            explanation=(f"{gpu.memory_gb:g} GB × {kv_math.VLLM_GPU_MEMORY_UTILIZATION:g} = {fit.usable_bytes / 1e9:,.1f} "
                         f"GB usable; weights {fit.weight_bytes / 1e9:,.1f} GB; KV cache {fit.kv_bytes / 1e9:,.1f} GB "
                         f"= {fit.tokens:,} tokens of {g2.bytes_per_token:,} bytes; ÷ {CONTEXT:,} = "
                         f"**{fit.requests} requests**. That is all, on an 80 GB GPU: the cache, not the weights, "
                         "limits the batch. Real servers fit a little fewer (activations, CUDA context)."),
        ),
    }


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
