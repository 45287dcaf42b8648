"""Attention backends for the paged KV cache, behind one dispatch point.

``paged_attention`` and ``write_kv`` pick the implementation named by ``backend``:
- "torch": the pure-PyTorch reference (``kernels.torch_ref``), used on the CPU;
- "triton": the Triton kernels (``kernels.triton_paged``); without CUDA they run in Triton's interpreter
  (slow, for tests and to show that the same kernel code drives the engine);
- "auto": Triton on CUDA when available, else the reference.
"""

from __future__ import annotations

import os

import torch

from . import torch_ref

if not torch.cuda.is_available():
    # Without CUDA the Triton kernels can only run in Triton's interpreter, and Triton reads this switch
    # once, when it is first imported (transformers may import it while loading a model), so set it now.
    os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    try:
        from . import triton_paged  # noqa: F401
    except ImportError:  # triton not installed (e.g. macOS), or imported too early for the interpreter
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn "auto" into a concrete backend for ``device``. Raises ValueError for an unknown or unusable one."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise ValueError("attention_backend 'triton' is not available: triton is not installed or could not "
                         "be imported")
    return backend


def _impl(backend: str):
    if backend == "torch":
        return torch_ref
    from . import triton_paged

    return triton_paged


def write_kv(key, value, key_cache, value_cache, slot_mapping, backend: str = "torch") -> None:
    """Scatter K/V ``[num_tokens, num_kv_heads, head_dim]`` into the pool at ``slot_mapping`` (-1 skips)."""
    _impl(backend).write_kv(key, value, key_cache, value_cache, slot_mapping)


def contiguous_attention(query, key_region, value_region, region_starts, context_lens, query_start_loc, scale):
    """The contiguous baseline's attention over each sequence's own slice of a ``[capacity, Hk, D]``
    region (PyTorch on every device: it is the baseline, not the product)."""
    return torch_ref.contiguous_attention(query, key_region, value_region, region_starts, context_lens,
                                          query_start_loc, scale)


def paged_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale,
                    backend: str = "torch", max_query_len: int | None = None, max_context_len: int | None = None,
                    sliding_window: int | None = None):
    """Causal attention of packed queries ``[num_tokens, num_heads, head_dim]`` through block tables;
    ``sliding_window`` W: a query at position p reads positions p - W + 1 .. p only (None: all).

    See ``kernels.torch_ref.paged_attention`` for shapes; every backend has the same contract.
    """
    return _impl(backend).paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                          query_start_loc, scale, max_query_len=max_query_len,
                                          max_context_len=max_context_len, sliding_window=sliding_window)
