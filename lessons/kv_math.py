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
