"""Triton paged-attention kernels against the PyTorch reference.

On the CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set by ``kernels`` on import when
there is no CUDA), in float32, atol 1e-5. Tests marked ``gpu`` run the same cases on CUDA in fp16/bf16
(atol 2e-2) and the whole engine on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
from kernels import torch_ref

triton_paged = pytest.importorskip("kernels.triton_paged")


def make_case(block_size, group, head_dim, ctx_lens, q_lens, dtype=torch.float32, device="cpu",
              num_kv_heads=2, seed=0):
    """Random K/V written through shuffled, non-contiguous block tables; queries for each sequence's
    last ``q_len`` tokens. Returns the reference kernel arguments."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.zeros(shape, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_needed) + 1  # one column of -1 padding at least
    tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    for i, (ctx, nb) in enumerate(zip(ctx_lens, blocks_needed)):
        table = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(table)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype).to(device)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)], device=device)
        torch_ref.write_kv(k, v, kc, vc, slots)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g).to(dtype).to(device)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], device=device)
    return q, kc, vc, tables.to(device), torch.tensor(ctx_lens, device=device), qsl, head_dim ** -0.5


DECODE_CASES = [
    # block_size, group, head_dim, context lengths (a partial last block, a context of 1, a full block)
    (1, 1, 64, [1, 5, 9]),
    (3, 2, 80, [1, 7, 12, 20]),
    (16, 4, 64, [1, 16, 37, 100]),
    (64, 8, 80, [1, 64, 70]),
    (16, 8, 64, [200, 3]),
    (3, 4, 64, [50, 1]),
]


@pytest.mark.parametrize("block_size, group, head_dim, ctx_lens", DECODE_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(block_size, group, head_dim, ctx_lens, num_splits):
    args = make_case(block_size, group, head_dim, ctx_lens, [1] * len(ctx_lens))
    ref = torch_ref.paged_attention(*args)
    out = triton_paged.paged_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


PREFILL_CASES = [
    # packed prefill chunks with cached context before them (prefix hits, recompute) and decode tokens mixed in
    (1, 2, 64, [6, 9, 1], [6, 4, 1]),
    (3, 1, 80, [10, 4, 25], [10, 1, 7]),
    (16, 4, 64, [40, 17, 33], [40, 17, 1]),
    (64, 8, 80, [70, 5], [30, 5]),
]


@pytest.mark.parametrize("block_size, group, head_dim, ctx_lens, q_lens", PREFILL_CASES)
def test_prefill_matches_reference(block_size, group, head_dim, ctx_lens, q_lens):
    args = make_case(block_size, group, head_dim, ctx_lens, q_lens)
    ref = torch_ref.paged_attention(*args)
    out = triton_paged.paged_attention(*args, block_m=8, block_n=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 80), (3, 24), (1, 64)])
def test_write_kv_matches_reference_and_skips_padding(num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(1)
    shape = (6, 4, num_kv_heads, head_dim)
    k = torch.randn(7, num_kv_heads, head_dim, generator=g)
    v = torch.randn(7, num_kv_heads, head_dim, generator=g)
    slots = torch.tensor([3, -1, 0, 22, 9, -1, 17])
    ref_k, ref_v = torch.zeros(shape), torch.zeros(shape)
    out_k, out_v = torch.zeros(shape), torch.zeros(shape)
    torch_ref.write_kv(k, v, ref_k, ref_v, slots)
    # a strided (non-contiguous) view, as the model runner passes it
    triton_paged.write_kv(k.transpose(0, 1).contiguous().transpose(0, 1), v, out_k, out_v, slots)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    assert out_k.view(-1, num_kv_heads, head_dim)[[1, 2]].abs().sum() == 0  # padding wrote nothing


def test_engine_with_triton_backend_matches_torch_backend(make_engine, text_ids):
    from engine import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [text_ids[:5], text_ids[:11]]
    ref = make_engine(block_size=3, num_blocks=32, attention_backend="torch").generate(prompts, params)
    tri = make_engine(block_size=3, num_blocks=32, attention_backend="triton").generate(prompts, params)
    assert [o.output_token_ids for o in tri] == [o.output_token_ids for o in ref]


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size, group, head_dim, ctx_lens", DECODE_CASES + [(16, 4, 128, [4000, 1, 777])])
def test_decode_on_gpu(dtype, block_size, group, head_dim, ctx_lens):
    args = make_case(block_size, group, head_dim, ctx_lens, [1] * len(ctx_lens), dtype=dtype, device="cuda")
    ref = torch_ref.paged_attention(*args)
    for splits in (None, 1, 4):
        out = triton_paged.paged_attention(*args, num_splits=splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size, group, head_dim, ctx_lens, q_lens", PREFILL_CASES)
def test_prefill_on_gpu(dtype, block_size, group, head_dim, ctx_lens, q_lens):
    args = make_case(block_size, group, head_dim, ctx_lens, q_lens, dtype=dtype, device="cuda")
    ref = torch_ref.paged_attention(*args)
    out = triton_paged.paged_attention(*args)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_engine_on_gpu_matches_cpu_reference(model_path, text_ids):
    from engine import EngineConfig, LLMEngine, SamplingParams
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [text_ids[:n] for n in (1, 15, 16, 17, 48)]
    cpu = LLMEngine(EngineConfig(model=model_path, device="cpu", block_size=16, num_blocks=64))
    gpu = LLMEngine(EngineConfig(model=model_path, device="cuda", dtype="float32", block_size=16, num_blocks=64))
    assert gpu.backend == "triton"
    expected = [o.output_token_ids for o in cpu.generate(prompts, params)]
    assert [o.output_token_ids for o in gpu.generate(prompts, params)] == expected


@pytest.mark.gpu
def test_swap_beam_and_prefix_cache_on_gpu_match_cpu(model_path, text_ids):
    """Copy-on-write, swap to pinned CPU memory and back, and prefix-cache hits on the GPU."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    def run(device):
        common = dict(model=model_path, device=device, dtype="float32", block_size=4)
        swap = LLMEngine(EngineConfig(num_blocks=14, max_model_len=32, preemption_mode="swap", **common))
        prompts = [text_ids[:n] for n in (9, 6, 11, 7)]
        records = []
        outs = swap.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), on_step=records.append)
        assert any(e.kind == "swap_in" for r in records for e in r.events)
        beam = LLMEngine(EngineConfig(num_blocks=128, **common))
        [b] = beam.generate([text_ids[:7]], SamplingParams(beam_width=4, max_tokens=12))
        cached = LLMEngine(EngineConfig(num_blocks=64, **common))
        again = cached.generate([text_ids[:14], text_ids[:14]], SamplingParams(max_tokens=8, temperature=0.0))
        return [o.output_token_ids for o in outs], b.output_token_ids, [o.output_token_ids for o in again]

    assert run("cuda") == run("cpu")
