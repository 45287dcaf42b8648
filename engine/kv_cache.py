"""The paged KV cache tensors: where the bytes of every block live.

Layout (vLLM / FlashAttention "NHD"): per layer, K and V each ``[num_blocks, block_size, num_kv_heads,
head_dim]``, allocated once when the engine starts. Slot ``s`` is ``key_cache[l].view(-1, H, D)[s]``, i.e.
block ``s // block_size``, offset ``s % block_size``. The block manager decides which blocks a sequence
owns; this class only holds and copies the data.

KV cache groups (a hybrid model, ``engine.single_type_kv_cache_manager.group_layers``): every group has
the same number of layers and draws its blocks from the one pool, so a block id belongs to one group at a
time and the groups can share the bytes, as vLLM lays them out ("Groups alias from byte 0",
``get_kv_cache_config_from_groups``, vllm/v1/core/kv_cache_utils.py:1588-1687): the ``j``-th layer of
every group reads and writes the same tensor ``j``. So a block holds ``layers per group`` layers' K and V,
not every layer's: for the embedded hybrid model (2 groups of 2 layers) a block is half the bytes of the
same model with one group of 4 full-attention layers, and the pool holds twice as many blocks for the same
memory. ``key_cache[l]`` is layer ``l``'s tensor whatever the grouping.
"""

from __future__ import annotations

import torch

from .model_loader import KVGeometry
from .single_type_kv_cache_manager import KVCacheGroupSpec, group_layers


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's attention window from a transformers config (None: every earlier token).

    ``layer_types`` names each layer "sliding_attention" or "full_attention" (Qwen2/Qwen3, Ministral,
    Gemma, gpt-oss); without it, a ``sliding_window`` applies to every layer (Mistral). Qwen2/Qwen3 use it
    only with ``use_sliding_window`` true. A window as long as ``max_position_embeddings`` or longer is no
    window. Raises ValueError for a layer type other than those two, or a window that is not a positive
    integer."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer or null, got {window!r}")
    if window is not None and window >= config.max_position_embeddings:
        window = None
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n
    bad = sorted(set(types) - {"sliding_attention", "full_attention"})
    if bad or len(types) != n:
        raise ValueError(f"layer_types must name {n} layers 'sliding_attention' or 'full_attention', got {types!r}")
    return [window if t == "sliding_attention" else None for t in types]


def kv_cache_groups(config) -> tuple[KVCacheGroupSpec, ...]:
    """The KV cache groups of a transformers model config (``layer_windows`` grouped as vLLM groups them)."""
    return group_layers(layer_windows(config))


def page_bytes(geometry: KVGeometry, block_size: int, groups: tuple[KVCacheGroupSpec, ...] | None = None) -> int:
    """Bytes of one block: ``block_size`` tokens of K and V for the layers of one KV cache group (vLLM's
    page size; every group has as many layers, the groups share the bytes). One group:
    ``geometry.bytes_per_block(block_size)``."""
    if not groups:
        return geometry.bytes_per_block(block_size)
    per_layer = geometry.bytes_per_block(block_size) // geometry.num_layers
    return per_layer * max(len(g.layer_ids) for g in groups)


def num_blocks_for_budget(budget_bytes: int, geometry: KVGeometry, block_size: int,
                          groups: tuple[KVCacheGroupSpec, ...] | None = None) -> int:
    """Blocks that fit in ``budget_bytes`` (floor, blocks of ``page_bytes``). Raises ValueError if not even
    one block fits."""
    per_block = page_bytes(geometry, block_size, groups)
    n = budget_bytes // per_block
    if n < 1:
        raise ValueError(
            f"kv_budget_bytes {budget_bytes} is below one block ({per_block} bytes = {block_size} tokens x "
            f"{per_block // block_size} bytes per token)"
        )
    return n


def check_groups_supported(groups: tuple[KVCacheGroupSpec, ...], model: str, semantics: str) -> None:
    """Refuse sliding-window layers where one block table serves every layer.

    Raises:
        ValueError: the model has sliding-window layers and ``semantics`` is "paper": vLLM V0 keeps one
            table per sequence for every layer (the contiguous baseline, which runs the paper's scheduler,
            one row), where V1's KV cache groups keep one per kind of layer.
    """
    windows = sorted({g.sliding_window for g in groups if g.sliding_window is not None})
    if not windows or semantics == "v1":
        return
    raise ValueError(f"model {model!r} has sliding-window layers (window {', '.join(map(str, windows))} tokens, "
                     f"{sum(len(g.layer_ids) for g in groups if g.sliding_window)} of "
                     f"{sum(len(g.layer_ids) for g in groups)} layers): the paper's semantics keep one block table "
                     f"per sequence for every layer, so they cannot free what a window left; run it with "
                     f"semantics='v1', whose KV cache groups (one block table per kind of layer, as vLLM's hybrid "
                     f"KV cache manager) hold it")


class KVCache:
    """K and V tensors of every layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each.

    ``groups``: the model's KV cache groups (None: one group of every layer). Layer ``l``, the ``j``-th
    layer of its group, uses tensor ``j`` (``layer_group[l]`` is its group), so only ``layers per group``
    tensors of K and V are allocated.

    Memory: ``num_blocks * block_size * layers per group * 2 * num_kv_heads * head_dim * element size``
    bytes (``geometry.bytes_per_block(block_size)`` with one group).
    """

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, num_swap_blocks: int = 0,
                 groups: tuple[KVCacheGroupSpec, ...] | None = None) -> None:
        shape = (num_blocks, block_size, geometry.num_kv_heads, geometry.head_dim)
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = groups or (KVCacheGroupSpec(tuple(range(geometry.num_layers))),)
        slot = {l: j for spec in self.groups for j, l in enumerate(spec.layer_ids)}
        if sorted(slot) != list(range(geometry.num_layers)):
            raise ValueError(f"the KV cache groups {[g.layer_ids for g in self.groups]} do not cover the "
                             f"{geometry.num_layers} layers once each")
        self.layer_group = [next(g for g, spec in enumerate(self.groups) if l in spec.layer_ids)
                            for l in range(geometry.num_layers)]
        self.layer_window = [self.groups[g].sliding_window for g in self.layer_group]
        per_group = max(len(spec.layer_ids) for spec in self.groups)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(per_group)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(per_group)]
        self.key_cache = [keys[slot[l]] for l in range(geometry.num_layers)]
        self.value_cache = [values[slot[l]] for l in range(geometry.num_layers)]
        self._tensors = keys + values  # each tensor once (layers of different groups share them)
        swap_shape = (num_swap_blocks, block_size, geometry.num_kv_heads, geometry.head_dim)
        pin = device.type == "cuda"
        self.swap_key = [torch.zeros(swap_shape, dtype=dtype, pin_memory=pin) for _ in range(per_group)]
        self.swap_value = [torch.zeros(swap_shape, dtype=dtype, pin_memory=pin) for _ in range(per_group)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors)

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
        gpu_pairs = zip(self._tensors, self.swap_key + self.swap_value)
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
        for cache in self._tensors:
            cache[dst] = cache[src]
