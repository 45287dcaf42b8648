"""The class server's limits: one place that reads whether this process serves a class and what each
session may ask for. Pure Python (no torch, no Streamlit). Deployment policy, so the app reads it, never the
engine (DESIGN.md): the app checks a run's spec (``check_spec``) before it builds engines, a model
(``check_model``) before it loads one, the request cap (``check_request_count``) before it adds requests,
and a scenario link or file (``check_scenario_request_count``) when it opens one.

A class server (``PAL_CLASS_SERVER=1``, or ``bash scripts/run.sh --class``) serves many students from one
process, so one student's form must never take the process down for everyone. In class mode:

- the model is locked: the embedded model, or a local folder on the allow-list ``PAL_ALLOWED_MODELS``
  (folders separated by ``os.pathsep``, ":" on Linux); a hub id is refused before anything is fetched;
- every size a form can set is capped (``ClassLimits``: ``num_blocks``, ``block_size``, ``max_model_len``,
  ``swap_space_blocks``, ``kv_budget_bytes``, ``max_num_batched_tokens``, requests per engine), checked on
  the run's spec where the app builds its engines (``check_spec``), so before any allocation;
- the server's memory for sessions (``server_memory_bytes``: ``PAL_CLASS_MEMORY_MB``, else the host memory
  available when the first session reserved (``engine.memory.available_host_memory_bytes``: free RAM or the
  container's cgroup limit, whichever is smaller), at most seats x ``PAL_SESSION_MEMORY_MB`` when that is set)
  is shared by the seats (``PAL_CLASS_SEATS``, default 30): one session's share is that over the seats, or
  ``PAL_SESSION_MEMORY_MB`` when smaller (``session_budget_bytes``). A session RESERVES its share in the
  server-wide ``ShareRegistry`` before its lab runs (every worker process of ``scripts/class_server.py``
  reserves in one flock'd file, ``PAL_MEMORY_STATE``), holds it while it has a lab and gives it back when
  its lab is released; the registry grants nothing beyond the total, so all sessions together, on all
  workers, stay within it, and a session that finds no share free is refused saying how much is free and
  how many seats are held (``NoShareFree``). The charge (``plan_session``) is the KV pools a
  Playground lab allocates (the paged pool plus its swap pool, and the contiguous baseline's region of the
  same bytes), the engines' state for the run's sequences, Streamlit's own session, and the recorded steps
  (StepRecords with their snapshots, the baseline's too) at a bound per step calibrated by measurement
  (``recorded_step_bytes``). A run whose pools, state and ``MIN_HISTORY_STEPS`` steps do not fit is
  refused, naming each part; otherwise the steps it keeps are capped to what fits;
- a session's recorded history keeps the last ``history_steps`` steps (fewer when its share caps them),
  an idle session's lab is released after ``idle_minutes``, a closed tab's after ``closed_seconds``
  (``ui/class_server.py`` does these).

Outside class mode nothing here refuses anything. The engine's own checks hold on every server: a hub
download larger than ``PAL_MAX_DOWNLOAD_MB`` (``engine.model_loader.max_download_bytes``), a pool of more than
``engine.llm_engine.MAX_RECORDED_BLOCKS`` blocks, or a pool / swap pool larger than the free memory, is
refused before allocation (``LLMEngine._check_memory``).

Errors are ``ValueError`` naming the field, the value asked for and the limit.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.config import EMBEDDED_HYBRID_MODEL, EMBEDDED_MODEL, is_local_model, resolved_model_path  # no torch: engine.config is plain


CLASS_SERVER_ENV = "PAL_CLASS_SERVER"
ALLOWED_MODELS_ENV = "PAL_ALLOWED_MODELS"
SEATS_ENV = "PAL_CLASS_SEATS"
SESSION_MEMORY_ENV = "PAL_SESSION_MEMORY_MB"
CLASS_MEMORY_ENV = "PAL_CLASS_MEMORY_MB"
MEMORY_STATE_ENV = "PAL_MEMORY_STATE"
HISTORY_STEPS_ENV = "PAL_HISTORY_STEPS"
IDLE_MINUTES_ENV = "PAL_IDLE_MINUTES"
CLOSED_SECONDS_ENV = "PAL_CLOSED_SECONDS"

MIB = 2**20
# When the free memory cannot be read at all (no /proc, no cgroup files), each session gets this much.
FALLBACK_SESSION_BYTES = 256 * MIB


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_number(name: str, default: float, minimum: float) -> float:
    """A positive number from the environment; a bad value is refused by name (a server that silently
    ignored it would run with limits its operator did not choose)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number") from None
    if not value >= minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum:g}")
    return value


@dataclass(frozen=True)
class ClassLimits:
    """What one session may ask for on a class server. The caps admit every preset, lesson and Compare
    run (the largest: a 1,024-block pool, ``max_model_len`` 2,048, the embedded model's longest);
    ``history_steps``, ``idle_minutes``, ``seats`` and the session memory come from the environment.

    Attributes (units in the names' terms): ``max_num_blocks`` blocks, ``max_block_size`` tokens,
    ``max_model_len`` tokens, ``max_swap_space_blocks`` blocks, ``max_kv_budget_bytes`` bytes,
    ``max_num_batched_tokens`` tokens, ``max_requests`` requests one engine holds (V1's child requests
    count), ``history_steps`` recorded steps kept per session (fewer when a run's steps are large:
    ``plan_session``), ``idle_minutes`` before an idle session's lab is released, ``closed_seconds`` after
    its tab closed (its websocket gone) before a session's lab is released, ``seats`` sessions the memory is shared by, ``session_memory_bytes`` an explicit
    per-session cap (None: derived from the free memory), ``class_memory_bytes`` all sessions' memory
    together (None: ``server_memory_bytes`` measures it), ``allowed_models`` resolved folders besides the
    embedded model.
    """

    max_num_blocks: int = 4096
    max_block_size: int = 256
    max_model_len: int = 4096
    max_swap_space_blocks: int = 4096
    max_kv_budget_bytes: int = 256 * MIB
    max_num_batched_tokens: int = 16384
    max_requests: int = 64
    history_steps: int = 500
    idle_minutes: float = 20.0
    closed_seconds: float = 10.0
    seats: int = 30
    session_memory_bytes: int | None = None
    class_memory_bytes: int | None = None
    allowed_models: tuple[str, ...] = field(default_factory=tuple)

    # the EngineConfig fields a form sets, with their caps
    def caps(self) -> dict[str, int]:
        return {"num_blocks": self.max_num_blocks, "block_size": self.max_block_size,
                "max_model_len": self.max_model_len, "swap_space_blocks": self.max_swap_space_blocks,
                "kv_budget_bytes": self.max_kv_budget_bytes,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "reservation_tokens": self.max_model_len}

    def model_choices(self) -> tuple[str, ...]:
        """The models a session may load: the embedded one first, the embedded hybrid model (its preset,
        hybrid-window, runs on it), then the allow-list (resolved paths)."""
        embedded = (resolved_model_path(EMBEDDED_MODEL), resolved_model_path(EMBEDDED_HYBRID_MODEL))
        return embedded + tuple(m for m in self.allowed_models if m not in embedded)


def class_mode() -> bool:
    """Whether this process is a class server (``PAL_CLASS_SERVER`` is 1 / true / yes / on)."""
    return _env_on(CLASS_SERVER_ENV)


def class_limits() -> ClassLimits | None:
    """The limits in force (read from the environment at each call, so a test can switch them), or None
    outside class mode. Raises ValueError for a malformed environment value, naming the variable."""
    if not class_mode():
        return None
    allowed = tuple(resolved_model_path(p) for p in os.environ.get(ALLOWED_MODELS_ENV, "").split(os.pathsep)
                    if p.strip())
    missing = [p for p in allowed if not os.path.isdir(p)]
    if missing:
        raise ValueError(f"{ALLOWED_MODELS_ENV}: {missing[0]!r} is not a local folder (list model folders "
                         f"separated by {os.pathsep!r})")
    memory_mb = _env_number(SESSION_MEMORY_ENV, 0, 0)
    class_mb = _env_number(CLASS_MEMORY_ENV, 0, 0)
    return ClassLimits(history_steps=int(_env_number(HISTORY_STEPS_ENV, 500, 10)),
                       idle_minutes=_env_number(IDLE_MINUTES_ENV, 20.0, 0.1),
                       closed_seconds=_env_number(CLOSED_SECONDS_ENV, 10.0, 0),
                       seats=int(_env_number(SEATS_ENV, 30, 1)),
                       session_memory_bytes=int(memory_mb * MIB) if memory_mb else None,
                       class_memory_bytes=int(class_mb * MIB) if class_mb else None,
                       allowed_models=allowed)


# ------------------------------------------------------------------------------------------ the model
def check_model(model: str) -> None:
    """In class mode, refuse a model that is neither the embedded model nor on the allow-list (compared
    by resolved path, so any spelling of an allowed folder passes); a hub id is refused by name before
    anything is fetched. Outside class mode: nothing. Raises ValueError naming ``model``."""
    limits = class_limits()
    if limits is None:
        return
    choices = limits.model_choices()
    if resolved_model_path(model) in choices:
        return
    allowed = ", ".join(repr(c) for c in choices)
    if not is_local_model(model):
        raise ValueError(f"model {model!r}: this class server loads no model from the hub (nor any folder it "
                         f"does not list); the models it serves: {allowed}")
    raise ValueError(f"model {model!r} is not on this class server's list ({ALLOWED_MODELS_ENV}); the models "
                     f"it serves: {allowed}")


# ------------------------------------------------------------------------------------------ the sizes
def check_spec(spec) -> None:
    """In class mode, refuse a run spec (``engine.scenarios.run_spec.RunSpec``, the Playground's settings)
    whose model is not served here or any of whose engines' sizes is above its cap: ``check_config`` of the
    ``EngineConfig`` it derives for the paged engine (the contiguous baseline's has the same sizes or fewer:
    no V1 budget). The app calls it where it builds engines, before anything is loaded or allocated.
    Raises ValueError naming the field, the value and the cap (or the bad setting, as ``EngineConfig``)."""
    if class_limits() is not None:
        check_config(spec.engine_config("paged"))


def check_config(config) -> None:
    """In class mode, refuse an ``EngineConfig`` whose model is not served here (``check_model``) or any
    of whose sizes (``ClassLimits.caps``) is above its cap; the app calls it (``check_spec``) before it
    builds an engine, so before anything is loaded or allocated. Raises ValueError naming the field, the
    value and the cap."""
    limits = class_limits()
    if limits is None:
        return
    for name, cap in limits.caps().items():
        value = getattr(config, name)
        if value is not None and value > cap:
            said = (f"{value:,} ({value / MIB:,.0f} MiB)", f"{cap:,} ({cap / MIB:,.0f} MiB)") \
                if name.endswith("_bytes") else (f"{value:,}", f"{cap:,}")  # a form asks for the budget in MiB
            raise ValueError(f"{name} {said[0]} is above this class server's limit of {said[1]} (one session may "
                             f"not hold more; ask the teacher for a lab machine of your own)")
    check_model(config.model)


def check_request_count(held: int, adding: int = 1) -> None:
    """In class mode, refuse ``adding`` requests (V1's n child requests of one request count) beyond
    ``max_requests`` per engine (``held``: requests the engine holds already, finished ones included).
    Raises ValueError naming the limit."""
    limits = class_limits()
    if limits is not None and held + adding > limits.max_requests:
        more = f", {adding:,} more asked" if adding > 1 else ""
        raise ValueError(f"this class server runs at most {limits.max_requests} requests per run ({held} added "
                         f"already{more}); press Reset for a fresh run")


def check_scenario_request_count(scenario, kind: str) -> None:
    """In class mode, refuse a scenario (``engine.scenarios.scenario_file.ScenarioFile``) ``kind`` ("link" or
    "file") with more requests than one run may hold, when the app opens it: how many it has, the cap, and
    what to do instead (Reset or a fresh run cannot help: the link or file itself is too big for this
    server). Elsewhere: nothing. Raises ValueError."""
    from engine.scenarios.scenario_file import engine_request_count

    got = class_limits()
    count = engine_request_count(scenario)
    if got is None or count <= got.max_requests:
        return
    children = (f" (in V1 each of a request's n samples is a request of its own: {len(scenario.requests):,} "
                f"requests make {count:,})" if count != len(scenario.requests) else "")
    instead = ("open a link with fewer requests (its sender can save the scenario as a file and remove some)"
               if kind == "link" else "remove some requests from the file")
    raise ValueError(f"this scenario {kind} has {count:,} requests{children}, more than the {got.max_requests} one "
                     f"run may hold on this class server; {instead}, or run it on a machine of your own "
                     f"(the app started there with streamlit run app.py, outside class mode, has no such cap)")


def server_memory_bytes(limits: ClassLimits, available: int | None = None) -> int:
    """Bytes all sessions of this class server may hold together (its budget): ``limits.class_memory_bytes``
    (``PAL_CLASS_MEMORY_MB``; ``scripts/class_server.py`` sets it for its workers: the memory available before
    they started less ``WORKER_BASE_BYTES`` each) when set; else the host memory available (``available``, or
    ``engine.memory.available_host_memory_bytes`` now; ``FALLBACK_SESSION_BYTES`` a seat when it cannot be
    read); either at most ``seats x session_memory_bytes`` when that is set. ``ShareRegistry`` measures it once, when
    its first session reserves, and keeps it: every worker then shares one total."""
    from engine.memory import available_host_memory_bytes

    if limits.class_memory_bytes is not None:
        total = limits.class_memory_bytes
    else:
        available = available_host_memory_bytes() if available is None else available
        total = available if available is not None else FALLBACK_SESSION_BYTES * limits.seats
    if limits.session_memory_bytes is not None:
        total = min(total, limits.seats * limits.session_memory_bytes)
    return total


def session_budget_bytes(limits: ClassLimits, available: int | None = None) -> int:
    """Bytes one session may keep (its share): the server's memory for sessions over ``limits.seats``, or
    ``limits.session_memory_bytes`` when set and smaller. The total is ``server_memory_bytes(limits,
    available)`` when ``available`` is given, else the one the process's ``share_registry`` keeps (measured
    when the first session reserved: a share does not change as the class fills; the registry, not the share,
    keeps all sessions together within the total)."""
    total = server_memory_bytes(limits, available) if available is not None else share_registry().total(limits)
    share = total // limits.seats
    if limits.session_memory_bytes is not None:
        share = min(share, limits.session_memory_bytes)
    return share


def check_session_bytes(parts: dict[str, int], limits: ClassLimits, available: int | None = None,
                        budget: int | None = None) -> None:
    """Refuse when the bytes a session would allocate (``parts``: what -> bytes, e.g. the paged pool, the
    swap pool, the contiguous region) exceed ``budget`` (default ``session_budget_bytes``). Raises ValueError
    naming each part with its size, the total and the budget."""
    total = sum(parts.values())
    budget = session_budget_bytes(limits, available) if budget is None else budget
    if total > budget:
        said = ", ".join(f"{name} {nbytes / MIB:,.1f} MiB" for name, nbytes in parts.items() if nbytes)
        raise ValueError(f"these settings need {total / MIB:,.1f} MiB of KV memory ({said}) but one session on "
                         f"this class server may use {budget / MIB:,.1f} MiB (the server's memory shared by "
                         f"{limits.seats} seats); use fewer blocks, a smaller block size or a smaller swap pool")


# ------------------------------------------------------------------------------- everything a session keeps
# What one recorded step keeps, per engine (a Playground lab records two: the paged engine and the contiguous
# baseline), calibrated with tracemalloc on the embedded model (``bench/class_memory.py --calibrate``; the
# measurement is in ``recorded_step_bytes``'s docstring).
RECORD_STEP_BYTES = 16 * 1024  # the StepRecord, its Snapshot, queues, the contiguous layout's accounting
RECORD_SEQ_BYTES = 1024  # per sequence a snapshot lists: SequenceState, its lists, its event, its new token
RECORD_TOKEN_BYTES = 8  # per token of a listed sequence: its ``token_ids`` copy (a pointer to a shared int)
RECORD_TABLE_BYTES = 8  # per block-table entry of a listed sequence
VIEW_BLOCK_BYTES = 48  # per pool block, once a view has drawn the step (its five per-block lists built)
ENGINE_TOKEN_BYTES = 48  # per token a sequence holds in an engine (its int, its list entry, its block's hash)
SESSION_PAGE_BYTES = 8 * MIB  # Streamlit's own per-session state: widget states, the page's messages
MIN_HISTORY_STEPS = 10  # fewer recorded steps than this and time travel is no use: such settings are refused


@dataclass(frozen=True)
class RunSizes:
    """The sizes that decide what a lab's run keeps besides its KV pools: one entry per sequence (a request's
    ``n`` samples or ``beam_width`` beams each count), the most tokens it can hold (prompt + ``max_tokens``, at
    most ``max_model_len``: tokens); the pool's ``block_size`` (tokens), ``num_blocks`` and ``swap_blocks``
    (blocks). ``engines``: engines that record (2: paged + contiguous baseline)."""

    sequence_tokens: tuple[int, ...]
    block_size: int
    num_blocks: int
    swap_blocks: int = 0
    engines: int = 2

    def describe(self) -> str:
        most = max(self.sequence_tokens, default=0)
        return (f"{len(self.sequence_tokens):,} sequences of up to {most:,} tokens, {self.num_blocks:,} blocks, "
                f"{self.engines} engine{'s' * (self.engines != 1)}")


def sequence_tokens(prompt, max_tokens: int, num_seqs: int, max_model_len: int) -> list[int]:
    """The most tokens each of a request's ``num_seqs`` sequences can hold: its prompt (token ids, or text
    counted in UTF-8 bytes: a byte-level tokenizer makes no more tokens than bytes, plus one special token)
    plus ``max_tokens``, at most ``max_model_len``."""
    prompt_tokens = len(prompt) if isinstance(prompt, (list, tuple)) else len(str(prompt).encode()) + 1
    return [min(max_model_len, prompt_tokens + max_tokens)] * num_seqs


def recorded_step_bytes(sizes: RunSizes) -> int:
    """Bytes one recorded step can keep (all engines), an upper bound from the run's sizes: every sequence
    listed in the step's snapshot with its longest token list and block table, the step's events and new
    tokens, and the per-block lists a view builds when it draws the step:

        engines x (RECORD_STEP_BYTES + sum over sequences of (RECORD_SEQ_BYTES + RECORD_TOKEN_BYTES x tokens
                   + RECORD_TABLE_BYTES x ceil(tokens / block_size)) + VIEW_BLOCK_BYTES x (blocks + swap blocks))

    Calibration (``bench/class_memory.py --calibrate``: a lab on the embedded model, class mode, all steps
    kept, each step's snapshots built as a view does; tracemalloc's growth per step over 30 steps, after 3):

    | run (requests x n, max_tokens, pool) | measured / step | sequences listed / step | tokens listed / step | bound |
    | --- | ---: | ---: | ---: | ---: |
    | 16 x 16, 100, 1,024 x 16 | 449 KiB | 332 | 10,338 | 1,170 KiB |
    | 64 x 1 (66-word prompts), 200, 512 x 16 | 201 KiB | 128 | 10,164 | 750 KiB |
    | 8 x 1, 50, 256 x 16 (no view) | 25 KiB | 16 | 504 | 82 KiB |

    A listed sequence cost 1.1-1.2 KiB with its tokens (8 bytes each), ~0.6-0.85 KiB without; a step's
    fixed part ~12 KiB per engine. The bound counts every sequence at its longest, listed at every step;
    a run lists only its waiting and running ones, so the measured steps were 27-38% of it (the issue's
    link, 64 x 16 sequences of up to 409 tokens on 4,096 x 16 blocks: 9.5 MiB a step)."""
    per_seq = sum(RECORD_SEQ_BYTES + RECORD_TOKEN_BYTES * t + RECORD_TABLE_BYTES * -(-t // sizes.block_size)
                  for t in sizes.sequence_tokens)
    return sizes.engines * (RECORD_STEP_BYTES + per_seq + VIEW_BLOCK_BYTES * (sizes.num_blocks + sizes.swap_blocks))


def engine_state_bytes(sizes: RunSizes) -> int:
    """Bytes the engines hold for the run's sequences besides the pools and the records (an upper bound):
    every sequence's tokens in each engine (``ENGINE_TOKEN_BYTES`` each)."""
    return sizes.engines * ENGINE_TOKEN_BYTES * sum(sizes.sequence_tokens)


@dataclass(frozen=True)
class SessionPlan:
    """What one session is charged before its lab runs: ``parts`` (what -> bytes, the recorded steps
    included), the bytes a recorded step can keep (``step_bytes``), the recorded steps it may keep
    (``history_steps``, fewer than ``ClassLimits.history_steps`` when the share caps it: ``capped``) and
    the session's share (``budget``, bytes)."""

    parts: dict
    step_bytes: int
    history_steps: int
    budget: int
    capped: bool
    kv_parts: dict = field(default_factory=dict)  # the KV part of ``parts`` (what a re-plan starts from)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def minimum(self) -> int:
        """The fewest bytes this run can keep: everything but the recorded steps, and ``MIN_HISTORY_STEPS`` of
        those."""
        steps = sum(v for k, v in self.parts.items() if k.startswith("recorded steps"))
        return self.total - steps + MIN_HISTORY_STEPS * self.step_bytes

    def history_why(self) -> str:
        """Why fewer steps are kept than the server's default, in words ("" when not capped)."""
        if not self.capped:
            return ""
        return (f"each step of this run can keep {self.step_bytes / MIB:,.2f} MiB of records, and this session's "
                f"share of the memory ({self.budget / MIB:,.0f} MiB) holds {self.history_steps:,} of them besides "
                f"its pools")


def plan_session(kv_parts: dict, sizes: RunSizes, limits: ClassLimits, budget: int | None = None) -> SessionPlan:
    """Charge everything a lab keeps to one session's share (``session_budget_bytes`` unless ``budget`` is
    given), before anything is allocated: the KV parts (``kv_parts``: what -> bytes), the engines' state for
    the run's sequences (``engine_state_bytes``), Streamlit's own session (``SESSION_PAGE_BYTES``) and the
    recorded steps (``recorded_step_bytes`` each). The steps kept are capped to what the share holds (at most
    ``limits.history_steps``).

    Raises ValueError, naming every part with its MiB, the bytes a step keeps and the share, when even
    ``MIN_HISTORY_STEPS`` steps do not fit (refused)."""
    budget = session_budget_bytes(limits) if budget is None else budget
    fixed = {k: v for k, v in kv_parts.items() if v}
    fixed["sequences' tokens in the engines"] = engine_state_bytes(sizes)
    fixed["the page (Streamlit's session)"] = SESSION_PAGE_BYTES
    step = max(1, recorded_step_bytes(sizes))
    room = budget - sum(fixed.values())
    steps = min(limits.history_steps, max(0, room) // step)
    if steps < MIN_HISTORY_STEPS:
        said = ", ".join(f"{name} {nbytes / MIB:,.1f} MiB" for name, nbytes in fixed.items())
        need = sum(fixed.values()) + MIN_HISTORY_STEPS * step
        raise ValueError(f"this run needs {need / MIB:,.1f} MiB ({said}, and {MIN_HISTORY_STEPS} recorded steps of "
                         f"{step / MIB:,.2f} MiB each: {sizes.describe()}) but one session on this class server "
                         f"may use {budget / MIB:,.1f} MiB (its share: the server's memory over {limits.seats} "
                         f"seats, or {SESSION_MEMORY_ENV}); use fewer requests or samples, shorter max_tokens, a "
                         f"smaller pool or a smaller swap pool")
    parts = {**fixed, f"recorded steps ({steps:,} x {step / MIB:,.2f} MiB)": steps * step}
    return SessionPlan(parts, step, steps, budget, steps < limits.history_steps, dict(kv_parts))


def history_limit() -> int | None:
    """Recorded steps one session keeps on a class server (``ClassLimits.history_steps``); None elsewhere."""
    limits = class_limits()
    return limits.history_steps if limits is not None else None


# ------------------------------------------------------------------------------------- the shares, reserved
LEASE_S = 300.0  # a reservation its worker has not renewed for this long (seconds) is expired


NO_SHARE_FREE = "this class server's memory is taken"  # how NoShareFree's message begins (the page's Try again)


class NoShareFree(ValueError):
    """A session asked for a share of the class server's memory and too little is free: the message says how
    much is free of the total, how many seats are held and when one frees."""


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22, clock ticks after boot): with the pid, it
    names one process, even after its pid is reused. None without /proc or when no such process runs."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # after "(comm)": state is field 3, starttime field 22


def _this_worker() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid())}


def _worker_gone(owner: dict, me: dict) -> bool:
    """Whether the worker process that made a reservation has ended (on this host: its pid runs no more, or
    runs another process, started at another time). A worker on another host is never known to be gone
    (its reservations expire by their lease)."""
    if owner.get("host") != me["host"]:
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return True
    if pid == me["pid"]:
        return owner.get("start") != me["start"]
    if os.path.isdir("/proc/self"):
        start = _process_start(pid)
        return start is None or (owner.get("start") is not None and start != owner.get("start"))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class ShareRegistry:
    """The class server's memory reservations, one per session, shared by every worker process: the charged
    side of the per-session share. A session reserves (``reserve``) before its lab is built, holds what it
    got while it has a lab, and gives it back (``release``) when its lab is released (idle, tab closed). The
    reservations never add up to more than the total (``server_memory_bytes``, fixed when the first session
    reserves): that is the guarantee that all sessions together, on all workers, stay within the server's
    memory for sessions.

    Kept in this process, or with ``path`` in that JSON file (``{"measured": bytes, "sessions": {session id:
    {"bytes", "host", "pid", "start", "renewed"}}}``), read and written under an exclusive ``fcntl.flock`` of
    ``<path>.lock`` by every worker given the same path (``scripts/class_server.py`` sets ``PAL_MEMORY_STATE``
    for its workers). Thread-safe.

    Stale reservations (a worker that crashed, or was killed by the OOM killer, never releases): a reservation
    names the worker process that made it (host, pid and the process's start time, so a reused pid is not
    mistaken for it). It is dropped, by whichever worker next reads the registry, as soon as that process no
    longer runs on this host, and in any case when it has not been renewed for ``lease_s`` seconds (a live
    worker's sweep renews its seated sessions' reservations every ``REAP_INTERVAL_S``; ``renew``). ``now``
    arguments are for tests (``time.time``'s clock: the one processes share)."""

    def __init__(self, path: str | None = None, lease_s: float = LEASE_S):
        self.path, self.lease_s = path, lease_s
        self._measured: int | None = None  # the memory available when the first session reserved (bytes)
        self._sessions: dict[str, dict] = {}
        self._thread_lock = threading.Lock()
        self.me = _this_worker()

    # -------------------------------------------------------------------------------------- the file
    @contextmanager
    def _state(self, now: float):
        """This registry's reservations, read (from the file, under its lock) with the stale ones dropped, and
        written back when changed."""
        with self._thread_lock:
            if self.path is None:
                self._expire(now)
                yield
                return
            with open(self.path + ".lock", "a") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file is closed
                before = self._read()
                self._expire(now)
                yield
                after = json.dumps({"measured": self._measured, "sessions": self._sessions}, sort_keys=True)
                if after != before:
                    tmp = f"{self.path}.{os.getpid()}.tmp"
                    with open(tmp, "w") as f:
                        f.write(after)
                    os.replace(tmp, self.path)  # readers see the old file or the new one, never half of one

    def _read(self) -> str:
        try:
            with open(self.path) as f:
                text = f.read()
            data = json.loads(text)
            sessions = data["sessions"]
            if not isinstance(sessions, dict) or not all(isinstance(r, dict) and isinstance(r.get("bytes"), int)
                                                         for r in sessions.values()):
                raise ValueError("a reservation without its bytes")
            self._sessions = sessions
            if isinstance(data.get("measured"), int):
                self._measured = data["measured"]
            return text
        except FileNotFoundError:
            self._sessions = {}
            return ""
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # unreadable (a full disk, a hand edit): start empty rather than fail every page; the workers'
            # next sweeps renew their sessions' reservations into it (``renew``)
            logging.getLogger(__name__).error("memory reservations %s unreadable (%s): moved to %s.bad",
                                              self.path, exc, self.path)
            os.replace(self.path, self.path + ".bad")
            self._sessions = {}
            return ""

    def _expire(self, now: float) -> None:
        for sid, r in list(self._sessions.items()):
            if now - r.get("renewed", 0) > self.lease_s or _worker_gone(r, self.me):
                del self._sessions[sid]

    def _fix_total(self, limits: ClassLimits) -> int:
        """The total under ``limits``: ``server_memory_bytes`` of the memory available when the first session
        reserved (measured then, and kept in the registry, so all workers and every later session agree)."""
        if self._measured is None and limits.class_memory_bytes is None:
            from engine.memory import available_host_memory_bytes

            available = available_host_memory_bytes()
            self._measured = available if available is not None else FALLBACK_SESSION_BYTES * limits.seats
        return server_memory_bytes(limits, self._measured)

    # -------------------------------------------------------------------------------------- reading
    def total(self, limits: ClassLimits, now: float | None = None) -> int:
        """Bytes all sessions may hold together (measured and kept when first asked)."""
        with self._state(time.time() if now is None else now):
            return self._fix_total(limits)

    def held(self, session: str | None = None, now: float | None = None) -> int:
        """Bytes ``session`` holds (0 if none), or with no session all reservations together."""
        with self._state(time.time() if now is None else now):
            if session is not None:
                return self._sessions.get(session, {}).get("bytes", 0)
            return sum(r["bytes"] for r in self._sessions.values())

    def seats_held(self, now: float | None = None) -> int:
        with self._state(time.time() if now is None else now):
            return len(self._sessions)

    # -------------------------------------------------------------------------------------- changing
    def reserve(self, session: str, want: int, need: int, limits: ClassLimits, now: float | None = None) -> int:
        """Reserve up to ``want`` bytes for ``session`` (its share), at least ``need`` (the fewest its run can
        keep): what is granted is ``want``, or what is free if less (never less than the session held
        already: a re-reservation only grows). Returns the bytes granted, now charged against the total.

        Raises NoShareFree (a ValueError) when less than ``need`` is free, saying how much is free of the
        total, how many seats are held and when one frees; nothing is changed then."""
        now = time.time() if now is None else now
        with self._state(now):
            total = self._fix_total(limits)
            own = self._sessions.get(session, {}).get("bytes", 0)
            others = sum(r["bytes"] for sid, r in self._sessions.items() if sid != session)
            free = max(0, total - others)
            grant = max(own, min(want, free))
            if grant < need:
                held = len(self._sessions) - (session in self._sessions)
                raise NoShareFree(
                    f"{NO_SHARE_FREE}: this run needs at least {need / MIB:,.1f} MiB and "
                    f"{free / MIB:,.1f} MiB of the {total / MIB:,.0f} MiB for sessions is free ({held} seat"
                    f"{'s' * (held != 1)} held, each session holding its share of up to {want / MIB:,.1f} MiB "
                    f"while it has a Playground run). A seat frees when a session is idle for "
                    f"{limits.idle_minutes:g} minutes or {limits.closed_seconds:g} s after its tab closes (each "
                    f"browser tab with the Playground open is a session of its own and holds a seat of its own: "
                    f"close the ones you are not using): try again in a minute, or ask the teacher (more "
                    f"memory: {CLASS_MEMORY_ENV}; seats: {SEATS_ENV})")
            self._sessions[session] = {"bytes": int(grant), **self.me, "renewed": now}
            return int(grant)

    def release(self, session: str, now: float | None = None) -> int:
        """Give back ``session``'s reservation; returns the bytes freed (0 if it held none)."""
        with self._state(time.time() if now is None else now):
            return self._sessions.pop(session, {}).get("bytes", 0)

    def renew(self, sessions, now: float | None = None) -> int:
        """Renew the reservations of ``sessions`` that this worker process made (their sessions are still
        seated here), so that they do not expire (``lease_s``); the file is written at most every tenth of
        the lease. Returns how many were renewed."""
        now = time.time() if now is None else now
        renewed = 0
        with self._state(now):
            for sid in sessions:
                r = self._sessions.get(sid)
                if r is not None and (r.get("host"), r.get("pid"), r.get("start")) == \
                        (self.me["host"], self.me["pid"], self.me["start"]):
                    if now - r.get("renewed", 0) > self.lease_s / 10:
                        r["renewed"] = now
                    renewed += 1
        return renewed


_registries: dict = {}
_registries_lock = threading.Lock()


def share_registry() -> ShareRegistry:
    """This process's ``ShareRegistry``: on the file ``PAL_MEMORY_STATE`` when set (shared by the workers of
    ``scripts/class_server.py``), else one kept in this process (a single-process server)."""
    path = os.environ.get(MEMORY_STATE_ENV, "").strip() or None
    with _registries_lock:
        if path not in _registries:
            _registries[path] = ShareRegistry(path)
        return _registries[path]
