"""The class server's Streamlit side (``infra/class_limits.py`` holds its numbers and its checks): the locked
model field, the per-session memory charge before a lab is built (``session_plan``: everything the lab will
keep, refused or its recorded steps capped) within the share the session reserves first in the server-wide
registry (``check_sizes``, ``infra.class_limits.ShareRegistry``: all sessions of all workers together never reserve
more than the server's memory for sessions), the note when old steps were dropped, and the release of idle
and closed sessions' labs, which gives their shares back (``sweep``; it also renews the reservations of the
sessions still seated, so that only a dead worker's expire). Outside class mode (``PAL_CLASS_SERVER`` unset)
every function here does what the app did before (the model field is a free text field) or nothing.

Closed tabs. When a tab closes, Streamlit keeps its session (and so its lab) for
``server.disconnectedSessionTTL`` (120 s) in case the browser reconnects, and drops it only when a later
connection or disconnection happens to expire it; nothing told the app. The issue measured it: a valid link
grew a worker by ~900 MiB, not given back when its tab closed. So a reaper thread (``start_reaper``) sweeps
every ``REAP_INTERVAL_S``: a seat whose session the runtime no longer serves (``Runtime.is_active_session``)
for ``ClassLimits.closed_seconds`` (10 s) has its lab released, and the freed memory is handed back to the
operating system (``free_memory``: ``gc.collect`` then glibc's ``malloc_trim(0)``). A tab that reconnects
later finds a note and a fresh lab, as after an idle release. Nothing else keeps a lab: the registry below
holds it only while its session is served, the lessons' and Compare's shared runs (``infra.runs``) are
their own, and a link's replay (``ui.scenario_io.run_steps``) returns to Streamlit at least twice a second,
where Streamlit stops a closed tab's script run.

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

import ctypes
import gc
import logging
import threading
import time
from dataclasses import dataclass

import streamlit as st

from engine import EMBEDDED_HYBRID_MODEL, EMBEDDED_MODEL
from engine.config import resolved_model_path
from infra.class_limits import (NO_SHARE_FREE, ClassLimits, SessionPlan, check_session_bytes, class_limits, plan_session,
                           session_budget_bytes, share_registry)

from engine.scenarios.run_spec import RunSpec

from .lab import Lab, fit_semantics, run_sizes

RELEASED_NOTE = ("Your Playground run was {why}, to free memory for the class; a fresh run has started with "
                 "the default settings.")


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
    choices = list(limits.model_choices())
    now = resolved_model_path(current)
    return st.selectbox("Model (this class server's list)", choices, index=choices.index(now) if now in choices
                        else 0, key=key, format_func=lambda m: EMBEDDED_NAMES.get(m, m),
                        help="A class server loads the embedded model and the folders its operator lists "
                             "(PAL_ALLOWED_MODELS); see docs/deploy.md.")


# the shipped models by name (as ``model_choices`` lists them, resolved); the operator's folders by their paths
EMBEDDED_NAMES = {resolved_model_path(EMBEDDED_MODEL): "embedded tiny model",
                  resolved_model_path(EMBEDDED_HYBRID_MODEL): "embedded tiny hybrid model (hybrid-window)"}


# ------------------------------------------------------------------------------------------ the sizes
def session_bytes(settings: RunSpec, loaded) -> dict[str, int]:
    """``_pool_bytes``'s parts (the KV bytes a lab with ``settings`` allocates, by part)."""
    return _pool_bytes(settings, loaded)[0]


def _pool_bytes(settings: RunSpec, loaded) -> tuple[dict[str, int], int, int]:
    """The KV bytes a lab with ``settings`` allocates, by part: the paged pool, its CPU swap pool, the
    contiguous baseline's region (the pool's bytes again) and, under "pow2" / "oracle", the headless paged
    run that learns the final lengths first (freed after, but held while the others exist).
    ``loaded``: the shared ``(model, tokenizer)``, for the KV geometry. Sizes as ``LLMEngine`` computes
    them (``_pool_blocks``, ``_swap_pool_blocks``); nothing is allocated. Returns (parts, pool blocks, swap
    blocks)."""
    from engine.kv_cache import num_blocks_for_budget
    from engine.model_loader import geometry_from_config, resolve_device, resolve_dtype

    settings, _ = fit_semantics(settings)
    config = settings.engine_config("paged")
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
    return parts, blocks, swap


def settings_requests(settings: RunSpec) -> list[tuple]:
    """The (prompt, SamplingParams) pairs a lab with ``settings`` queues, read without the model: a preset's
    requests (prompts as text), a scenario file's (text or token ids); none for "custom" without a file."""
    from engine.scenarios.presets import get_scenario

    from engine.scenarios.run_spec import count_only_tokenizer

    if settings.preset != "custom":
        return [(r.prompt, r.params) for r in get_scenario(settings.preset).make(settings.seed,
                                                                                 count_only_tokenizer).requests]
    if settings.scenario is None:
        return []
    return [(r.prompt_token_ids if r.prompt_token_ids is not None else r.prompt, r.sampling_params())
            for r in settings.scenario.requests]


def session_plan(settings: RunSpec, loaded, budget: int | None = None) -> SessionPlan:
    """What a lab with ``settings`` would keep, charged to one session's share (``infra.class_limits.plan_session``):
    its KV pools (``session_bytes``), the engines' state and recorded steps for its requests
    (``settings_requests``) and Streamlit's session; the recorded steps kept are capped to what fits. Nothing is
    allocated. Raises ValueError naming every part when even the fewest steps do not fit."""
    limits = class_limits()
    parts, blocks, swap = _pool_bytes(settings, loaded)
    fitted, _ = fit_semantics(settings)
    engines = 1 + (parts.get("contiguous region", 0) > 0)
    sizes = run_sizes(fitted, settings_requests(fitted), blocks, swap, engines)
    return plan_session(parts, sizes, limits, budget)


PLAN_KEY = "class_memory_plan"  # the plan check_sizes made, for seat_lab: at the share this session reserved


def check_sizes(settings: RunSpec, loaded) -> None:
    """On a class server, refuse settings whose lab would keep more than one session's share of the memory
    (``session_plan``: the KV pools, the engines' state, the page and the fewest recorded steps), before
    anything is allocated, and reserve the share in the server-wide registry (``infra.class_limits.share_registry``:
    the reservations of all sessions on all workers never add up to more than the server's memory for
    sessions); the run is planned within what was reserved. The caps of each field are checked when the
    engines' ``EngineConfig`` is built. Outside class mode: nothing. Raises ValueError naming the parts, their
    sizes and the share, or (``NoShareFree``) how much is free and how many seats are held."""
    limits = class_limits()
    if limits is None:
        return
    share = session_budget_bytes(limits)
    check_session_bytes(session_bytes(settings, loaded), limits, budget=share)  # the pools alone, named as before
    plan = session_plan(settings, loaded, budget=share)
    granted = share_registry().reserve(session_id(), share, plan.minimum, limits)
    if granted != share:  # less was free, or more held already: the steps kept fit what is reserved
        plan = session_plan(settings, loaded, budget=granted)
    st.session_state[PLAN_KEY] = plan


RETRY_NOTE = ("Press **Try again** to ask for a seat again: the Playground opens as soon as one is free (the "
              "rest of this page waits until then; reloading the page does the same).")


def lab_refused(message: str | None, key: str) -> bool:
    """Say why this session's lab was not built (``build_lab``'s ``lab_error``). When it was refused because no
    share of the server's memory is free (``infra.class_limits.NoShareFree``), also say how to retry and offer a
    "Try again" button: pressing it reruns the page, which asks for a share again (before, the page was a
    dead end until reloaded: nothing on it rerun the script). Returns whether the button was pressed."""
    if message and message.startswith(NO_SHARE_FREE):
        st.error(f"{message}\n\n{RETRY_NOTE}")
        return st.button("Try again", key=key, type="primary", icon=":material/refresh:")
    st.error(message)
    return False


# ------------------------------------------------------------------------------------------ history
def history_note(lab: Lab) -> None:
    """Say on the page that old steps were dropped (``Lab.history_note``), when they were."""
    note = lab.history_note()
    if note:
        st.info(note, icon=":material/history:")


# ------------------------------------------------------------------------------------------ idle sessions
@dataclass
class Seat:
    """One browser session on a class server: its lab, when it was last active (monotonic s), the lab's
    activity (``_activity``) the last sweep saw, and since when its browser is gone (monotonic s; None while
    connected)."""

    touched: float
    lab: Lab | None = None
    seen: tuple | None = None
    gone_since: float | None = None


@st.cache_resource
def seat_registry() -> dict:
    """Process-wide: browser session id -> its ``Seat``, and a lock; read by ``sweep``. Its ``reaper`` thread
    (``start_reaper``) sweeps every ``REAP_INTERVAL_S`` seconds."""
    return {"lock": threading.Lock(), "seats": {}, "reaper": None}


REAP_INTERVAL_S = 2.0


def start_reaper(registry: dict) -> None:
    """Start the process's sweeping thread once (``sweep`` every ``REAP_INTERVAL_S``): a closed tab's lab is
    released ``ClassLimits.closed_seconds`` after its browser left, and an idle one after ``idle_minutes``,
    whether or not any other session runs a script meanwhile."""
    with registry["lock"]:
        if registry["reaper"] is not None and registry["reaper"].is_alive():
            return

        def reap() -> None:
            while True:
                time.sleep(REAP_INTERVAL_S)
                try:
                    limits = class_limits()
                    if limits is not None:
                        sweep(limits, registry=registry)
                except Exception:  # noqa: BLE001 - a bad environment value: said on the page; keep sweeping
                    logging.getLogger(__name__).exception("class server: sweep failed")

        registry["reaper"] = threading.Thread(target=reap, name="pal-class-reaper", daemon=True)
        registry["reaper"].start()


def free_memory() -> int:
    """After labs were released: collect their cycles and hand the heap's free pages back to the operating
    system (glibc's ``malloc_trim(0)``: without it, glibc keeps freed small allocations, Python's arenas and
    the pools' smaller tensors mapped, and the process's RSS never shrinks). Returns the objects collected."""
    collected = gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to trim
        return collected
    libc.malloc_trim(0)
    return collected


def session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no-session"


def _activity(lab: Lab | None) -> tuple | None:
    """What changes whenever a lab is used, even without a script run of ``app.py`` (Play's fragment)."""
    return None if lab is None else (lab.protocol.token, lab.steps_run, lab.protocol.handled, lab.player.cursor, lab.player.playing)


def keep_session(now: float | None = None) -> None:
    """Every script run on a class server, before the page: if this session's lab was released while it
    was idle, drop it (the page builds a fresh one) and say so; touch this session's seat; sweep the others
    (``sweep``). Outside class mode: nothing."""
    limits = class_limits()
    if limits is None:
        return
    now = time.monotonic() if now is None else now
    registry = seat_registry()
    with registry["lock"]:  # a sweep decides under this lock, and skips a lab whose session touched it since
        lab = st.session_state.get("lab")
        released = lab is not None and lab.run.paged is None  # released by a sweep (``Lab.release``)
        if released:
            why = lab.run.failure or f"released after {limits.idle_minutes:g} idle minutes"
            del st.session_state["lab"]
            lab = None
        seat = registry["seats"].setdefault(session_id(), Seat(now))
        seat.touched, seat.lab, seat.seen = now, lab, _activity(lab)
    if released:
        st.info(RELEASED_NOTE.format(why=why), icon=":material/hourglass_disabled:")
    start_reaper(registry)
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
    """Register the lab this session just built (``ui.state.build_lab``), so the sweep can release it, and
    charge its run to the session's share (``Lab.plan_memory``, at the share ``check_sizes`` reserved before
    allocating): it keeps at most the recorded steps that fit."""
    if class_limits() is None:
        return
    checked = st.session_state.pop(PLAN_KEY, None)
    kv = session_bytes(lab.run.settings, (lab.run.paged.model, lab.run.paged.tokenizer))
    reserved = share_registry().held(session_id())
    lab.plan_memory(kv, checked.budget if checked is not None else (reserved or None))
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


def sweep(limits: ClassLimits, now: float | None = None, registry: dict | None = None,
          gone: set[str] | None = None) -> list[str]:
    """Release the labs of seats idle for more than ``limits.idle_minutes``, and of sessions whose browser has
    been gone (its tab closed, its websocket dropped) for ``limits.closed_seconds`` (``Lab.release``), and
    forget those seats; then give the freed memory back (``free_memory``). Streamlit keeps a closed tab's
    session, and so its lab, for ``server.disconnectedSessionTTL`` (120 s) in case it reconnects, and drops
    it only when a later connection happens to expire it: this does not wait for either. A session that
    comes back after its lab was released gets a fresh one and a note (``keep_session``).

    ``gone``: the session ids the runtime no longer serves (default: asked of Streamlit's runtime).
    Returns the session ids whose labs were released."""
    now = time.monotonic() if now is None else now
    registry = seat_registry() if registry is None else registry
    leaving = []
    with registry["lock"]:
        seats = registry["seats"]
        gone = _gone_sessions(list(seats)) if gone is None else gone
        for sid, seat in list(seats.items()):
            if sid not in gone:
                seat.gone_since = None  # (re)connected
            elif seat.gone_since is None:
                seat.gone_since = now
            activity = _activity(seat.lab)
            if activity != seat.seen:  # it stepped since the last look (Play in a fragment)
                seat.seen, seat.touched = activity, now
            closed = seat.gone_since is not None and now - seat.gone_since >= limits.closed_seconds
            if closed or now - seat.touched > limits.idle_minutes * 60:
                seats.pop(sid)
                leaving.append((sid, seat.lab, f"released {limits.closed_seconds:g} s after its tab closed" if closed
                                else f"released after {limits.idle_minutes:g} idle minutes"))
                seat.lab = None
    # outside the registry's lock: a release waits for its lab's step in progress, and no other session's
    # touch should wait for that (a session touching its seat meanwhile gets a fresh one)
    released = []
    for sid, lab, why in leaving:
        with registry["lock"]:
            back = registry["seats"].get(sid)
        if lab is None or lab.run.paged is None or (back is not None and back.lab is lab):  # came back meanwhile
            continue
        lab.release(why)
        released.append(sid)
    shares = share_registry()
    for sid, _, _ in leaving:  # its share goes back to the class (a session that came back keeps its own)
        with registry["lock"]:
            back = registry["seats"].get(sid)
        if back is None or back.lab is None:
            shares.release(sid)
    with registry["lock"]:
        seated = [sid for sid, seat in registry["seats"].items() if seat.lab is not None]
    shares.renew(seated)  # a live worker's reservations never expire (infra.class_limits.LEASE_S)
    if released:
        free_memory()
    return released
