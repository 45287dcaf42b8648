"""The class server's Streamlit side (``engine/limits.py`` holds its numbers and its checks): the locked
model field, the per-session memory check before a lab is built, the note when old steps were dropped,
and the release of idle sessions' labs. Outside class mode (``PAL_CLASS_SERVER`` unset) every function
here does what the app did before (the model field is a free text field) or nothing.

Idle sessions. Streamlit keeps a session's ``st.session_state`` (and so its lab: two engines with their KV
pools, and the recorded steps) for as long as the browser tab stays open, and for
``server.disconnectedSessionTTL`` (120 s) after it closes. An open tab nobody looks at would hold its
memory all day, so a process-wide registry (``seat_registry``, in ``st.cache_resource``, the pattern of
``ui/server.py``'s ``live_registry`` / ``sweep``) keeps one ``Seat`` per browser session: its lab and when
it was last active. Every script run of any session (``keep_session``, called by ``app.py`` before the
page) touches its own seat and sweeps the others: a seat idle for more than ``ClassLimits.idle_minutes``
has its lab released (``Lab.release``: the engines are dropped, so their memory is freed at once, not
when the tab closes); a seat whose session is gone is forgotten (Streamlit frees that session's state
itself). A lab that steps on its own (Play runs in a fragment, which does not re-run ``app.py``) counts
as active: the sweep compares each lab's steps and presses with what it saw last. The released session,
when its learner comes back, finds a note and a fresh lab.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import streamlit as st

from engine import EMBEDDED_MODEL
from engine.limits import ClassLimits, check_session_bytes, class_limits

from .lab import Lab, LabSettings, fit_semantics

RELEASED_NOTE = ("Your Playground run was released after {minutes:g} idle minutes, to free memory for the "
                 "class; a fresh run has started with the default settings.")


# ------------------------------------------------------------------------------------------ the model field
def model_input(current: str, key: str) -> str:
    """The Playground's model field: a free text field (embedded model, local folder or hub id) outside class
    mode; on a class server a choice of the models it serves (``ClassLimits.model_choices``), so no other
    model can even be typed. Returns the model (an emptied text field: the embedded model)."""
    limits = class_limits()
    if limits is None:
        model = st.text_input("Model (embedded default, local path or hub id)", current, key=key,
                              help="Leave it empty for the embedded model") or ""
        return model.strip() or EMBEDDED_MODEL  # an emptied field means the default its label names
    from engine.limits import resolved_model_path

    choices = list(limits.model_choices())
    now = resolved_model_path(current)
    return st.selectbox("Model (this class server's list)", choices, index=choices.index(now) if now in choices
                        else 0, key=key, format_func=lambda m: "embedded tiny model" if m == choices[0] else m,
                        help="A class server loads the embedded model and the folders its operator lists "
                             "(PAL_ALLOWED_MODELS); see docs/deploy.md.")


# ------------------------------------------------------------------------------------------ the sizes
def session_bytes(settings: LabSettings, loaded) -> dict[str, int]:
    """The KV bytes a lab with ``settings`` allocates, by part: the paged pool, its CPU swap pool, the
    contiguous baseline's region (the pool's bytes again) and, under "pow2" / "oracle", the headless paged
    run that learns the final lengths first (freed after, but held while the others exist).
    ``loaded``: the shared ``(model, tokenizer)``, for the KV geometry. Sizes as ``LLMEngine`` computes
    them (``_pool_blocks``, ``_swap_pool_blocks``); nothing is allocated."""
    from engine.kv_cache import num_blocks_for_budget
    from engine.model_loader import geometry_from_config, resolve_device, resolve_dtype

    settings, _ = fit_semantics(settings)
    config = settings.config("paged")
    geometry = geometry_from_config(loaded[0].config, resolve_dtype(config.dtype, resolve_device(config.device)))
    per_block = geometry.bytes_per_block(config.block_size)
    blocks = (config.num_blocks if config.num_blocks is not None
              else num_blocks_for_budget(config.kv_budget_bytes, geometry, config.block_size))
    swap = config.swap_space_blocks if config.swap_space_blocks is not None else (
        blocks if config.preemption_mode == "swap" else 0)
    parts = {"paged pool": blocks * per_block, "swap pool": swap * per_block,
             "contiguous region": blocks * per_block}
    if Lab.needs_final_lengths(settings):
        parts["final-length run"] = (blocks + swap) * per_block
    return parts


def check_sizes(settings: LabSettings, loaded) -> None:
    """On a class server, refuse settings whose lab would allocate more than one session's share of the
    memory (``engine.limits.check_session_bytes``), before anything is allocated; the caps of each field
    are checked when the engines' ``EngineConfig`` is built. Outside class mode: nothing. Raises ValueError
    naming the parts, their sizes and the budget."""
    limits = class_limits()
    if limits is not None:
        check_session_bytes(session_bytes(settings, loaded), limits)


# ------------------------------------------------------------------------------------------ history
def history_note(lab: Lab) -> None:
    """Say on the page that old steps were dropped (``Lab.history_note``), when they were."""
    note = lab.history_note()
    if note:
        st.info(note, icon=":material/history:")


# ------------------------------------------------------------------------------------------ idle sessions
@dataclass
class Seat:
    """One browser session on a class server: its lab, when it was last active (monotonic s) and the lab's
    activity (``_activity``) the last sweep saw."""

    touched: float
    lab: Lab | None = None
    seen: tuple | None = None


@st.cache_resource
def seat_registry() -> dict:
    """Process-wide: browser session id -> its ``Seat``, and a lock; read by ``sweep``."""
    return {"lock": threading.Lock(), "seats": {}}


def session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def _activity(lab: Lab | None) -> tuple | None:
    """What changes whenever a lab is used, even without a script run of ``app.py`` (Play's fragment)."""
    return None if lab is None else (lab.token, lab.steps_run, lab.presses, lab.cursor, lab.playing)


def keep_session(now: float | None = None) -> None:
    """Every script run on a class server, before the page: if this session's lab was released while it
    was idle, drop it (the page builds a fresh one) and say so; touch this session's seat; sweep the others
    (``sweep``). Outside class mode: nothing."""
    limits = class_limits()
    if limits is None:
        return
    now = time.monotonic() if now is None else now
    registry = seat_registry()
    with registry["lock"]:  # a sweep releases under this lock: after the touch, this run's lab stays
        lab = st.session_state.get("lab")
        released = lab is not None and lab.paged is None  # released by a sweep (``Lab.release``)
        if released:
            del st.session_state["lab"]
            lab = None
        seat = registry["seats"].setdefault(session_id(), Seat(now))
        seat.touched, seat.lab, seat.seen = now, lab, _activity(lab)
    if released:
        st.info(RELEASED_NOTE.format(minutes=limits.idle_minutes), icon=":material/hourglass_disabled:")
    sweep(limits, now)


def touch_seat() -> None:
    """This session is active (a run of the Playground's stage: a fragment, where ``keep_session`` in app.py does
    not run). Outside class mode, or before the session has a seat: nothing."""
    if class_limits() is None:
        return
    registry = seat_registry()
    with registry["lock"]:  # the sweep reads the seats under it: after this, this session's lab stays
        seat = registry["seats"].get(session_id())
        if seat is not None:
            seat.touched = time.monotonic()


def seat_lab(lab: Lab) -> None:
    """Register the lab this session just built (``ui.state.build_lab``), so the sweep can release it."""
    if class_limits() is None:
        return
    registry = seat_registry()
    now = time.monotonic()
    with registry["lock"]:
        seat = registry["seats"].setdefault(session_id(), Seat(now))
        seat.touched, seat.lab, seat.seen = now, lab, _activity(lab)


def _gone_sessions(ids) -> set[str]:
    """The session ids the Streamlit runtime no longer serves (none without a runtime: AppTest, bare)."""
    try:
        from streamlit.runtime import Runtime

        runtime = Runtime.instance() if Runtime.exists() else None
    except Exception:  # noqa: BLE001  no runtime: nothing is known to be gone
        runtime = None
    return set() if runtime is None else {sid for sid in ids if not runtime.is_active_session(sid)}


def sweep(limits: ClassLimits, now: float | None = None) -> list[str]:
    """Release the labs of seats idle for more than ``limits.idle_minutes`` (``Lab.release``) and forget the
    seats of sessions that are gone. Returns the session ids whose labs were released."""
    now = time.monotonic() if now is None else now
    registry = seat_registry()
    released = []
    with registry["lock"]:
        seats = registry["seats"]
        for sid in _gone_sessions(list(seats)):
            seats.pop(sid)  # Streamlit frees the session's state itself after its TTL
        for sid, seat in list(seats.items()):
            activity = _activity(seat.lab)
            if activity != seat.seen:  # it stepped since the last look (Play in a fragment)
                seat.seen, seat.touched = activity, now
            if now - seat.touched > limits.idle_minutes * 60:
                seats.pop(sid)
                if seat.lab is not None:
                    seat.lab.release(f"released after {limits.idle_minutes:g} idle minutes")
                    released.append(sid)
    return released
