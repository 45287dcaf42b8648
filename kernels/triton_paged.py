"""Triton paged-attention kernels: KV write, paged decode attention (split-KV) and paged prefill attention.

These kernels read K/V *through the block table*, as vLLM's PagedAttention does (Kwon et al., SOSP 2023):
the cache is ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, and token ``t`` of a
sequence lives at slot ``block_table[t // block_size] * block_size + t % block_size``.

Algorithm
---------
*KV write* (vLLM's ``reshape_and_cache``): one program per new token copies its ``[num_kv_heads,
head_dim]`` keys and values to its slot; slot -1 is padding and skipped. Head sizes that are not powers of
two are handled by masking to the next power of two (true of every kernel here).

*Attention* is one kernel, ``_paged_attention_kernel``, launched in two ways:
- prefill: query tokens of several sequences are packed back to back (``query_start_loc``); each program
  takes ``BLOCK_M`` query tokens of one sequence and all query heads that share one KV head, and walks the
  sequence's cached context tile by tile (``BLOCK_N`` tokens), with the causal mask ``key_pos <= q_pos``.
  The queries are the sequence's *last* tokens, so the same kernel serves prefix-cache hits and recompute
  after preemption, where part of the context is already cached.
- decode: one query token per sequence; the context is cut into ``num_splits`` ranges handled by separate
  programs (split-KV, as in Flash-Decoding, Dao et al. 2023), which write partial outputs with their
  log-sum-exp; a second small kernel merges them. Splitting keeps the GPU busy when the batch is small and
  the context long.

Inside a program, softmax is computed online (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022):
keep the running row maximum ``m``, the running sum ``l`` of ``exp(s - m)`` and the running output
``acc``; when a new tile raises the maximum, rescale ``l`` and ``acc`` by ``exp(m_old - m_new)``. All of
this is in float32 whatever the cache dtype.

Grouped-query attention: the ``G = num_heads // num_kv_heads`` query heads of one KV head are stacked
with the query tokens into the rows of one tile (row ``r`` = token ``r // G_PAD``, head ``r % G_PAD``), so
each K/V tile is read once for the whole group and multiplied with ``tl.dot``. The nearest public
relatives are vLLM's Triton decode attention (``triton_decode_attention.py``, from LightLLM/SGLang) and
its "unified" Triton attention.

Sliding window (``sliding_window`` W, a layer of a hybrid model): a query at position p reads positions
p - W + 1 .. p. The walk over the context starts at the first position the tile's first query reads
(``max(kv_lo, q_pos_first - W + 1)``), so the blocks wholly before it, which may be -1 (the null block a
sliding KV cache group puts where blocks left the window), are never read, and the mask adds
``key_pos > q_pos - W``. A decode split whose whole range lies before the window computes nothing and
weighs 0 in the merge.

Gathering a tile: for tile token ``n`` the kernel loads the physical block id ``block_table[n // B]`` and
reads the row at slot ``block * B + n % B``; rows inside one block are contiguous, so any block size
(1, 3, 16, 128, ...) works and sizes >= 16 read memory in long runs.

On a machine without CUDA, importing this module turns on Triton's interpreter (``TRITON_INTERPRET=1``),
so the same kernel code runs on the CPU (slowly) for tests and for ``attention_backend="triton"``.
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET and type(tl.zeros).__name__ != "InterpretedFunction":
    # Triton decides at its own import whether its building blocks run interpreted; too late now.
    raise ImportError("Triton was imported before TRITON_INTERPRET=1 was set; import kernels (or set "
                      "TRITON_INTERPRET=1) before anything imports triton to run the kernels on the CPU")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------------------------- KV write
@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Scatter K/V ``[num_tokens, num_kv_heads, head_dim]`` into ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` caches at ``slot_mapping`` (int, ``[num_tokens]``; -1 skips). head_dim must be contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=_next_pow2(num_kv_heads), D_PAD=_next_pow2(head_dim),
    )


# ------------------------------------------------------------------------------------------- attention
@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    tokens_per_split, window,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)  # a query tile (prefill) or a KV split (decode)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + seq)
    if NUM_SPLITS == 1:
        m_tile = tile
        kv_lo = 0
        kv_hi = ctx_len
    else:
        m_tile = 0
        kv_lo = tile * tokens_per_split
        kv_hi = tl.minimum(ctx_len, kv_lo + tokens_per_split)
    if m_tile * BLOCK_M < q_len:
        rows = tl.arange(0, BLOCK_M * G_PAD)
        tok = m_tile * BLOCK_M + rows // G_PAD  # query token index within the sequence's new tokens
        head = kv_head * GROUP + rows % G_PAD
        row_ok = (tok < q_len) & (rows % G_PAD < GROUP)
        q_pos = ctx_len - q_len + tok  # absolute position of each row's token
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M * G_PAD], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M * G_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
        # causal: no row of this tile looks past its last token
        hi = tl.minimum(kv_hi, ctx_len - q_len + tl.minimum(q_len, (m_tile + 1) * BLOCK_M))
        lo = kv_lo
        if SLIDING:  # nothing before the first query's window: those blocks may be the null block
            lo = tl.maximum(kv_lo, ctx_len - q_len + m_tile * BLOCK_M - window + 1)
        offs_n0 = tl.arange(0, BLOCK_N)
        row_stride = NUM_KV_HEADS * HEAD_DIM
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + offs_n0
            n_ok = offs_n < hi
            block = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
            block = tl.maximum(block, 0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            kv_off = slot[:, None] * row_stride + kv_head * HEAD_DIM + offs_d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            ok = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if SLIDING:
                ok = ok & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            p = tl.where(ok, p, 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        out_mask = row_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # partial results [num_seqs, num_heads, NUM_SPLITS, (D_PAD)] for the merge kernel
            lse = tl.where(l_i > 0, m_i + tl.log(l_safe), -float("inf"))
            base = (seq * NUM_HEADS + head) * NUM_SPLITS + tile
            tl.store(part_out_ptr + base[:, None] * D_PAD + offs_d[None, :], o, mask=out_mask)
            tl.store(part_lse_ptr + base, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
):
    """out = sum_s exp(lse_s - max) * o_s / sum_s exp(lse_s - max) for one (sequence, head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < NUM_SPLITS
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=-float("inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_ok & (lse > -float("inf")), tl.exp(lse - m), 0.0)
    o = tl.load(part_out_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 32


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(batch: int, num_kv_heads: int, max_context: int, device) -> int:
    """Split the context only when (sequence, KV head) programs alone would leave SMs idle: then aim for
    about two programs per SM, each split holding at least ``MIN_TOKENS_PER_SPLIT`` tokens, at most
    ``MAX_SPLITS`` splits. Chosen from split-factor sweeps on an H200 (docs/benchmarks.md): at batch 1
    and 1,024 tokens 8 splits took 13.5 us against 35 us unsplit; at batch 16 (128 programs) 3-4 splits
    were best, while 5 (four programs per SM) ran 20% slower than 3."""
    if INTERPRET or device.type != "cuda":
        return 1
    programs = batch * num_kv_heads
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    want = -(-2 * sms // programs)
    max_by_len = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    return int(min(want, max_by_len, MAX_SPLITS))


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale,
                    max_query_len: int | None = None, max_context_len: int | None = None,
                    num_splits: int | None = None, block_m: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, sliding_window: int | None = None):
    """Triton paged attention; same contract as ``kernels.torch_ref.paged_attention``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` packed query tokens (each sequence's last tokens).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
        block_tables: ``[num_seqs, max_blocks]`` int, padded with -1.
        context_lens: ``[num_seqs]`` tokens cached per sequence (new ones included).
        query_start_loc: ``[num_seqs + 1]`` cumulative query counts.
        scale: softmax scale.
        max_query_len, max_context_len: the largest q_len and context_len if the caller knows them on the
            host (saves two device-to-host syncs); None reads them from the tensors.
        num_splits: split-KV factor for decode (every sequence has one query token); None chooses.
        block_m, block_n: tile sizes (query tokens per program, context tokens per iteration); None chooses.
        num_warps, num_stages: Triton launch settings; None keeps Triton's defaults.
        sliding_window: W, each query reads only its last W positions (None: every earlier position).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    assert query.stride(-1) == 1, "head_dim of the query must be contiguous"
    num_seqs = context_lens.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    g_pad = _next_pow2(group)
    d_pad = max(16, _next_pow2(head_dim))
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    max_q = max_query_len or int((query_start_loc[1:] - query_start_loc[:-1]).max())
    max_ctx = max_context_len or int(context_lens.max())
    decode = max_q == 1
    ieee = query.dtype == torch.float32
    block_n = block_n or (32 if ieee else 64)
    if decode:
        block_m = max(1, 16 // g_pad)  # rows = block_m * g_pad >= 16 for tl.dot; extra rows are masked
        if num_splits is None:
            num_splits = _num_splits(num_seqs, num_kv_heads, max_ctx, query.device)
    else:
        block_m = block_m or max(1, 64 // g_pad)
        num_splits = 1
    block_m = max(block_m, -(-16 // g_pad))
    tokens_per_split = -(-max_ctx // num_splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    tiles = num_splits if num_splits > 1 else -(-max_q // block_m)
    if num_splits > 1:
        part_out = torch.empty(num_seqs * num_heads * num_splits * d_pad, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs * num_heads * num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    bt = block_tables.to(torch.int32).contiguous()
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    _paged_attention_kernel[(num_seqs, num_kv_heads, tiles)](
        query, key_cache, value_cache, bt, context_lens.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(), out, part_out, part_lse,
        float(scale), query.stride(0), query.stride(1), out.stride(0), out.stride(1), bt.stride(0),
        tokens_per_split, int(sliding_window or 0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=g_pad,
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits, IEEE=ieee, SLIDING=sliding_window is not None,
        **launch,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits,
            S_PAD=_next_pow2(num_splits),
        )
    return out
