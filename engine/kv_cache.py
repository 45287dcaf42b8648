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
                 dtype: torch.dtype, num_swap_blocks: int = 0) -> None:
        shape = (num_blocks, block_size, geometry.num_kv_heads, geometry.head_dim)
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.key_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(geometry.num_layers)]
        self.value_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(geometry.num_layers)]
        swap_shape = (num_swap_blocks, block_size, geometry.num_kv_heads, geometry.head_dim)
        pin = device.type == "cuda"
        self.swap_key = [torch.zeros(swap_shape, dtype=dtype, pin_memory=pin) for _ in range(geometry.num_layers)]
        self.swap_value = [torch.zeros(swap_shape, dtype=dtype, pin_memory=pin) for _ in range(geometry.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_cache + self.value_cache)

    def apply(self, ops: list[tuple[str, int, int]]) -> None:
        """Execute the block manager's queued data movement in order: ("copy", src, dst) GPU->GPU,
        ("swap_out", gpu, cpu), ("swap_in", cpu, gpu). Consecutive ops of one kind are batched."""
        i = 0
        while i < len(ops):
            kind = ops[i][0]
            j = i
            while j < len(ops) and ops[j][0] == kind:
                j += 1
            pairs = [(s, d) for _, s, d in ops[i:j]]
            if kind == "copy":
                self.copy_blocks(pairs)
            else:
                self._swap(pairs, out=kind == "swap_out")
            i = j

    def _swap(self, pairs: list[tuple[int, int]], out: bool) -> None:
        src = torch.tensor([p[0] for p in pairs])
        dst = torch.tensor([p[1] for p in pairs])
        gpu_pairs = zip(self.key_cache + self.value_cache, self.swap_key + self.swap_value)
        for gpu, cpu in gpu_pairs:
            if out:
                cpu[dst] = gpu[src.to(gpu.device)].to("cpu")
            else:
                gpu[dst.to(gpu.device)] = cpu[src].to(gpu.device, non_blocking=True)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy K and V of every layer from block ``src`` to block ``dst`` for each pair (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.key_cache[0].device)
        dst = torch.tensor([p[1] for p in pairs], device=self.key_cache[0].device)
        for cache in self.key_cache + self.value_cache:
            cache[dst] = cache[src]
