"""Helpers the lesson modules share: drive the engine or a bare block manager and keep what it did as
plain data (snapshots, step records). No Streamlit here."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

from engine import LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.records import Snapshot, SequenceState, StepRecord
from engine.scenarios.run_spec import RunSpec
from infra import class_limits


class LessonContext:
    """What a lesson module gets.

    ``loaded``: (model, tokenizer) of the embedded model, shared read-only; with ``loader`` instead, the
    model is loaded by ``loader()`` when a lesson first reads ``loaded`` (a lesson that runs no engine never
    waits for it). ``memo(fn, *args)`` returns ``fn(*args)``, cached by the app across sessions (the tests
    pass a plain call).
    """

    def __init__(self, loaded: Any = None, memo: Callable | None = None, loader: Callable | None = None) -> None:
        self._loaded, self._loader = loaded, loader
        self.memo = memo if memo is not None else (lambda fn, *args: fn(*args))

    @property
    def loaded(self):
        if self._loaded is None and self._loader is not None:
            self._loaded = self._loader()
        return self._loaded

    def run(self, fn: Callable, *args):
        """``fn(loaded, *args)`` through the memo (``loaded`` itself is not part of the cache key, and is only
        read when the memo has to run ``fn``)."""
        return self.memo(_Bound(fn, self), *args)


class _Bound:
    """``fn`` with the model bound; its cache ``key`` names ``fn`` alone (the model is the same for every
    call)."""

    def __init__(self, fn: Callable, ctx: LessonContext) -> None:
        self.fn, self.ctx = fn, ctx

    def __call__(self, *args):
        return self.fn(self.ctx.loaded, *args)

    def prepare(self) -> None:
        """Load the model now (a memo calls it before running ``fn`` elsewhere, e.g. in a worker thread)."""
        self.ctx.loaded  # noqa: B018

    @property
    def key(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__}"


# Progress of the engine runs below, for the page that waits for them (``infra.runs.ProgressBox``): a
# ``report(what, fraction, detail)`` function, set per thread (each Streamlit session runs in its own), None
# outside the app.
_REPORT: ContextVar[Callable | None] = ContextVar("lesson_run_progress", default=None)


@contextmanager
def reporting(report: Callable | None):
    """Within this block, ``run_engine`` calls ``report(what, fraction, detail)`` after every engine step."""
    token = _REPORT.set(report)
    try:
        yield
    finally:
        _REPORT.reset(token)


def manager_snapshot(bm: BlockManager, tokens: dict[str, list[int]] | None = None) -> Snapshot:
    """A ``records.Snapshot`` of a bare block manager: every sequence it holds is shown as running
    (``tokens``: optional token ids per sequence, for the figures' hover text)."""
    tokens = tokens or {}
    seqs = [SequenceState(seq_id=s, request_id=s.split(".")[0], status="running", prompt_len=n,
                          num_generated=0, num_tokens=n, block_table=list(bm.block_tables[s]),
                          token_ids=list(tokens.get(s, [0] * n)))
            for s, n in bm.num_tokens.items()]
    return Snapshot(sequences=seqs, waiting=[], running=sorted({s.request_id for s in seqs}), **bm.pool_fields())


@dataclass
class EngineRun:
    """What an engine run left: every StepRecord, the request ids in order, and each request's output."""

    records: list[StepRecord]
    request_ids: list[str]
    outputs: dict
    block_size: int
    num_blocks: int

    def first(self, kind: str, request_id: str | None = None):
        """(record index, event) of the first event of ``kind`` (optionally of one request), or (None, None)."""
        for i, rec in enumerate(self.records):
            for e in rec.events:
                if e.kind == kind and (request_id is None or e.request_id == request_id
                                       or (e.request_id or "").split(".")[0] == request_id):
                    return i, e
        return None, None

    def events(self, kind: str) -> list:
        return [e for rec in self.records for e in rec.events if e.kind == kind]


def run_engine(loaded, requests: list[tuple[Any, SamplingParams]], max_steps: int = 2000, label: str = "the engine",
               *, request_ids: list[str] | None = None, arrivals: list[int] | None = None,
               stop: Callable[[StepRecord], bool] | None = None, spec: RunSpec | None = None,
               allocator: str = "paged", **settings) -> EngineRun:
    """Run ``requests`` (prompt text or token ids, params) on a fresh engine of ``allocator`` ("paged" or
    "contiguous") built from the run spec ``spec`` (default ``RunSpec()``) with ``settings`` (``RunSpec``
    fields) on top (``RunSpec.engine_config``: the one place an engine's config is derived) and the shared
    ``loaded`` model, to completion or to the first step for which ``stop(record)`` is true.

    ``request_ids``: the engine's id for each request (default R1, R2, ... in the engine's own numbering).
    ``arrivals``: the step (1-based) before which each request is added (default: all before step 1);
    requests arriving at the same step are added in list order, which is their first-come-first-served order.
    ``label`` names the run in the progress reported after each step (``reporting``).
    Raises ValueError for bad settings or requests (or ``arrivals`` of another length than ``requests``),
    RuntimeError if it does not end within ``max_steps``."""
    n = len(requests)
    arrivals = list(arrivals) if arrivals is not None else [1] * n
    if len(arrivals) != n or (request_ids is not None and len(request_ids) != n):
        raise ValueError(f"{n} requests but {len(arrivals)} arrival steps"
                         + (f" and {len(request_ids)} ids" if request_ids is not None else ""))
    spec = dataclasses.replace(spec, **settings) if spec is not None else RunSpec(**settings)
    class_limits.check_spec(spec)  # a class server's caps (deployment policy: the app's, not the engine's)
    engine = LLMEngine(spec.engine_config(allocator), loaded)
    order = sorted(range(n), key=lambda i: arrivals[i])  # stable: same-step requests keep their list order
    ids: list[str | None] = [None] * n
    report = _REPORT.get()
    total = sum(sp.max_tokens * sp.num_seqs for _, sp in requests)  # at most: a reply may end earlier
    known = all(sp.length_known for _, sp in requests)
    records, tokens, added = [], 0, 0
    while added < n or engine.has_unfinished():
        if len(records) >= max_steps:
            raise RuntimeError(f"the run did not finish in {max_steps} steps")
        while added < n and arrivals[order[added]] <= len(records) + 1:
            i = order[added]
            prompt, params = requests[i]
            ids[i] = engine.add_request(prompt, params, **({"request_id": request_ids[i]} if request_ids else {}))
            added += 1
        records.append(engine.step())
        if report is not None:
            tokens += len(records[-1].new_tokens)
            report(f"Running {label}", tokens / total if total else 0.0,
                   f"step {len(records)}, {tokens:,} of {'' if known else 'at most '}{total:,} tokens")
        if stop is not None and stop(records[-1]):
            break
    added_ids = [r for r in ids if r is not None]
    return EngineRun(records, added_ids, {r: engine.get_output(r) for r in added_ids}, engine.block_size,
                     records[-1].snapshot.num_blocks if records else 0)


def scenario_requests(loaded, name: str) -> list[tuple[Any, SamplingParams]]:
    """The (prompt, params) pairs of scenario ``name`` (seed 0) for the shared model's tokenizer."""
    from engine.scenarios.presets import get_scenario

    tokenizer = loaded[1]
    workload = get_scenario(name).make(0, lambda t: tokenizer(t, add_special_tokens=False)["input_ids"])
    return [(r.prompt, r.params) for r in workload.requests]


def scenario_run(loaded, name: str, **overrides) -> EngineRun:
    """Run scenario ``name`` (seed 0, every request at once) with its engine settings, then ``overrides``:
    the same requests and pool the Playground loads for that preset."""
    label = name + (f" ({', '.join(f'{k}={v}' for k, v in overrides.items())})" if overrides else "")
    allocator = overrides.pop("allocator", "paged")
    return run_engine(loaded, scenario_requests(loaded, name), label=label, allocator=allocator,
                      spec=RunSpec.from_preset(name, **overrides))
