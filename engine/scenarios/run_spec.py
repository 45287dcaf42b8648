"""One run spec: the settings of a run and where its requests come from, in one type (``RunSpec``), that the
CLI, the Playground (its sidebar sets one), Compare, the lessons and the benchmarks build, and
the one place an ``EngineConfig`` is derived from them (``RunSpec.engine_config``).

Fields use the scenario file's names (``engine.scenarios.scenario_file.ScenarioSettings``, the validated file
form of the settings a run decides: ``reservation`` is the contiguous baseline's ``reservation_tokens``);
``from_preset`` and ``from_scenario`` build a spec from a registry preset or a scenario file, so a preset's
``engine_defaults``, a file's settings and the CLI's flags meet in this one shape.

Two rules are written here once:

- the contiguous baseline runs the paper's scheduler (vLLM V0: first come, first served, no V1 token
  budget), whatever the paged engine runs (``RunSpec.baseline``, used by ``engine_config("contiguous")``);
- the contiguous "pow2" and "oracle" policies reserve by each request's true final length, which a server
  cannot know at admission: it is learnt from a paged run of the same requests under the baseline's
  scheduler (same settings, same seeds, so the same tokens; ``baseline_final_lengths``), then the baselines
  run (``run_paged_then_contiguous``).

Validation: ``engine_config`` builds an ``EngineConfig``, which raises ``ValueError`` naming the bad field and
value; ``check`` does it for both engines without building anything else. Deployment policy (a class server's
caps) is the app's: it checks a spec before it builds engines from it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from ..config import (DEFAULT_WATERMARK, EMBEDDED_MODEL, FINAL_LENGTH_POLICIES, EngineConfig)
from .scenario_file import ScenarioFile
from .workloads import Workload, learn_final_lengths, run_workload

MIB = 2**20


def max_num_seqs_for(semantics: str, max_num_batched_tokens: int | None) -> int:
    """Most sequences the paged engine runs at once: the engine's default (256), or in V1 the token budget
    when that is smaller (V1 refuses a budget below ``max_num_seqs``)."""
    default = EngineConfig.max_num_seqs
    if semantics == "v1" and max_num_batched_tokens is not None:
        return max(1, min(default, max_num_batched_tokens))
    return default


@dataclass
class RunSpec:
    """A run's settings and its requests' source. ``preset``: a registry scenario's name (its requests at
    ``seed``), or "custom" (``scenario``'s requests, or none: requests added by hand).

    The settings a scenario file holds (``ScenarioSettings``, same names and meaning): ``block_size``,
    ``num_blocks``, ``max_model_len``, ``reservation`` (the contiguous baseline's slots per request under
    the "max" policy; None: ``max_model_len``), ``contiguous_policy``, ``preemption_mode``,
    ``swap_space_blocks``, ``enable_prefix_caching``, ``watermark`` (None: the semantics' default,
    ``engine.config.DEFAULT_WATERMARK``: 1% paper, 0 V1), ``scheduling_policy`` and
    ``max_num_batched_tokens`` (V1's token budget per step; None: 2,048); with ``semantics`` and ``seed``.
    ``semantics``, ``scheduling_policy`` and ``max_num_batched_tokens`` apply to the paged engine only; the
    paper's semantics use FCFS and no V1 budget. V1 needs a budget of at least ``max_num_seqs`` (vLLM's
    SchedulerConfig: every running request gets a token each step), so a budget below the engine's default
    of 256 sequences also caps the running sequences at the budget (``paged_max_num_seqs``), unless
    ``max_num_seqs`` is given.

    Beyond a file: ``model`` (a file runs on the embedded model), ``kv_budget_mb`` (> 0: size the pool from
    this KV budget instead of ``num_blocks``), and what the CLI and the benchmarks set (the Playground keeps
    the defaults): ``device``, ``dtype``, ``attention_backend``, ``max_num_seqs`` (None: ``max_num_seqs_for``),
    ``prefill_budget`` (the paper's scheduler's ``max_num_batched_tokens``: a prefill step's token budget,
    at least ``max_model_len``; None: ``max_model_len``), ``kv_events_endpoint`` and
    ``kv_events_replay_endpoint`` (the paged engine publishes its KV events there).
    """

    model: str = EMBEDDED_MODEL
    preset: str = "batch"
    block_size: int = 16
    num_blocks: int = 64
    max_model_len: int = 256
    reservation: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_blocks: int | None = None
    seed: int = 0
    kv_budget_mb: float = 0.0  # > 0: size the pool from this KV budget instead of num_blocks
    contiguous_policy: str = "max"  # how much a contiguous request reserves (engine.contiguous)
    watermark: float | None = None  # share of the paged pool admission keeps free, in [0, 1); None: default
    semantics: str = "paper"  # the paged engine's: "paper" (vLLM V0) or "v1" (vLLM V1)
    scheduling_policy: str = "fcfs"  # V1: "fcfs" or "priority"
    max_num_batched_tokens: int | None = None  # V1: the token budget per step; None: 2,048
    scenario: ScenarioFile | None = None  # "custom": a scenario file's requests to queue
    device: str = "auto"
    dtype: str | None = None
    attention_backend: str = "auto"
    max_num_seqs: int | None = None  # None: max_num_seqs_for(semantics, max_num_batched_tokens)
    prefill_budget: int | None = None  # the paper's scheduler's max_num_batched_tokens (the CLI's, in paper)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    # ------------------------------------------------------------------------------------ building one
    @classmethod
    def from_preset(cls, preset: str, model: str = EMBEDDED_MODEL, **overrides) -> "RunSpec":
        """A registry preset's spec: the settings of its shipped scenario file (``assets/scenarios/<preset>.json``:
        block size, pool, lengths, reservation, preemption, prefix caching, contiguous policy, watermark,
        semantics, seed), or, for a scenario registered without a file, its registry ``engine_defaults``
        (``scenario_file.registry_settings``, which also wrote the files); then ``overrides`` (``RunSpec``
        fields). Raises ValueError for an unknown preset or field."""
        from . import scenario_file

        shipped = scenario_file.load_preset(preset)
        if shipped is None:
            semantics, fields = scenario_file.registry_settings(preset)
            fields.update(semantics=semantics, seed=scenario_file.PRESET_SEED)
        else:
            fields = dict(shipped.settings.model_dump(), semantics=shipped.semantics, seed=shipped.seed)
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown Playground setting(s): {', '.join(sorted(unknown))}")
        fields.update(overrides)
        if model == EMBEDDED_MODEL:  # a preset about another model (e.g. the hybrid one) names it
            from .presets import get_scenario
            model = get_scenario(preset).model or model  # its engine_defaults' "model"
        return cls(model=model, preset=preset, **fields)

    @classmethod
    def from_scenario(cls, scenario: ScenarioFile, model: str = EMBEDDED_MODEL, **overrides) -> "RunSpec":
        """A scenario file's spec ("custom": its settings, semantics, seed and requests)."""
        return cls(model=model, preset="custom", scenario=scenario, semantics=scenario.semantics,
                   seed=scenario.seed, **{**scenario.settings.model_dump(), **overrides})

    def workload(self, tokenize: Callable[[str], list[int]]) -> Workload:
        """The spec's requests: a preset's (its shipped file's at that file's seed, else the registry's
        ``make``), a scenario file's, or none ("custom" without a file). Raises ValueError (a text prompt
        too long for ``max_model_len``)."""
        from .scenario_file import preset_workload, to_workload

        if self.preset != "custom":
            return preset_workload(self.preset, self.seed, tokenize, self.model)
        if self.scenario is not None:
            return to_workload(self.scenario, tokenize)
        return Workload("custom", self.seed)

    # ------------------------------------------------------------------------------------- derived
    @property
    def paged_max_num_seqs(self) -> int:
        """Most sequences the paged engine runs at once (``max_num_seqs``, else ``max_num_seqs_for``)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return max_num_seqs_for(self.semantics, self.max_num_batched_tokens)

    @property
    def effective_watermark(self) -> float:
        """The watermark the paged engine runs with (``watermark``, or the semantics' default)."""
        return DEFAULT_WATERMARK[self.semantics] if self.watermark is None else self.watermark

    def baseline(self) -> "RunSpec":
        """This spec under the scheduler the contiguous baseline runs: the paper's (vLLM V0), first come,
        first served, without V1's token budget. Written here only: ``engine_config("contiguous")`` and the
        run that learns the baseline's final lengths (``baseline_final_lengths``) read it."""
        return dataclasses.replace(self, semantics="paper", scheduling_policy="fcfs", kv_events_endpoint=None,
                                   kv_events_replay_endpoint=None)

    def engine_config(self, allocator: str = "paged") -> EngineConfig:
        """The ``EngineConfig`` of one allocator: "paged" (this spec's semantics) or "contiguous" (the
        baseline: ``baseline()``, the paper's scheduler). Raises ValueError naming a bad value (``EngineConfig``'s
        checks), or an allocator that is neither."""
        if allocator not in ("paged", "contiguous"):
            raise ValueError(f"allocator must be 'paged' or 'contiguous', got {allocator!r}")
        spec = self.baseline() if allocator == "contiguous" else self
        v1 = spec.semantics == "v1"
        if isinstance(spec.kv_budget_mb, bool) or not isinstance(spec.kv_budget_mb, (int, float)) \
                or not math.isfinite(spec.kv_budget_mb):
            raise ValueError(f"kv_budget_mb must be a finite number of MiB (0: use num_blocks), got "
                             f"{spec.kv_budget_mb!r}")
        budget = int(spec.kv_budget_mb * MIB) if spec.kv_budget_mb > 0 else None
        return EngineConfig(model=spec.model, device=spec.device, dtype=spec.dtype,
                            attention_backend=spec.attention_backend, block_size=spec.block_size,
                            num_blocks=None if budget else spec.num_blocks, kv_budget_bytes=budget,
                            max_model_len=spec.max_model_len, enable_prefix_caching=spec.enable_prefix_caching,
                            preemption_mode=spec.preemption_mode,
                            swap_space_blocks=None if v1 else spec.swap_space_blocks,  # V1 has no swap pool
                            allocator=allocator, reservation_tokens=spec.reservation,
                            contiguous_policy=spec.contiguous_policy, watermark=spec.watermark,
                            semantics=spec.semantics, scheduling_policy=spec.scheduling_policy,
                            max_num_batched_tokens=spec.max_num_batched_tokens if v1 else spec.prefill_budget,
                            max_num_seqs=spec.paged_max_num_seqs,
                            kv_events_endpoint=spec.kv_events_endpoint,
                            kv_events_replay_endpoint=spec.kv_events_replay_endpoint)


    def check(self) -> None:
        """Raise ValueError, naming the bad value, if either engine's config would be refused."""
        self.engine_config("paged")
        self.engine_config("contiguous")

    def needs_final_lengths(self, workload: Workload | None = None) -> bool:
        """Whether the contiguous policy must know final lengths that the requests do not fix: "pow2" /
        "oracle", unless every request's length is known anyway (``ignore_eos``, no stop tokens: prompt +
        max_tokens, which the engine derives itself). ``workload``: the requests (default: the preset's)."""
        if self.contiguous_policy not in FINAL_LENGTH_POLICIES:
            return False
        if workload is None:
            if self.preset == "custom":
                return False
            from .presets import get_scenario

            workload = get_scenario(self.preset).make(self.seed, count_only_tokenizer)
        return not lengths_known(workload)


def count_only_tokenizer(text: str) -> list[int]:
    """Stands in for the tokenizer when only a workload's sampling parameters are needed."""
    return [0] * max(1, len(text.split()))


def lengths_known(workload: Workload) -> bool:
    """Whether every request's final length is known before it runs (``SamplingParams.length_known``)."""
    return all(r.params.length_known for r in workload.requests)


# ---------------------------------------------------------------------- paged, then the contiguous baseline
@dataclass
class Run:
    """One engine's run to completion: the engine, its StepRecords, its RequestOutputs in workload order."""

    engine: object
    records: list
    outputs: list


@dataclass
class _Scheduled:
    """What ``learn_final_lengths`` reads of a step record: its scheduled sequences (a whole record keeps its
    snapshot, and through its pool delta every earlier one: hundreds of MiB for a large run)."""

    scheduled: list


def run(config: EngineConfig, workload: Workload, loaded=None, on_step=None, final_lens=None,
        keep_records: bool = True, replay: dict[str, list[int]] | None = None) -> Run:
    """Build an engine from ``config`` (on ``loaded`` (model, tokenizer), else loading it) and run
    ``workload`` to completion. ``on_step(record)`` is called after each step. ``replay``: sequence id -> token
    ids of an earlier run of ``workload`` under this engine's scheduler; the engine then samples those tokens
    instead of running the model (``engine.replay_runner``; raises ``ReplayMismatch`` where they do not fit)."""
    from ..llm_engine import LLMEngine
    from ..replay_runner import ReplayRunner

    engine = LLMEngine(config, loaded)
    if replay is not None:
        engine.runner = ReplayRunner(replay, engine.model.config.vocab_size)
    records: list = []

    def step(record) -> None:
        if keep_records:
            records.append(record)
        if on_step is not None:
            on_step(record)
    return Run(engine, records, run_workload(engine, workload, on_step=step, final_lens=final_lens))


def baseline_final_lengths(spec: RunSpec, workload: Workload, loaded, paged: Run | None = None,
                           on_step=None) -> list[int]:
    """Each request's final length (tokens) as the contiguous baseline's scheduler reaches it: what "pow2"
    and "oracle" must know in advance (``learn_final_lengths``). Read from ``paged`` when that run used the
    baseline's scheduler (the paper's) or every length is fixed anyway (``lengths_known``: any scheduler
    reaches them); else learnt now from a headless paged run of ``spec.baseline()`` (the same settings and
    seeds, so the same tokens as the baseline will sample; ``on_step`` gets its records, which are not kept)."""
    if paged is not None and (paged.engine.semantics == "paper" or lengths_known(workload)):
        return learn_final_lengths(paged.outputs, paged.records)
    return learn_final_lengths(*_headless_baseline(spec, workload, loaded, on_step)[1:])


def _headless_baseline(spec: RunSpec, workload: Workload, loaded, on_step=None) -> tuple[Run, list, list]:
    """(run, its outputs, what ``learn_final_lengths`` reads of its records) of a paged run of ``spec.baseline()``
    whose records are not kept (``on_step`` gets them)."""
    learned: list = []  # a beam search may run past its longest output: its records say how far

    def keep(record) -> None:
        learned.append(_Scheduled(record.scheduled))
        if on_step is not None:
            on_step(record)
    headless = run(spec.baseline().engine_config("paged"), workload, loaded, on_step=keep, keep_records=False)
    return headless, headless.outputs, learned


@dataclass
class PagedThenContiguous:
    """``run_paged_then_contiguous``'s result: the paged run (None when it was not asked for), the final
    lengths learnt for the baseline (None: not needed), each policy's contiguous run, why a policy could not
    run, the seconds each part took ({"paged", "learn", "contiguous": {policy: s}}), and how each contiguous
    run got its tokens ({policy: "replayed" | "model"}) with why none was replayed (None: they were)."""

    paged: Run | None
    final_lens: list[int] | None
    contiguous: dict[str, Run] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: dict = field(default_factory=lambda: {"paged": 0.0, "learn": 0.0, "contiguous": {}})
    tokens: dict[str, str] = field(default_factory=dict)
    not_replayed: str | None = None


def run_paged_then_contiguous(spec: RunSpec, workload: Workload, loaded=None, policies=None, paged: bool = True,
                              run_engine: Callable | None = None, on_step: Callable | None = None,
                              skip_refused: bool = False, replay: bool = True) -> PagedThenContiguous:
    """Run ``workload`` on the paged engine (``spec``'s semantics), then on the contiguous baseline (the
    paper's scheduler, ``spec.baseline()``) under each of ``policies`` (default: ``spec.contiguous_policy``),
    in the same KV byte budget, on one copy of the weights (``loaded`` (model, tokenizer), else loaded once
    by the first engine).

    "pow2" and "oracle" get the final lengths the baseline's scheduler reaches (``baseline_final_lengths``:
    from the paged run when it ran that scheduler, else a headless run); the other policies need none.
    ``paged`` False: no paged run unless those lengths need one (then it runs, but ``result.paged`` is None).
    ``on_step(what)``, if given, returns the step callback of the run ``what`` ("paged", "learn" or a
    policy). ``run_engine(what, config, final_lens)`` runs one engine and returns a ``Run`` (default: ``run``
    on ``workload``; the CLI runs several passes with its own). ``skip_refused``: a policy whose engine
    refuses its settings or a request (ValueError) is listed in ``skipped`` with the reason instead of raising.

    ``replay`` (with the default ``run_engine``): the contiguous runs replay the tokens of a paged run under the
    baseline's scheduler instead of running the model (``engine.replay_runner``: the same tokens, so the same
    records; ``result.tokens`` says which did). That run is the paged run when it ran the paper's scheduler,
    else the headless run that learns the final lengths ("learn"), run for this when none was needed. Not
    replayed (``result.not_replayed`` says why): a custom ``run_engine``, a beam search in the workload; a
    replay that does not fit (``ReplayMismatch``) reruns that policy on the model.

    Raises ValueError: bad settings, or a request the paged engine refuses.
    """
    from ..replay_runner import ReplayMismatch, replayable, tokens_by_sequence

    policies = [spec.contiguous_policy] if policies is None else list(policies)
    learn = any(p in FINAL_LENGTH_POLICIES for p in policies)
    callback = on_step or (lambda what: None)
    why_not = ("not asked" if not replay else "the caller runs the engines" if run_engine is not None
               else "beam search: its beams depend on log-probabilities the runs do not record"
               if not replayable(workload) else "no policy to run" if not policies else None)

    def default_run(what, config, final_lens, tokens=None) -> Run:
        return run(config, workload, loaded, on_step=callback(what), final_lens=final_lens, replay=tokens)
    run_engine = run_engine or default_run
    seconds = {"paged": 0.0, "learn": 0.0, "contiguous": {}}
    first = None
    if paged or learn:
        t0 = time.perf_counter()
        first = run_engine("paged", spec.engine_config("paged"), None)
        loaded = loaded or (first.engine.model, first.engine.tokenizer)
        seconds["paged"] = time.perf_counter() - t0
    # the run under the baseline's scheduler whose tokens the baselines replay
    source = first if first is not None and first.engine.semantics == "paper" else None
    finals = None
    t0 = time.perf_counter()
    if learn and (source is not None or lengths_known(workload)):
        finals = baseline_final_lengths(spec, workload, loaded, paged=first)
    if (learn and finals is None) or (why_not is None and source is None):
        source, *learnt = _headless_baseline(spec, workload, loaded, on_step=callback("learn"))
        if learn and finals is None:
            finals = learn_final_lengths(*learnt)
    seconds["learn"] = time.perf_counter() - t0 if source is not first else 0.0
    tokens = tokens_by_sequence(source.engine) if why_not is None else None
    result = PagedThenContiguous(first if paged else None, finals, seconds=seconds, not_replayed=why_not)
    for policy in policies:
        t0 = time.perf_counter()
        try:
            config = dataclasses.replace(spec, contiguous_policy=policy).engine_config("contiguous")
            lens = finals if policy in FINAL_LENGTH_POLICIES else None
            if tokens is None:
                result.contiguous[policy] = run_engine(policy, config, lens)
            else:
                try:
                    result.contiguous[policy], result.tokens[policy] = run_engine(policy, config, lens, tokens), \
                        "replayed"
                except ReplayMismatch:  # the tokens did not fit this run (see engine.replay_runner): the model
                    result.contiguous[policy], result.tokens[policy] = run_engine(policy, config, lens), "model"
        except ValueError as exc:
            if not skip_refused:
                raise
            result.skipped[policy] = str(exc)
            continue
        result.tokens.setdefault(policy, "model")
        seconds["contiguous"][policy] = time.perf_counter() - t0
    return result
