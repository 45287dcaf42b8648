"""Paged attention with a sliding window (issue 25, item 2): the PyTorch reference and the Triton kernels
(under Triton's interpreter on the CPU) against plain masked attention, with the blocks a sliding KV cache
group gave back set to -1 (the null block) in the block tables."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)
from kernels import torch_ref


def windowed_case(block_size, window, ctx_lens, q_lens, group=2, head_dim=32, num_kv_heads=2, seed=0):
    """K/V of each sequence written through a shuffled block table whose blocks wholly before the first
    query's window are -1 (and overwritten with garbage in the pool, so reading them would show); returns
    the kernel arguments and the plain masked-attention result."""
    g = torch.Generator().manual_seed(seed)
    nb = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(nb) + 3
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 100  # garbage everywhere
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 100
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(ctx_lens), max(nb) + 1), -1, dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=g)
    expected = torch.empty_like(q)
    start = 0
    for i, (ctx, n, q_len) in enumerate(zip(ctx_lens, nb, q_lens)):
        table = [perm.pop() for _ in range(n)]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        torch_ref.write_kv(k, v, kc, vc, slots)
        gone = max(0, ctx - q_len - window + 1) // block_size  # what the sliding group gave back
        tables[i, :n] = torch.tensor([-1] * gone + table[gone:])
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        key_pos = torch.arange(ctx)[None, :]
        mask = (key_pos <= q_pos) & (key_pos > q_pos - window)
        qi = q[start:start + q_len].transpose(0, 1)  # [H, q, D]
        kk = k.repeat_interleave(group, 1).transpose(0, 1)
        vv = v.repeat_interleave(group, 1).transpose(0, 1)
        scores = (qi @ kk.transpose(1, 2)) * head_dim ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        expected[start:start + q_len] = (probs @ vv).transpose(0, 1)
        start += q_len
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()])
    return (q, kc, vc, tables, torch.tensor(ctx_lens), qsl, head_dim ** -0.5), expected


CASES = [
    # block_size, window, context lengths, query lengths
    (4, 8, [30, 9, 3], [1, 1, 1]),  # decode: a context past the window, one at it, one inside it
    (16, 48, [150, 40], [1, 1]),  # the embedded hybrid model's window at the lab's default block size
    (4, 8, [30, 20], [12, 20]),  # prefill chunks: one after a cached part, one whole prompt
    (16, 48, [150, 5, 100], [60, 1, 1]),  # a mixed step: a chunk across the window's edge with decodes
    (32, 48, [130], [33]),  # vLLM CPU's block size: the window's edge inside a block
]


@pytest.mark.parametrize("block_size, window, ctx_lens, q_lens", CASES)
def test_reference_attends_within_the_window_only(block_size, window, ctx_lens, q_lens):
    args, expected = windowed_case(block_size, window, ctx_lens, q_lens)
    out = torch_ref.paged_attention(*args, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_without_the_window_the_reference_reads_further_back():
    args, expected = windowed_case(4, 8, [30], [1])
    out = torch_ref.paged_attention(*args)  # no window: the positions before it (garbage blocks) count
    assert not torch.allclose(out, expected, atol=1e-3)


@pytest.mark.parametrize("block_size, window, ctx_lens, q_lens", CASES)
def test_triton_attends_within_the_window_only(block_size, window, ctx_lens, q_lens):
    triton_paged = pytest.importorskip("kernels.triton_paged")
    args, expected = windowed_case(block_size, window, ctx_lens, q_lens)
    out = triton_paged.paged_attention(*args, sliding_window=window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if max(q_lens) == 1:  # decode split over the context: splits wholly before the window weigh nothing
        out = triton_paged.paged_attention(*args, sliding_window=window, num_splits=3)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
