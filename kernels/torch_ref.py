"""Pure-PyTorch reference paged attention and KV write: the CPU backend and the kernels' test oracle.

Readable rather than fast: for each sequence it gathers K/V through the block table into a contiguous
tensor and runs ordinary causal attention on it, in float32. The Triton kernels must match it.
"""

from __future__ import annotations

import torch


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V ``[num_tokens, num_kv_heads, head_dim]`` into the pool at ``slot_mapping``.

    ``key_cache``/``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is
    block ``s // block_size``, offset ``s % block_size``; slot -1 means skip (padding).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    h, d = key_cache.shape[-2:]
    key_cache.view(-1, h, d)[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, h, d)[slots] = value[keep].to(value_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """Read one sequence's first ``context_len`` tokens through its block table -> ``[context_len, H, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:context_len]


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, max_query_len: int | None = None, max_context_len: int | None = None
                    ) -> torch.Tensor:
    """Causal attention of packed query tokens against each sequence's cached context.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the query tokens of all sequences packed in order.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the new tokens' K/V
            must already be written.
        block_tables: ``[num_seqs, max_blocks]`` physical block ids, padded with -1.
        context_lens: ``[num_seqs]`` tokens in the cache per sequence, the new ones included.
        query_start_loc: ``[num_seqs + 1]`` cumulative query counts; sequence ``i`` owns query rows
            ``query_start_loc[i]:query_start_loc[i+1]``, which are its last tokens (positions
            ``context_len - q_len .. context_len - 1``). Decode is the case q_len = 1.
        scale: softmax scale, usually head_dim ** -0.5.
        max_query_len, max_context_len: host-side maxima, a hint for GPU kernels (unused here).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype. Grouped-query attention: query head
        ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    """
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for i, ctx in enumerate(lens):
        q = query[starts[i]:starts[i + 1]].float()  # [q_len, Hq, D]
        q_len = q.shape[0]
        k = gather_kv(key_cache, block_tables[i], ctx).float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = gather_kv(value_cache, block_tables[i], ctx).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        k_pos = torch.arange(ctx, device=query.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
