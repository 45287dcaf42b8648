"""GPU benchmark of the Triton paged-attention kernels and of the engine; writes a Markdown report.

    python bench/kernels.py [--out docs/benchmarks.md] [--json results.json] [--quick]

It replaces the "gpu-kernels" section of the report (bench/report.py), leaving other sections alone.

Measures (CUDA only; times are medians of ``triton.testing.do_bench``, in microseconds):
1. Decode attention, fp16, block size 16, a Llama-3-8B-like layer (32 query heads, 8 KV heads,
   head_dim 128), batch 1..256 x context 128..32k: time, achieved bandwidth (bytes of K and V read / time)
   as a share of the card's peak (H200: 4.8 TB/s, the vendor's datasheet figure), and the overhead against
   contiguous attention on the same data (torch SDPA over a contiguous ``[batch, kv_heads, context,
   head_dim]`` cache with ``enable_gqa``; FlashAttention's ``flash_attn_with_kvcache`` if installed).
2. A block-size sweep (1..128) at one shape.
3. The engine end to end on the embedded model: tokens/s at batch 1, 16, 64.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

# This file is bench/kernels.py: make `import kernels` find the project's package, not this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, vendors' datasheets
HQ, HK, D = 32, 8, 128


def peak_bandwidth(name: str) -> float | None:
    for key, bw in PEAK_BW.items():
        if key in name:
            return bw
    return None


def make_paged(batch: int, ctx: int, block_size: int, dtype=torch.float16, seed=0):
    """A shuffled paged cache holding ``batch`` sequences of ``ctx`` tokens, plus a contiguous copy."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb_seq = -(-ctx // block_size)
    num_blocks = batch * nb_seq
    kc = torch.randn(num_blocks, block_size, HK, D, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, block_size, HK, D, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = perm.view(batch, nb_seq).to(torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=dtype, generator=g)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    return q, kc, vc, tables, lens, qsl


def contiguous_copy(cache, tables, ctx):
    """[batch, kv_heads, ctx, head_dim] contiguous K or V gathered through the block table."""
    batch = tables.shape[0]
    return cache[tables.long()].reshape(batch, -1, HK, D)[:, :ctx].transpose(1, 2).contiguous()


def graph_time_us(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: GPU time without Python launch overhead."""
    import triton

    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up outside the capture (compilation, allocator)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
    except Exception as exc:  # report, do not lose the rest of the run
        print(f"graph capture failed: {exc!r}"[:300], flush=True)
        return float("nan")


def bench_decode(batch, ctx, block_size, with_baseline=True, graphs=False, **launch):
    import triton

    from kernels import triton_paged

    q, kc, vc, tables, lens, qsl = make_paged(batch, ctx, block_size)
    scale = D ** -0.5
    fn = lambda: triton_paged.paged_attention(q, kc, vc, tables, lens, qsl, scale,  # noqa: E731
                                              max_query_len=1, max_context_len=ctx, **launch)
    out = fn()
    row = {"batch": batch, "context": ctx, "block_size": block_size, **launch}
    row["paged_us"] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    kv_bytes = 2 * batch * ctx * HK * D * q.element_size()
    row["kv_bytes"] = kv_bytes
    row["paged_TBps"] = kv_bytes / (row["paged_us"] * 1e-6) / 1e12
    if graphs:
        row["paged_graph_us"] = graph_time_us(fn)
        row["paged_graph_TBps"] = kv_bytes / (row["paged_graph_us"] * 1e-6) / 1e12
    if with_baseline:
        k = contiguous_copy(kc, tables, ctx)
        v = contiguous_copy(vc, tables, ctx)
        q4 = q[:, :, None, :]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale,  # noqa: E731
                                                                        enable_gqa=True)
        ref = sdpa()[:, :, 0]
        row["max_abs_err_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
        row["sdpa_us"] = triton.testing.do_bench(sdpa, warmup=25, rep=100, return_mode="median") * 1e3
        row["overhead_vs_sdpa_pct"] = 100 * (row["paged_us"] / row["sdpa_us"] - 1)
        if graphs:
            row["sdpa_graph_us"] = graph_time_us(sdpa)
            row["graph_overhead_vs_sdpa_pct"] = 100 * (row["paged_graph_us"] / row["sdpa_graph_us"] - 1)
        try:
            from flash_attn import flash_attn_with_kvcache

            kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
            fa = lambda: flash_attn_with_kvcache(q[:, None], kf, vf, cache_seqlens=lens, softmax_scale=scale)  # noqa: E731
            row["flash_us"] = triton.testing.do_bench(fa, warmup=25, rep=100, return_mode="median") * 1e3
        except ImportError:
            pass
        del k, v
    del q, kc, vc, tables
    torch.cuda.empty_cache()
    return row


def bench_engine(batches, max_tokens=128):
    from engine import LLMEngine, SamplingParams
    from engine.scenarios.run_spec import RunSpec
    rows = []
    for backend in ("triton", "torch"):
        for batch in batches:
            eng = LLMEngine(RunSpec(device="cuda", block_size=16, num_blocks=batch * 16 + 64, max_model_len=256,
                                    attention_backend=backend).engine_config("paged"))
            prompts = [f"ROMEO. My lord {i}, " for i in range(batch)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up / compile
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = eng.generate(prompts, params)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tokens = sum(len(o.output_token_ids) for o in outs)
            rows.append({"backend": backend, "batch": batch, "tokens": tokens, "seconds": dt,
                         "tokens_per_s": tokens / dt, "dtype": eng.dtype})
    return rows


def environment() -> dict:
    import transformers
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "sms": torch.cuda.get_device_properties(0).multi_processor_count}


def markdown(env, decode, sweep, splits, engine_rows, command) -> str:
    peak = peak_bandwidth(env["gpu"])
    lines = [
        f"## GPU: {env['gpu']}",
        "",
        f"Driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']}. Command: `{command}`. Times are medians of "
        "`triton.testing.do_bench` (25 warm-up, 100 ms of repeats), microseconds.",
        "",
        f"### Decode attention (fp16, block size 16, {HQ} query heads / {HK} KV heads, head_dim {D}, shuffled blocks)",
        "",
        "Bandwidth = bytes of K and V read / time"
        + (f"; peak {peak / 1e12:.1f} TB/s (vendor datasheet)." if peak else "."),
        "Baseline: `torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)` on a contiguous copy of the same K/V.",
        "",
        "*Eager* times one Python call (kernel launch overhead included, as the engine runs it); *graph* "
        "replays the same call from a CUDA graph (GPU time only). Bandwidth and % of peak use the graph time.",
        "",
        "| batch | context | paged eager (us) | SDPA eager (us) | paged graph (us) | SDPA graph (us) | paged vs SDPA (graph) | TB/s | % of peak | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in decode:
        pct = f"{100 * r['paged_graph_TBps'] * 1e12 / peak:.0f}%" if peak else "n/a"
        lines.append(
            f"| {r['batch']} | {r['context']:,} | {r['paged_us']:.1f} | {r['sdpa_us']:.1f} | "
            f"{r['paged_graph_us']:.1f} | {r['sdpa_graph_us']:.1f} | {r['graph_overhead_vs_sdpa_pct']:+.0f}% | "
            f"{r['paged_graph_TBps']:.2f} | {pct} | {r['max_abs_err_vs_sdpa']:.1e} |"
        )
    if any("flash_us" in r for r in decode):
        lines += ["", "FlashAttention `flash_attn_with_kvcache` (us): "
                  + ", ".join(f"b{r['batch']}/c{r['context']}: {r['flash_us']:.1f}" for r in decode if "flash_us" in r)]
    else:
        lines += ["", "FlashAttention (`flash_attn`) is not installed on the machine, so it is not compared."]
    s = sweep[0]
    lines += [
        "",
        f"### Block-size sweep (batch {s['batch']}, context {s['context']:,}, fp16)",
        "",
        "| block size | paged (us) | TB/s |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {r['block_size']} | {r['paged_us']:.1f} | {r['paged_TBps']:.2f} |" for r in sweep]
    lines += ["", "### Split-KV factor (decode, block size 16; the default heuristic picks the factor otherwise)", "",
              "| batch | context | splits | eager (us) | graph (us) | TB/s (graph) |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context']:,} | {r['num_splits']} | {r['paged_us']:.1f} | "
              f"{r['paged_graph_us']:.1f} | {r['paged_graph_TBps']:.2f} |" for r in splits]
    lines += [
        "",
        "### Engine end to end (embedded tiny model, greedy, 128 new tokens per request, prompts of ~8 tokens)",
        "",
        "| attention backend | dtype | batch | generated tokens | seconds | tokens/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['backend']} | {r['dtype']} | {r['batch']} | {r['tokens']} | {r['seconds']:.2f} | "
              f"{r['tokens_per_s']:.0f} |" for r in engine_rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"),
                   help="Markdown report whose gpu-kernels section is written")
    p.add_argument("--json", type=Path, help="raw results as JSON")
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU", file=sys.stderr)
        return 2
    env = environment()
    batches = [1, 16, 64] if args.quick else [1, 16, 64, 256]
    contexts = [1024, 8192] if args.quick else [128, 1024, 4096, 16384, 32768]
    # Bring the clocks up before anything is timed (the card idles at a low clock).
    bench_decode(64, 16384, 16, with_baseline=False)
    decode = []
    for b in batches:
        for c in contexts:
            if b * c > (1 << 22):  # keep each case under ~16 GiB of K/V
                continue
            decode.append(bench_decode(b, c, 16, graphs=True))
            print(json.dumps(decode[-1]), flush=True)
    splits = []
    for b, c in ((1, 1024), (1, 8192), (16, 1024), (16, 8192)):
        for n in (1, 2, 4, 8, 16, 32):
            splits.append(bench_decode(b, c, 16, with_baseline=False, graphs=True, num_splits=n))
            print(json.dumps(splits[-1]), flush=True)
    sweep = []
    for bs in (1, 2, 4, 8, 16, 32, 64, 128):
        sweep.append(bench_decode(64, 4096, bs, with_baseline=False))
        print(json.dumps(sweep[-1]), flush=True)
    engine_rows = bench_engine([1, 16, 64])
    for r in engine_rows:
        print(json.dumps(r), flush=True)
    command = "python bench/kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
    from bench.report import write_section

    write_section(args.out, "gpu-kernels", markdown(env, decode, sweep, splits, engine_rows, command))
    if args.json:
        args.json.write_text(json.dumps({"env": env, "decode": decode, "sweep": sweep,
                                         "splits": splits,
                                         "engine": engine_rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
