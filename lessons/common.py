"""Helpers the lesson modules share: drive the engine or a bare block manager and keep what it did as
plain data (snapshots, step records). No Streamlit here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_manager import BlockManager
from engine.records import Snapshot, SequenceState, StepRecord


@dataclass
class LessonContext:
    """What a lesson module gets.

    ``loaded``: (model, tokenizer) of the embedded model, shared read-only; ``memo(fn, *args)`` returns
    ``fn(*args)``, cached by the app across sessions (the tests pass a plain call).
    """

    loaded: Any = None
    memo: Callable = lambda fn, *args: fn(*args)  # noqa: E731

    def run(self, fn: Callable, *args):
        """``fn(loaded, *args)`` through the memo (``loaded`` itself is not part of the cache key)."""
        return self.memo(_Bound(fn, self.loaded), *args)


class _Bound:
    """``fn`` with the model bound; its cache ``key`` names ``fn`` alone (the model is the same for every
    call)."""

    def __init__(self, fn: Callable, loaded) -> None:
        self.fn, self.loaded = fn, loaded

    def __call__(self, *args):
        return self.fn(self.loaded, *args)

    @property
    def key(self) -> str:
        return f"{self.fn.__module__}.{self.fn.__qualname__}"


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


def run_engine(loaded, requests: list[tuple[Any, SamplingParams]], max_steps: int = 2000, **config) -> EngineRun:
    """Run ``requests`` (prompt text or token ids, params) to completion on a fresh engine built from
    ``config`` (``EngineConfig`` fields) and the shared ``loaded`` model; every request is added before the
    first step. Raises ValueError for bad settings or requests, RuntimeError if it does not finish."""
    engine = LLMEngine(EngineConfig(device="auto", **config), loaded)
    ids = [engine.add_request(p, sp) for p, sp in requests]
    records = []
    while engine.has_unfinished():
        if len(records) >= max_steps:
            raise RuntimeError(f"the run did not finish in {max_steps} steps")
        records.append(engine.step())
    return EngineRun(records, ids, {r: engine.get_output(r) for r in ids}, engine.block_size,
                     records[-1].snapshot.num_blocks if records else 0)


def scenario_requests(loaded, name: str) -> list[tuple[Any, SamplingParams]]:
    """The (prompt, params) pairs of scenario ``name`` (seed 0) for the shared model's tokenizer."""
    from engine.scenarios import get_scenario

    tokenizer = loaded[1]
    workload = get_scenario(name).make(0, lambda t: tokenizer(t, add_special_tokens=False)["input_ids"])
    return [(r.prompt, r.params) for r in workload.requests]


def scenario_run(loaded, name: str, **overrides) -> EngineRun:
    """Run scenario ``name`` (seed 0, every request at once) with its engine settings, then ``overrides``:
    the same requests and pool the Playground loads for that preset."""
    from engine.scenarios import get_scenario

    config = {k: v for k, v in get_scenario(name).engine_defaults.items() if k != "reservation_tokens"}
    config.update(overrides)
    return run_engine(loaded, scenario_requests(loaded, name), **config)
