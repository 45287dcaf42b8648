"""Paged Attention Lab's engine: a real transformers model served from a paged KV block pool.

Public API (names follow vLLM): ``EngineConfig``, ``SamplingParams``, ``LLMEngine``, ``RequestOutput``,
``StepRecord`` (with ``Event``, ``Snapshot``, ``SequenceState``), ``BlockManager`` (usable without a model),
``write_trace`` / ``read_trace``, ``KVGeometry`` and ``EMBEDDED_MODEL``.

The engine never imports Streamlit or Plotly; viewers read ``StepRecord`` data only. The names that
need torch (``LLMEngine``, ``KVGeometry``, ``ModelLoadError``, the outputs) are imported on first use, so
``engine.records`` and ``engine.metrics`` stay importable by figures that must not import torch.
"""

from importlib import import_module

from .block_manager import BlockManager, NoFreeBlocksError
from .config import EMBEDDED_HYBRID_MODEL, EMBEDDED_MODEL, EngineConfig, SamplingParams
from .records import Event, ScheduledSequence, SequenceState, Snapshot, StepRecord, read_trace, write_trace

_LAZY = {"LLMEngine": "llm_engine", "KVGeometry": "model_loader", "ModelLoadError": "model_loader",
         "CompletionOutput": "sequence", "RequestOutput": "sequence"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockManager", "EMBEDDED_HYBRID_MODEL", "EMBEDDED_MODEL", "EngineConfig", "Event", "KVGeometry", "LLMEngine", "ModelLoadError",
    "NoFreeBlocksError", "CompletionOutput", "RequestOutput", "SamplingParams", "ScheduledSequence", "SequenceState", "Snapshot",
    "StepRecord", "read_trace", "write_trace",
]
