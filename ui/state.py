"""Streamlit glue: the shared read-only model (``st.cache_resource``) and each session's ``Lab``."""

from __future__ import annotations

import streamlit as st

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model, resolve_device, resolve_dtype

from .lab import Lab, LabSettings


@st.cache_resource(show_spinner="Loading the model...")
def shared_model(model: str):
    """(model, tokenizer), loaded once per process and shared read-only by every session."""
    device = resolve_device("auto")
    return load_model(model, device, resolve_dtype(None, device))


def get_lab() -> Lab | None:
    return st.session_state.get("lab")


def build_lab(settings: LabSettings) -> bool:
    """Replace the session's lab; on bad settings show the error and keep the previous lab."""
    try:
        lab = Lab.create(settings, shared_model(settings.model))
    except ValueError as exc:
        st.session_state["lab_error"] = str(exc)
        return False
    st.session_state["lab"] = lab
    st.session_state["cursor"] = -1  # -1: follow the latest step
    st.session_state.pop("lab_error", None)
    return True


def preset_settings(preset: str, model: str = EMBEDDED_MODEL, **overrides) -> LabSettings:
    """Settings for a preset with the pool settings it needs (block size, pool, lengths, preemption), then
    ``overrides`` (``LabSettings`` fields). Raises ValueError for an unknown preset or field."""
    from engine.scenarios import get_scenario

    d = get_scenario(preset).engine_defaults
    fields = dict(block_size=d.get("block_size", 16), num_blocks=d.get("num_blocks", 64),
                  max_model_len=d.get("max_model_len", 256),
                  reservation=d.get("reservation_tokens", d.get("max_model_len", 256)),
                  preemption_mode=d.get("preemption_mode", "recompute"), swap_space_blocks=d.get("swap_space_blocks"),
                  enable_prefix_caching=d.get("enable_prefix_caching", True))
    unknown = set(overrides) - set(LabSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown Playground setting(s): {', '.join(sorted(unknown))}")
    fields.update(overrides)
    return LabSettings(model=model, preset=preset, **fields)


def default_settings() -> LabSettings:
    """The "batch" preset with its own pool (12 blocks of 16): too small for all six requests, so the
    first minutes in class already show preemption."""
    return preset_settings("batch")
