"""Paged Attention Lab's engine: a real transformers model served from a paged KV block pool.

Public API (names follow vLLM): ``EngineConfig``, ``SamplingParams``, ``LLMEngine``, ``RequestOutput``,
``StepRecord`` (with ``Event``, ``Snapshot``, ``SequenceState``), ``BlockManager`` (usable without a model),
``write_trace`` / ``read_trace``, ``KVGeometry`` and ``EMBEDDED_MODEL``.

The engine never imports Streamlit or Plotly; viewers read ``StepRecord`` data only.
"""

from .block_manager import BlockManager, NoFreeBlocksError
from .config import EMBEDDED_MODEL, EngineConfig, SamplingParams
from .llm_engine import LLMEngine
from .model_loader import KVGeometry, ModelLoadError
from .records import Event, ScheduledSequence, SequenceState, Snapshot, StepRecord, read_trace, write_trace
from .sequence import CompletionOutput, RequestOutput


__all__ = [
    "BlockManager", "EMBEDDED_MODEL", "EngineConfig", "Event", "KVGeometry", "LLMEngine", "ModelLoadError",
    "NoFreeBlocksError", "CompletionOutput", "RequestOutput", "SamplingParams", "ScheduledSequence", "SequenceState", "Snapshot",
    "StepRecord", "read_trace", "write_trace",
]
