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


def default_settings() -> LabSettings:
    """The "batch" preset with its own pool (12 blocks of 16): too small for all six requests, so the
    first minutes in class already show preemption."""
    from engine.scenarios import SCENARIOS

    d = SCENARIOS["batch"].engine_defaults
    return LabSettings(model=EMBEDDED_MODEL, preset="batch", block_size=d["block_size"], num_blocks=d["num_blocks"],
                       max_model_len=d["max_model_len"], reservation=d["max_model_len"])
