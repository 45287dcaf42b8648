"""The PyTorch reference paged attention equals plain causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention, write_kv


def contiguous_attention(q, k, v, scale):
    """q [Lq, Hq, D] (the last Lq of L positions), k/v [L, Hk, D] -> [Lq, Hq, D], float64 oracle."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    lq, L = q.shape[0], k.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    mask = torch.arange(L)[None, :] > torch.arange(L - lq, L)[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_contiguous_attention(block_size, group):
    torch.manual_seed(block_size * 10 + group)
    hk, d, num_blocks = 2, 24, 64
    kc = torch.zeros(num_blocks, block_size, hk, d)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks).tolist()  # shuffled, non-contiguous physical blocks
    ctx_lens, q_lens = [1, 7, 2 * block_size + 1], [1, 3, 2]
    tables, qs, ks, vs = [], [], [], []
    for ctx in ctx_lens:
        nb = -(-ctx // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table + [-1] * (8 - nb))
        k, v = torch.randn(ctx, hk, d), torch.randn(ctx, hk, d)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(ctx)])
        write_kv(k, v, kc, vc, slots)
        ks.append(k)
        vs.append(v)
    for ql in q_lens:
        qs.append(torch.randn(ql, hk * group, d))
    q = torch.cat(qs)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()])
    out = paged_attention(q, kc, vc, torch.tensor(tables), torch.tensor(ctx_lens), qsl, d ** -0.5)
    for i in range(3):
        expect = contiguous_attention(qs[i], ks[i], vs[i], d ** -0.5).float()
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], expect, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padding_slots():
    kc = torch.zeros(2, 2, 1, 3)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 1, 3)
    write_kv(k, 2 * k, kc, vc, torch.tensor([3, -1, 0]))
    assert kc.view(-1, 1, 3)[:, 0, 0].tolist() == [1, 0, 0, 1]
    assert vc.view(-1, 1, 3)[:, 0, 0].tolist() == [2, 0, 0, 2]


def test_a_long_later_chunk_split_in_two_equals_one_masked_pass():
    """Chunks of >= SPLIT_CHUNK_MIN_TOKENS after a cached prefix attend in two merged parts on the CPU; the
    result must be the plain masked computation's (written out here with matmul and softmax)."""
    from kernels import torch_ref

    torch.manual_seed(0)
    for q_len, ctx in ((torch_ref.SPLIT_CHUNK_MIN_TOKENS, 700), (900, 1400)):
        q, k, v = torch.randn(q_len, 8, 32), torch.randn(ctx, 2, 32), torch.randn(ctx, 2, 32)
        qg = q.view(q_len, 2, 4, 32).permute(1, 2, 0, 3)
        scores = torch.matmul(qg, k.permute(1, 2, 0)[:, None]) * 32 ** -0.5
        future = torch.arange(ctx)[None, :] > torch.arange(ctx - q_len, ctx)[:, None]
        scores.masked_fill_(future, float("-inf"))
        want = torch.matmul(torch.softmax(scores, -1), v.permute(1, 0, 2)[:, None]).permute(2, 0, 1, 3)
        got = torch_ref.causal_attention(q, k, v, 32 ** -0.5)
        torch.testing.assert_close(got, want.reshape(q_len, 8, 32), atol=1e-5, rtol=1e-5)
