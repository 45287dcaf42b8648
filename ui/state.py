"""Streamlit glue: the shared read-only model (``lessons.runs.shared_model``: loaded once per process, its
progress shown the first time) and each session's ``Lab``."""

from __future__ import annotations

import streamlit as st

from engine import EMBEDDED_MODEL
from lessons import runs

from .lab import POLICY_LABELS, Lab, LabSettings, count_only_tokenizer


def shared_model(model: str):
    """(model, tokenizer), loaded once per process and shared read-only by every session and the lessons
    (``lessons.runs.shared_model``: ``engine.model_loader.load_shared`` with a progress box on first load)."""
    return runs.shared_model(model)


def get_lab() -> Lab | None:
    return st.session_state.get("lab")


def build_lab(settings: LabSettings) -> bool:
    """Replace the session's lab; on bad settings show the error and keep the previous lab."""
    try:
        loaded = shared_model(settings.model)
        if Lab.needs_final_lengths(settings):  # a whole headless run first: seconds, so its progress is shown
            with runs.ProgressBox("Learning each request's final length first: the "
                                  f"{POLICY_LABELS.get(settings.contiguous_policy, settings.contiguous_policy)} "
                                  "policy reserves by it") as box:
                lab = Lab.create(settings, loaded, on_step=learning_progress(settings, box))
        else:
            lab = Lab.create(settings, loaded)  # builds two engines: well under a second
    except ValueError as exc:
        st.session_state["lab_error"] = str(exc)
        return False
    st.session_state["lab"] = lab
    st.session_state["lab_generation"] = st.session_state.get("lab_generation", 0) + 1  # a fresh settings form
    st.session_state["cursor"] = -1  # -1: follow the latest step
    st.session_state["playing"] = False  # a new run starts paused: Play on a preset nobody has seen yet surprises
    st.session_state.pop("lab_error", None)
    return True


def learning_progress(settings: LabSettings, box: runs.ProgressBox):
    """An ``on_step`` for ``Lab.create``'s headless paged run of the preset: its steps and tokens in ``box``."""
    from engine.scenarios import get_scenario

    requests = get_scenario(settings.preset).make(settings.seed, count_only_tokenizer).requests
    total = sum(r.params.max_tokens * r.params.num_seqs for r in requests)
    state = {"step": 0, "tokens": 0}

    def on_step(record) -> None:
        state["step"] += 1
        state["tokens"] += len(record.new_tokens)
        box(runs.Progress(f"Running {settings.preset} on a paged engine (the paper's scheduler)",
                          state["tokens"] / total if total else 0.0,
                          runs.token_detail(state["step"], state["tokens"], total, known=False)))
    return on_step


def preset_settings(preset: str, model: str = EMBEDDED_MODEL, **overrides) -> LabSettings:
    """Settings for a preset with the engine settings it needs (block size, pool, lengths, reservation,
    preemption, prefix caching, contiguous policy, watermark; None: the semantics' default), then
    ``overrides`` (``LabSettings`` fields, e.g. ``semantics="v1"``).
    The one path from a preset to engine settings: the Playground, Compare and the lessons' "Open this in
    the Playground" all use it. Raises ValueError for an unknown preset or field."""
    from engine.scenarios import get_scenario

    d = get_scenario(preset).engine_defaults
    fields = dict(block_size=d.get("block_size", 16), num_blocks=d.get("num_blocks", 64),
                  max_model_len=d.get("max_model_len", 256),
                  reservation=d.get("reservation_tokens", d.get("max_model_len", 256)),
                  preemption_mode=d.get("preemption_mode", "recompute"), swap_space_blocks=d.get("swap_space_blocks"),
                  enable_prefix_caching=d.get("enable_prefix_caching", True),
                  contiguous_policy=d.get("contiguous_policy", "max"), watermark=d.get("watermark"),
                  semantics=d.get("semantics", "paper"), scheduling_policy=d.get("scheduling_policy", "fcfs"),
                  max_num_batched_tokens=d.get("max_num_batched_tokens"))
    unknown = set(overrides) - set(LabSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown Playground setting(s): {', '.join(sorted(unknown))}")
    fields.update(overrides)
    return LabSettings(model=model, preset=preset, **fields)


def default_settings() -> LabSettings:
    """The "batch" preset with its own pool (12 blocks of 16): too small for all six requests, so the
    first minutes in class already show preemption."""
    return preset_settings("batch")
