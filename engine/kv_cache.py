"""The paged KV cache tensors: where the bytes of every block live.

Layout (vLLM / FlashAttention "NHD"): per layer, K and V each ``[num_blocks, block_size, num_kv_heads,
head_dim]``, allocated once when the engine starts. Slot ``s`` is ``key_cache[l].view(-1, H, D)[s]``, i.e.
block ``s // block_size``, offset ``s % block_size``. The block manager decides which blocks a sequence
owns; this class only holds and copies the data.
"""

from __future__ import annotations

import torch

from .model_loader import KVGeometry


def num_blocks_for_budget(budget_bytes: int, geometry: KVGeometry, block_size: int) -> int:
    """Blocks that fit in ``budget_bytes`` (floor). Raises ValueError if not even one block fits."""
    per_block = geometry.bytes_per_block(block_size)
    n = budget_bytes // per_block
    if n < 1:
        raise ValueError(
            f"kv_budget_bytes {budget_bytes} is below one block ({per_block} bytes = {block_size} tokens x "
            f"{geometry.bytes_per_token} bytes per token)"
        )
    return n


class KVCache:
    """K and V tensors of every layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each.

    Memory: ``num_blocks * geometry.bytes_per_block(block_size)`` bytes.
    """

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (num_blocks, block_size, geometry.num_kv_heads, geometry.head_dim)
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.key_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(geometry.num_layers)]
        self.value_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(geometry.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy K and V of every layer from block ``src`` to block ``dst`` for each pair (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.key_cache[0].device)
        dst = torch.tensor([p[1] for p in pairs], device=self.key_cache[0].device)
        for cache in self.key_cache + self.value_cache:
            cache[dst] = cache[src]
