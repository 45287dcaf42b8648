"""KV cache sizes from model configs, and how many requests fit on a GPU (lesson 1). No Streamlit.

Bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element (Kwon et al., SOSP 2023,
section 2.2), computed by the engine's own ``KVGeometry`` from a transformers config. Config presets of
well-known models live in ``lessons/data/models/*.json`` with the URL of the config.json they copy;
parameter counts are not typed in but counted by building the model on PyTorch's "meta" device (no memory,
no download).

Lesson 10 adds hybrid models (some layers attend over a sliding window): their KV cache groups, bytes per
token per group, and how many requests fit against an all-full-attention twin (``hybrid_fit``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
GB = 10**9  # the vendors' GB (spec sheets); KiB/MiB/GiB are powers of two
KV_DTYPES = ("float16", "bfloat16", "float32")
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory it may use (engine argument docs)


@dataclass(frozen=True)
class ModelPreset:
    key: str
    name: str
    source: str
    note: str
    config_fields: tuple  # sorted (key, value) pairs of the config.json fields we copied

    @property
    def config(self):
        return _config(self.config_fields)

    @property
    def dtype(self) -> str:
        return dict(self.config_fields).get("torch_dtype", "float16")


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)


class _FrozenDict(tuple):
    """A nested dict of a config (e.g. ``rope_scaling``) as sorted (key, value) pairs, hashable."""


def _freeze_value(v):
    if isinstance(v, dict):
        return _FrozenDict(sorted((k, _freeze_value(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_freeze_value(x) for x in v)
    return v


def _thaw_value(v):
    if isinstance(v, _FrozenDict):
        return {k: _thaw_value(x) for k, x in v}
    if isinstance(v, tuple):
        return [_thaw_value(x) for x in v]
    return v


def _freeze(d: dict) -> tuple:
    """A config's fields as sorted (key, value) pairs, hashable (lists as tuples, nested dicts as
    ``_FrozenDict``), so built configs and parameter counts can be cached by them."""
    return tuple(sorted((k, _freeze_value(v)) for k, v in d.items()))


@lru_cache(maxsize=None)
def _config(fields: tuple):
    from engine.model_loader import transformers_api

    AutoConfig = transformers_api().AutoConfig
    d = {k: _thaw_value(v) for k, v in fields}
    model_type = d.pop("model_type")
    d.pop("architectures", None)
    d.pop("torch_dtype", None)
    d.pop("quantization_config", None)  # how the weights ship (``weight_bytes``); not built on the meta device
    return AutoConfig.for_model(model_type, **d)


def model_presets(include_hybrid: bool = False) -> dict[str, ModelPreset]:
    """The JSON presets under ``lessons/data/models`` by file name: those whose every layer attends to every
    earlier token, and with ``include_hybrid`` also those with sliding-window layers (gpt-oss, Gemma 3:
    lesson 10). Lessons 1-9 compute bytes per token as if every layer kept the whole context, which
    overstates a hybrid model's KV cache at long contexts, so they list only the others.
    Raises ValueError naming a bad file."""
    out = {}
    for path in sorted((DATA / "models").glob("*.json")):
        try:
            d = json.loads(path.read_text())
            preset = ModelPreset(path.stem, d["name"], d["source"], d.get("note", ""), _freeze(d["config"]))
        except (KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path.name}: not a model preset ({exc})") from exc
        if include_hybrid or not is_hybrid(preset):
            out[path.stem] = preset
    return out


def is_hybrid(preset: ModelPreset) -> bool:
    """Whether any layer of the preset's config attends over a sliding window (``layer_types`` /
    ``sliding_window``, read by the engine's ``engine.kv_cache.layer_windows``)."""
    from engine.kv_cache import layer_windows

    return any(w is not None for w in layer_windows(preset.config))


def gpus() -> list[Gpu]:
    d = json.loads((DATA / "gpus.json").read_text())
    return [Gpu(g["name"], g["memory_gb"], g["source"]) for g in d["gpus"]]


def geometry(config, dtype: str):
    """The engine's ``KVGeometry`` for ``config`` stored in ``dtype``. Raises ValueError for another dtype."""
    from engine.model_loader import geometry_from_config

    if dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return geometry_from_config(config, dtype)


def bytes_per_token(config, dtype: str) -> int:
    return geometry(config, dtype).bytes_per_token


@lru_cache(maxsize=32)
def _count_parameters(fields: tuple) -> int:
    import torch

    from engine.model_loader import transformers_api

    AutoModelForCausalLM = transformers_api().AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(fields))
    return sum(p.numel() for p in model.parameters())


def parameter_count(preset: ModelPreset) -> int:
    """Parameters of the preset's architecture, counted on the meta device (tied embeddings once)."""
    return _count_parameters(preset.config_fields)


@dataclass(frozen=True)
class Fit:
    """How a GPU's memory divides up. Bytes, except ``tokens`` and ``requests``."""

    usable_bytes: int      # memory x utilisation
    weight_bytes: int
    kv_bytes: int          # what is left for the KV cache (0 if the weights do not fit)
    tokens: int            # token slots that fit in kv_bytes
    requests: int          # requests of ``context`` tokens each that fit at once

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes <= self.usable_bytes


def gpu_fit(memory_bytes: int, weight_bytes: int, bytes_per_token: int, context_tokens: int,
            utilization: float = VLLM_GPU_MEMORY_UTILIZATION) -> Fit:
    """Requests of ``context_tokens`` tokens whose KV cache fits beside the weights.

    KV budget = memory x utilization - weights (activations and the CUDA context are ignored, so real
    servers fit somewhat fewer). Raises ValueError for a non-positive size or a utilisation outside (0, 1].
    """
    for name, value in (("memory_bytes", memory_bytes), ("bytes_per_token", bytes_per_token),
                        ("context_tokens", context_tokens)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    usable = int(memory_bytes * utilization)
    kv = max(0, usable - weight_bytes)
    tokens = kv // bytes_per_token
    return Fit(usable, weight_bytes, kv, tokens, tokens // context_tokens)


def human_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (KiB = 1,024 B)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:,.0f} {unit}" if value == math.floor(value) else f"{value:,.2f} {unit}"
    return f"{int(n):,} B"


# ------------------------------------------------------------------------------ vLLM's start-up plan (lesson 9)
GIB = 2**30


@dataclass(frozen=True)
class KVPlan:
    """How vLLM turns one GPU into a number of KV blocks at start-up, and what it logs. Bytes unless the name
    says otherwise.

    Sources (vLLM 0.32, the copy installed in ``.peer-venv``):
    - ``vllm/v1/worker/utils.py`` ``request_memory``: requested = ceil(total memory x gpu_memory_utilization);
    - ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``: KV budget = requested - (weights +
      memory outside PyTorch + peak activations of a profile forward pass) - the CUDA graphs' estimate,
      logged as "Available KV cache memory: N GiB";
    - ``vllm/v1/core/kv_cache_utils.py``: num_blocks = budget // bytes per block (block_size x bytes per
      token, summed over layers); ``get_max_concurrency_for_kv_cache_config``: num_blocks / cdiv(max_model_len,
      block_size), since a request takes whole blocks; ``update_kv_cache_capacity`` logs
      "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx" with
      N = int(X x L).
    """

    requested_bytes: int    # ceil(memory x gpu_memory_utilization)
    weight_bytes: int
    activation_bytes: int   # peak activations of the start-up profile run
    other_bytes: int        # memory outside PyTorch (CUDA context, NCCL, cuBLAS) and CUDA graphs
    bytes_per_token: int
    block_size: int         # tokens per block
    max_model_len: int      # tokens per request (prompt + output)

    @property
    def kv_bytes(self) -> int:
        """The KV budget: what is left of the requested memory (0 if nothing is)."""
        return max(0, self.requested_bytes - self.weight_bytes - self.activation_bytes - self.other_bytes)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def num_blocks(self) -> int:
        return self.kv_bytes // self.bytes_per_block

    @property
    def slots(self) -> int:
        """Token slots in all blocks."""
        return self.num_blocks * self.block_size

    @property
    def blocks_per_request(self) -> int:
        """Whole blocks one request of ``max_model_len`` tokens takes (the last may be partly empty)."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens that fit at once (a ratio, as vLLM logs it)."""
        return self.num_blocks / self.blocks_per_request

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's "GPU KV cache size": the tokens whole requests can use, int(max_concurrency x max_model_len)."""
        return int(self.max_concurrency * self.max_model_len)

    def log_lines(self) -> list[str]:
        """The two lines vLLM logs at start-up for this plan (its own wording and rounding)."""
        return [f"Available KV cache memory: {round(self.kv_bytes / GIB, 2)} GiB",
                f"GPU KV cache size: {self.kv_cache_tokens:,} tokens, Maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"]


def plan_kv_cache(memory_bytes: int, weight_bytes: int, bytes_per_token: int, max_model_len: int,
                  block_size: int = 16, utilization: float = VLLM_GPU_MEMORY_UTILIZATION,
                  activation_bytes: int = 0, other_bytes: int = 0) -> KVPlan:
    """vLLM's start-up plan (``KVPlan``) for a GPU of ``memory_bytes``. Raises ValueError for a
    non-positive size or length, negative activation or other memory, or a utilisation outside (0, 1]."""
    for name, value in (("memory_bytes", memory_bytes), ("bytes_per_token", bytes_per_token),
                        ("max_model_len", max_model_len), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("weight_bytes", weight_bytes), ("activation_bytes", activation_bytes),
                        ("other_bytes", other_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return KVPlan(math.ceil(memory_bytes * utilization), weight_bytes, activation_bytes, other_bytes,
                  bytes_per_token, block_size, max_model_len)


# ------------------------------------------------------------------------------ hybrid models (lesson 10)
MXFP4_BITS = 4.25  # MXFP4 (OCP Microscaling): 4-bit values, one 8-bit scale per block of 32 -> 4 + 8/32 bits


@dataclass(frozen=True)
class GroupCost:
    """One KV cache group of a model (``engine.kv_cache.kv_cache_groups``: vLLM's grouping, every group
    with as many layers): its layers, its window (None: full attention) and the bytes one token takes in it,
    2 (K and V) x its layers x KV heads x head_dim x bytes per element."""

    layers: tuple[int, ...]
    sliding_window: int | None
    bytes_per_token: int

    @property
    def kind(self) -> str:
        return "full attention" if self.sliding_window is None else f"sliding window {self.sliding_window:,}"


def group_costs(config, dtype: str) -> list[GroupCost]:
    """The KV cache groups of ``config`` with each one's bytes per token, in the engine's group order.
    Raises ValueError for a dtype outside ``KV_DTYPES`` or a bad ``layer_types`` / ``sliding_window``."""
    from engine.kv_cache import kv_cache_groups

    g = geometry(config, dtype)
    per_layer = 2 * g.num_kv_heads * g.head_dim * g.dtype_bytes
    return [GroupCost(spec.layer_ids, spec.sliding_window, per_layer * len(spec.layer_ids))
            for spec in kv_cache_groups(config)]


def weight_bytes(preset: ModelPreset) -> int:
    """Bytes of the preset's weights as they ship: parameters (counted on the meta device) x the config
    dtype's bytes, except, with an MXFP4 ``quantization_config`` (gpt-oss), the experts' weight matrices
    (``.mlp.experts.`` parameters other than biases) at ``MXFP4_BITS`` bits each (rounded up to a byte)."""
    fields = dict(preset.config_fields)
    dtype_bytes = geometry(preset.config, preset.dtype).dtype_bytes
    quant = _thaw_value(fields.get("quantization_config")) or {}
    if quant.get("quant_method") != "mxfp4":
        return parameter_count(preset) * dtype_bytes
    total, experts = _count_expert_parameters(preset.config_fields)
    return (total - experts) * dtype_bytes + math.ceil(experts * MXFP4_BITS / 8)


@lru_cache(maxsize=8)
def _count_expert_parameters(fields: tuple) -> tuple[int, int]:
    """(all parameters, the experts' weight-matrix parameters) of the config, counted on the meta device."""
    import torch

    from engine.model_loader import transformers_api

    with torch.device("meta"):
        model = transformers_api().AutoModelForCausalLM.from_config(_config(fields))
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".mlp.experts." in name and not name.endswith("bias"):
            experts += p.numel()
    return total, experts


@dataclass(frozen=True)
class HybridFit:
    """Requests of ``context_tokens`` tokens that fit on a GPU, for a hybrid model and for its
    all-full-attention twin (the same KV cache groups and block bytes, every layer keeping the whole
    context). Bytes, except the counts."""

    kv_bytes: int               # the KV budget, as ``gpu_fit`` computes it (lesson 1's convention)
    page_bytes: int             # one block: block_size tokens of one group's layers (vLLM's page size)
    num_blocks: int             # kv_bytes // page_bytes
    blocks_per_request: int     # a hybrid request's blocks, every group together
    twin_blocks_per_request: int
    requests: int               # num_blocks // blocks_per_request
    twin_requests: int


def hybrid_fit(memory_bytes: int, weight_bytes: int, config, dtype: str, context_tokens: int,
               block_size: int = 16, utilization: float = VLLM_GPU_MEMORY_UTILIZATION) -> HybridFit:
    """How many requests holding ``context_tokens`` tokens each (all computed) fit at once.

    The budget is lesson 1's (``gpu_fit``: memory x utilization - weights; activations ignored). It is cut
    into blocks of one page: ``block_size`` tokens of the layers of one KV cache group (every group has as
    many layers, and every group draws its blocks from the one pool: vLLM's ``get_kv_cache_config_from_groups``,
    the engine's ``engine.kv_cache.page_bytes``). The twin's request takes ``ceil(context / block_size)``
    blocks in every group; the hybrid one takes ``engine.metrics.hybrid_blocks_saved`` fewer (the blocks its
    sliding-window groups gave back). vLLM's start-up "maximum concurrency" is lower for the hybrid model:
    it budgets a sliding group for a whole prompt chunk in flight (``SlidingWindowSpec.
    max_admission_blocks_per_request``), not for a decoding request. Raises ValueError as ``gpu_fit``."""
    from engine.kv_cache import kv_cache_groups, page_bytes
    from engine.metrics import blocks_for, hybrid_blocks_saved

    groups = kv_cache_groups(config)
    g = geometry(config, dtype)
    kv = gpu_fit(memory_bytes, weight_bytes, g.bytes_per_token, context_tokens, utilization).kv_bytes
    page = page_bytes(g, block_size, groups)
    twin = len(groups) * blocks_for(context_tokens, block_size)
    hybrid = twin - hybrid_blocks_saved(context_tokens, block_size, [s.sliding_window for s in groups])
    n = kv // page
    return HybridFit(kv, page, n, hybrid, twin, n // hybrid, n // twin)
