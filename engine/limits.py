"""The class server's limits: one place that reads whether this process serves a class and what each
session may ask for. Pure Python (no torch, no Streamlit): the engine's config, the model loader and the
app read it.

A class server (``PAL_CLASS_SERVER=1``, or ``bash scripts/run.sh --class``) serves many students from one
process, so one student's form must never take the process down for everyone. In class mode:

- the model is locked: the embedded model, or a local folder on the allow-list ``PAL_ALLOWED_MODELS``
  (folders separated by ``os.pathsep``, ":" on Linux); a hub id is refused before anything is fetched;
- every size a form can set is capped (``ClassLimits``: ``num_blocks``, ``block_size``, ``max_model_len``,
  ``swap_space_blocks``, ``kv_budget_bytes``, ``max_num_batched_tokens``, requests per engine), checked when
  an ``EngineConfig`` is built, so before any allocation;
- the bytes one session's engines would allocate (a Playground lab holds two: the paged pool plus its swap
  pool, and the contiguous baseline's region of the same bytes) are checked against a per-session budget:
  the host memory still available (``engine.memory.available_host_memory_bytes``: free RAM or the
  container's cgroup limit, whichever is smaller) divided by the seats (``PAL_CLASS_SEATS``, default 30),
  or ``PAL_SESSION_MEMORY_MB`` when that is smaller;
- a session's recorded history keeps the last ``history_steps`` steps and an idle session's lab is
  released after ``idle_minutes`` (``ui/class_server.py`` does both).

Outside class mode nothing here refuses anything except a hub download larger than
``PAL_MAX_DOWNLOAD_MB`` (default 2,048 MiB; checked from the hub's file list before the weights are
fetched). The engine's own checks hold on every server: a pool of more than
``engine.llm_engine.MAX_RECORDED_BLOCKS`` blocks, or a pool / swap pool larger than the free memory, is
refused before allocation (``LLMEngine._check_memory``).

Errors are ``ValueError`` naming the field, the value asked for and the limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

CLASS_SERVER_ENV = "PAL_CLASS_SERVER"
ALLOWED_MODELS_ENV = "PAL_ALLOWED_MODELS"
SEATS_ENV = "PAL_CLASS_SEATS"
SESSION_MEMORY_ENV = "PAL_SESSION_MEMORY_MB"
HISTORY_STEPS_ENV = "PAL_HISTORY_STEPS"
IDLE_MINUTES_ENV = "PAL_IDLE_MINUTES"
MAX_DOWNLOAD_ENV = "PAL_MAX_DOWNLOAD_MB"

MIB = 2**20
DEFAULT_MAX_DOWNLOAD_MB = 2048
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


def resolved_model_path(model: str) -> str:
    """The canonical form of a model name: a local folder's real path (``~`` expanded, symlinks and
    ``..`` resolved, no trailing slash), so every spelling of one folder names one cached copy; a hub id
    as given."""
    path = os.path.expanduser(model.strip())
    return os.path.realpath(path) if os.path.isdir(path) else model.strip()


def is_local_model(model: str) -> bool:
    return os.path.isdir(os.path.expanduser(model.strip()))


@dataclass(frozen=True)
class ClassLimits:
    """What one session may ask for on a class server. The caps admit every preset, lesson and Compare
    run (the largest: a 1,024-block pool, ``max_model_len`` 2,048, the embedded model's longest);
    ``history_steps``, ``idle_minutes``, ``seats`` and the session memory come from the environment.

    Attributes (units in the names' terms): ``max_num_blocks`` blocks, ``max_block_size`` tokens,
    ``max_model_len`` tokens, ``max_swap_space_blocks`` blocks, ``max_kv_budget_bytes`` bytes,
    ``max_num_batched_tokens`` tokens, ``max_requests`` requests one engine holds (V1's child requests
    count), ``history_steps`` recorded steps kept per session, ``idle_minutes`` before an idle session's
    lab is released, ``seats`` sessions the memory is shared by, ``session_memory_bytes`` an explicit
    per-session cap (None: derived from the free memory), ``allowed_models`` resolved folders besides the
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
    seats: int = 30
    session_memory_bytes: int | None = None
    allowed_models: tuple[str, ...] = field(default_factory=tuple)

    # the EngineConfig fields a form sets, with their caps
    def caps(self) -> dict[str, int]:
        return {"num_blocks": self.max_num_blocks, "block_size": self.max_block_size,
                "max_model_len": self.max_model_len, "swap_space_blocks": self.max_swap_space_blocks,
                "kv_budget_bytes": self.max_kv_budget_bytes,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "reservation_tokens": self.max_model_len}

    def model_choices(self) -> tuple[str, ...]:
        """The models a session may load: the embedded one first, then the allow-list (resolved paths)."""
        from .config import EMBEDDED_MODEL

        embedded = resolved_model_path(EMBEDDED_MODEL)
        return (embedded,) + tuple(m for m in self.allowed_models if m != embedded)


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
    return ClassLimits(history_steps=int(_env_number(HISTORY_STEPS_ENV, 500, 10)),
                       idle_minutes=_env_number(IDLE_MINUTES_ENV, 20.0, 0.1),
                       seats=int(_env_number(SEATS_ENV, 30, 1)),
                       session_memory_bytes=int(memory_mb * MIB) if memory_mb else None,
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


def max_download_bytes() -> int:
    """The largest hub download (all safetensors files of a model) a server fetches, in bytes."""
    return int(_env_number(MAX_DOWNLOAD_ENV, DEFAULT_MAX_DOWNLOAD_MB, 1) * MIB)


def check_download_size(model: str, nbytes: int) -> None:
    """Refuse a hub model whose weight files total more than ``max_download_bytes()``, before fetching.
    Raises ValueError naming the model, its size and the limit (and the variable that sets it)."""
    cap = max_download_bytes()
    if nbytes > cap:
        raise ValueError(f"model {model!r}: its weights are {nbytes / MIB:,.0f} MiB on the hub, more than this "
                         f"server downloads ({cap / MIB:,.0f} MiB, {MAX_DOWNLOAD_ENV}); download it yourself "
                         f"and give the local folder")


# ------------------------------------------------------------------------------------------ the sizes
def check_config(config) -> None:
    """In class mode, refuse an ``EngineConfig`` whose model is not served here (``check_model``) or any
    of whose sizes (``ClassLimits.caps``) is above its cap. Called by ``EngineConfig.__post_init__``, so
    before anything is loaded or allocated. Raises ValueError naming the field, the value and the cap."""
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


def check_request_count(held: int) -> None:
    """In class mode, refuse a request beyond ``max_requests`` per engine (``held``: requests the engine
    holds already, finished ones included). Raises ValueError naming the limit."""
    limits = class_limits()
    if limits is not None and held >= limits.max_requests:
        raise ValueError(f"this class server runs at most {limits.max_requests} requests per run ({held} added "
                         f"already); press Reset for a fresh run")


def session_budget_bytes(limits: ClassLimits, available: int | None = None) -> int:
    """Bytes one session's engines may allocate: the available host memory now
    (``engine.memory.available_host_memory_bytes`` unless given) over ``limits.seats``, or
    ``limits.session_memory_bytes`` when set and smaller. As the class fills, the free memory and so the
    budget shrink: a late session can never take what the others need."""
    from .memory import available_host_memory_bytes

    available = available_host_memory_bytes() if available is None else available
    share = available // limits.seats if available is not None else FALLBACK_SESSION_BYTES
    if limits.session_memory_bytes is not None:
        share = min(share, limits.session_memory_bytes)
    return share


def check_session_bytes(parts: dict[str, int], limits: ClassLimits, available: int | None = None) -> None:
    """Refuse when the bytes a session would allocate (``parts``: what -> bytes, e.g. the paged pool, the
    swap pool, the contiguous region) exceed ``session_budget_bytes``. Raises ValueError naming each part
    with its size, the total and the budget."""
    total = sum(parts.values())
    budget = session_budget_bytes(limits, available)
    if total > budget:
        said = ", ".join(f"{name} {nbytes / MIB:,.1f} MiB" for name, nbytes in parts.items() if nbytes)
        raise ValueError(f"these settings need {total / MIB:,.1f} MiB of KV memory ({said}) but one session on "
                         f"this class server may use {budget / MIB:,.1f} MiB (the free memory shared by "
                         f"{limits.seats} seats); use fewer blocks, a smaller block size or a smaller swap pool")


def history_limit() -> int | None:
    """Recorded steps one session keeps on a class server (``ClassLimits.history_steps``); None elsewhere."""
    limits = class_limits()
    return limits.history_steps if limits is not None else None
