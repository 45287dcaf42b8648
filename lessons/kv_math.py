"""KV cache sizes from model configs, and how many requests fit on a GPU (lesson 1). No Streamlit.

Bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element (Kwon et al., SOSP 2023,
section 2.2), computed by the engine's own ``KVGeometry`` from a transformers config. Config presets of
well-known models live in ``lessons/data/models/*.json`` with the URL of the config.json they copy;
parameter counts are not typed in but counted by building the model on PyTorch's "meta" device (no memory,
no download).
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


def _freeze(d: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


@lru_cache(maxsize=None)
def _config(fields: tuple):
    from engine.model_loader import transformers_api

    AutoConfig = transformers_api().AutoConfig
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in fields}
    model_type = d.pop("model_type")
    d.pop("architectures", None)
    d.pop("torch_dtype", None)
    return AutoConfig.for_model(model_type, **d)


def model_presets() -> dict[str, ModelPreset]:
    """Every JSON preset under ``lessons/data/models`` by file name. Raises ValueError naming a bad file."""
    out = {}
    for path in sorted((DATA / "models").glob("*.json")):
        try:
            d = json.loads(path.read_text())
            out[path.stem] = ModelPreset(path.stem, d["name"], d["source"], d.get("note", ""), _freeze(d["config"]))
        except (KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path.name}: not a model preset ({exc})") from exc
    return out


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
