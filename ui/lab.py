"""A ``Lab``: one browser session's pair of engines (paged and contiguous baseline) on the same requests,
with the recorded StepRecords for time travel. No Streamlit here, so it is tested directly.

Its state is four named parts (each a small class below): ``Run`` (the settings, the engines, the requests and
the recorded steps), ``Player`` (the step on screen, a beam step's phase, Play's speed and clock),
``PressProtocol`` (the browser's press counter, what presses did or could not do) and ``SessionLimits`` (a
class server's bound on the recorded steps and its memory charge); ``Lab`` composes them under one lock.

Both engines get the same KV byte budget and the same requests at the same steps. Stepping the lab steps
each engine that still has work; stepping back only moves a cursor over the recorded steps (nothing is
re-run).

One step at a time, never half a step: Streamlit runs a new script run for every event (a second click, a key,
a Play tick) while the last one may still be running, and stops the old run at its next Streamlit call. So
everything that changes the engines (``step``, ``press``, ``take_presses``, ``play_tick``, ``add_request``,
``reset_prefix_cache``) runs under one lock per lab and makes no Streamlit call: a step of the paged engine,
the baseline's step and their record complete together or not at all, and a caller draws afterwards from
``frame()``. The stage's presses (Step / Forward / Back / Play, PageDown / PageUp / P, a presenter's
clicker) are counted in the browser and handed over as a total (``take_presses``): the lab runs each press
not yet handled exactly once, however many script runs see the same total, and counts a press that can do
nothing as ignored (``protocol.ignored``, ``protocol.ignored_why``) so the page can say so.

The contiguous policies "pow2" and "oracle" reserve by each request's true final length, which a server
cannot know at admission: for a preset the lab learns it first with a headless paged run of the same
requests (same settings, same seeds, so the same tokens; its records are not kept). A request added by
hand under those policies has no final length in advance and runs on the paged engine only (unless it
sets ``ignore_eos``, which fixes its length), and ``run.notes`` says so.

Semantics (``RunSpec.semantics``): the paged engine runs "paper" (vLLM V0 as the PagedAttention paper
describes it) or "v1" (vLLM V1); the contiguous baseline always runs the paper's scheduler, without V1's
token budget. What V1 lacks (preemption by swap, beam search) makes ``Lab.create`` run the paper's
semantics instead, and ``run.semantics_note`` says why (``fit_semantics``); ``semantics_line`` names the
semantics a view shows, in one line read from the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from engine import EngineConfig, LLMEngine, SamplingParams, StepRecord
from infra import class_limits as limits
from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS_V1, FINAL_LENGTH_POLICIES
from engine.request_queue import REQUEST_QUEUES
from engine.scenarios.run_spec import RunSpec, baseline_final_lengths, count_only_tokenizer
from engine.scenarios.scenario_file import PrioritizedRequest, length_notes
from engine.scenarios.presets import get_scenario
from engine.scenarios.workloads import WorkloadRequest

# The contiguous policies by the names of the vLLM paper's baselines (Kwon et al., SOSP 2023, section 6),
# and what each reserves per request at admission.
POLICY_LABELS = {"max": "Orca (Max)", "max_tokens": "prompt + max_tokens", "pow2": "Orca (Pow2)",
                 "oracle": "Orca (Oracle)"}
POLICY_RESERVES = {"max": "the maximum length R for every request",
                   "max_tokens": "prompt + max_tokens, what a server knows at admission",
                   "pow2": "the next power of two of the true final length (up to 2x too much)",
                   "oracle": "exactly the true final length"}

SEMANTICS_LABELS = {"paper": "Paper (vLLM V0)", "v1": "vLLM V1"}
SCHEDULING_LABELS = {name: queue.label for name, queue in REQUEST_QUEUES.items()}  # V1's policies (engine.request_queue)

# "Next event" stops at the next step with one of these on the paged engine: a copy-on-write, a prefix-cache
# hit of a first admission, a preemption, a swap out or in, a block leaving a sliding window (a hybrid model's
# KV cache group gave it back: the null block entered its table) (the moments a talk is about).
PRESS_KINDS = {"F": "forward", "B": "back", "P": "play", "N": "next", "E": "end"}  # the browser's letters
KEY_EVENT_KINDS = ("cow", "prefix_hit", "preempt", "swap_out", "swap_in", "leave_window")
KEY_EVENTS_SAID = "copy-on-write, prefix-cache hit, preemption or swap"  # what Next event looks for, in words
KEY_EVENTS_SAID_HYBRID = "copy-on-write, prefix-cache hit, preemption, swap or block leaving a window"
MAX_RUN_STEPS = 2000  # "Run to the end" / "Next event" run at most this many steps per press (then stop, said)
MAX_PLAY_CATCH_UP = 16  # a Play tick runs at most this many steps to keep to the chosen speed


# What the sidebar sets is a run spec (``engine.scenarios.run_spec.RunSpec``), the type the CLI, scenario files,
# Compare, the lessons and the benchmarks build too; ``preset``: a scenario name, or "custom" (requests added
# by hand, or a scenario file's). ``RunSpec.engine_config(allocator)`` is the one place an ``EngineConfig`` is
# derived (the baseline runs the paper's scheduler).


def paper_only_reason(settings: RunSpec) -> str | None:
    """Why these settings need the paper's semantics (what vLLM V1 does not have), or None."""
    if settings.preemption_mode == "swap":
        return ("it preempts by swap (copying a victim's blocks to a CPU swap pool and back), and vLLM V1 "
                "preempts by recompute only: it has no swap pool")
    if settings.preset != "custom":
        workload = get_scenario(settings.preset).make(settings.seed, count_only_tokenizer)
        beams = [r.params.beam_width for r in workload.requests if r.params.beam_width > 1]
        if beams:
            return (f"its request uses beam search ({beams[0]} beams that fork and share blocks), and vLLM V1 "
                    f"runs beam search outside its scheduler, so this engine refuses beams in V1")
    return None


def fit_semantics(settings: RunSpec) -> tuple[RunSpec, str | None]:
    """The settings the chosen semantics can run, and a note when they differ from what was asked.

    V1 with what only the paper has (``paper_only_reason``: swap, beam search) runs the paper's semantics
    instead, with a note naming why; V1 drops a swap pool it would never use (recompute only). The paper's
    semantics are first come, first served."""
    if settings.semantics != "v1":
        return dataclasses.replace(settings, semantics="paper", scheduling_policy="fcfs"), None
    why = paper_only_reason(settings)
    if why is not None:
        what = "these settings" if settings.preset == "custom" else f"the {settings.preset} preset"
        how = ("choose another preset (or untick \"Use the preset's pool settings\" to set preemption by "
               "recompute)" if settings.preemption_mode == "swap" else "choose another preset")
        note = (f"vLLM V1 was chosen, but {what} runs in the paper's semantics (vLLM V0): {why}. To see vLLM V1, "
                f"{how}, select vLLM V1 again and press Apply and reset.")
        return dataclasses.replace(settings, semantics="paper", scheduling_policy="fcfs"), note
    return dataclasses.replace(settings, preemption_mode="recompute", swap_space_blocks=None), None


def semantics_line(semantics: str, max_num_batched_tokens: int | None = None, scheduling_policy: str = "fcfs",
                   preemption_mode: str = "recompute", max_num_seqs: int | None = None) -> str:
    """The semantics a view shows, in one line (read the arguments from the engine: ``engine.semantics``,
    ``engine.max_num_batched_tokens``, ``engine.config``). ``max_num_seqs`` is named when below the
    engine's default (a small V1 budget caps it)."""
    if semantics == "v1":
        budget = max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS_V1
        policy = REQUEST_QUEUES[scheduling_policy].short
        cap = (f", at most {max_num_seqs} running sequence{'s' * (max_num_seqs != 1)}" if max_num_seqs is not None
               and max_num_seqs < EngineConfig.max_num_seqs else "")
        return (f"Semantics: vLLM V1 — token budget {budget:,} per step, chunked prefill, n as child requests, "
                f"recompute-only preemption, {policy}{cap}")
    return (f"Semantics: the paper's (vLLM V0) — prefill or decode steps, fork + copy-on-write, recompute or "
            f"swap (here: {preemption_mode})")


def engine_semantics_line(engine: LLMEngine) -> str:
    """``semantics_line`` of a built engine."""
    return semantics_line(engine.semantics, engine.max_num_batched_tokens, engine.config.scheduling_policy,
                          engine.config.preemption_mode, engine.config.max_num_seqs)


def run_sizes(settings: RunSpec, requests, num_blocks: int, swap_blocks: int = 0,
              engines: int = 2) -> limits.RunSizes:
    """``limits.RunSizes`` of a run of ``requests`` ((prompt, SamplingParams) pairs) under ``settings`` on a pool
    of ``num_blocks`` (and ``swap_blocks``): each request's ``num_seqs`` sequences with their most tokens."""
    tokens = [t for prompt, params in requests
              for t in limits.sequence_tokens(prompt, params.max_tokens, params.num_seqs, settings.max_model_len)]
    return limits.RunSizes(tuple(tokens), settings.block_size, num_blocks, swap_blocks, engines)


@dataclass
class Run:
    """The run: the settings in effect, the two engines (paged and contiguous baseline, or None), the requests
    still to arrive and those added, and what the engines recorded (``history``: one (paged, contiguous)
    StepRecord pair per step). ``failure``: a step that raised (the engines may be half-stepped: nothing more
    runs). The lab changes it only under its lock (``Lab.step``)."""

    settings: RunSpec
    paged: LLMEngine | None
    contiguous: LLMEngine | None
    # requests still to arrive, by arrival step, each with its final length when the policy needs it
    pending: list[tuple[WorkloadRequest, int | None]] = field(default_factory=list)
    history: list[tuple[StepRecord, StepRecord | None]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # request ids in first-seen order (each request's colour)
    notes: list[str] = field(default_factory=list)
    semantics_note: str | None = None  # why the paper's semantics run although V1 was chosen (``fit_semantics``)
    # every request added so far as (id, request at the step it arrived, with its priority): the run as a file
    arrivals: list[tuple[str, WorkloadRequest]] = field(default_factory=list)
    queued: int = 0  # requests the preset or scenario file queued (those added by hand come on top)
    final_lens: dict[str, int] = field(default_factory=dict)  # baseline requests' known final lengths (tokens)
    failure: str | None = None  # a step that raised: the engines may be half-stepped, so nothing more runs

    def has_work(self) -> bool:
        """Whether a request is still to arrive or either engine has one unfinished."""
        return bool(self.pending) or self.paged.has_unfinished() or (
            self.contiguous is not None and self.contiguous.has_unfinished())

    def final_lengths(self) -> dict[str, int]:
        """The baseline's sequences' final lengths known in advance (tokens), by sequence id."""
        if self.contiguous is None:
            return {}
        return {s.seq_id: self.final_lens[rid] for rid, r in self.contiguous.requests.items()
                if rid in self.final_lens for s in r.seqs}


@dataclass
class Player:
    """The playback over the recorded steps: which one is on screen (``cursor``: -1 follows the latest, else a
    0-based index into ``Run.history``), the moment shown of a beam step (``phase``: (its engine step number,
    0-based phase)), and Play: on or off, its speed (steps per second), its clock and the rate the page
    measured while drawing. Times are monotonic seconds."""

    cursor: int = -1
    phase: tuple[int, int] | None = None
    playing: bool = False  # Play: steps on a timer (``Lab.play_tick``) until Pause or nothing is left
    speed: float = 2.0  # steps per second Play keeps to (``Lab.play_tick`` catches up when a tick comes late)
    clock: tuple[float, int] = (0.0, 0)  # (when Play started; steps Play has run since)
    # (steps the page has drawn since Play started, the last one's step number, when it was drawn): ``rate``
    shown: tuple[int, int | None, float] = (0, None, 0.0)
    base: int = 0  # the latest step number when Play started: ``rate`` counts the steps shown past it

    def start_clock(self, latest_step: int, now: float | None = None) -> None:
        """Play's pace counts afresh from ``now``, the latest step being ``latest_step``."""
        self.clock = (time.monotonic() if now is None else now, 0)
        self.shown = (0, None, 0.0)
        self.base = latest_step

    def pace(self, now: float) -> float | None:
        """Steps per second Play has run since it started (None while paused or before its first second)."""
        started, done = self.clock
        elapsed = now - started
        return done / elapsed if self.playing and elapsed >= 1.0 else None

    def drawn(self, step: int, now: float) -> None:
        """The page drew engine step ``step`` while playing (drawn again: counted once)."""
        shown, last, _ = self.shown
        if self.playing and step != last:
            self.shown = (shown + 1, step, now)

    def rate(self) -> float | None:
        """Steps advanced on screen per second since Play started (see ``Lab.play_rate``), or None."""
        started = self.clock[0]
        shown, last, at = self.shown
        elapsed = at - started
        if not self.playing or not shown or last is None or elapsed < 1.0:
            return None
        return max(0, last - self.base) / elapsed


@dataclass
class PressProtocol:
    """The stage's presses as the browser counts them (``ui.state.stage_keys``): a running total per lab
    (``token`` names the lab: a total counted for another lab never runs here) and a log of the last kinds;
    ``handled`` presses were run, each once (``Lab.take_presses``). A press that could do nothing is counted
    in ``ignored`` with why (``ignored_why``); what a press did that the screen does not show is said once
    (``notices``, the last ``notice``), and Next event's answer beside the step it was said on (``next_said``:
    (step, what, the stage's one-line form))."""

    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    handled: int = 0
    ignored: int = 0
    ignored_why: str = ""
    notices: int = 0
    notice: str = ""
    next_said: tuple[int | None, str, str] | None = None

    def is_new_total(self, token, total, log) -> bool:
        """Whether the browser's (``token``, ``total``, ``log``) is a count for this lab beyond ``handled``."""
        return (isinstance(total, int) and not isinstance(total, bool) and isinstance(log, str)
                and token == self.token and total > self.handled)

    def pending_kinds(self, token, total, log) -> str:
        """The kinds of the presses not run yet, as far as ``log`` reaches ("" for none or another lab's)."""
        return log[-(total - self.handled):] if self.is_new_total(token, total, log) else ""

    def ignore(self, why: str, said_on: int | None = None, short: str | None = None) -> str:
        """A press that did nothing (see ``Lab._ignore``). Returns "ignored"."""
        self.ignored_why = why
        if said_on is None:
            self.ignored += 1
        else:
            self.say(said_on, why, short)
        return "ignored"

    def say(self, step: int | None, what: str, short: str | None = None) -> None:
        """Say ``what`` once (a ``notice``) and beside step ``step`` while it is on screen (``said_on``)."""
        self.notices += 1
        self.notice = what
        self.next_said = (step, what, short or what)

    def said_on(self, step: int, short: bool = False) -> str | None:
        """What the last Next event said, while step ``step`` (the one it was said on) is on screen."""
        said = self.next_said
        return said[2 if short else 1] if said is not None and said[0] == step else None


@dataclass
class SessionLimits:
    """A class server's bounds on one session's lab (``infra.class_limits``): it keeps only the last
    ``history_limit`` recorded steps (None: all), ``dropped_steps`` counts the older ones dropped (so step
    numbers stay the engines'), and ``memory`` is the session's charge (``Lab.plan_memory``) or None."""

    history_limit: int | None = field(default_factory=lambda: limits.history_limit())
    dropped_steps: int = 0
    memory: limits.SessionPlan | None = None

    def excess(self, recorded: int) -> int:
        """How many of ``recorded`` steps are past ``history_limit`` (to drop, oldest first)."""
        return max(0, recorded - self.history_limit) if self.history_limit else 0

    def note(self, steps_run: int) -> str | None:
        """What the page says once old steps were dropped, or None."""
        if not self.dropped_steps:
            return None
        first, last = self.dropped_steps + 1, steps_run
        why = self.memory.history_why() if self.memory is not None else ""
        return (f"Steps 1-{self.dropped_steps:,} were dropped to save memory; the run continues (this class "
                f"server keeps the last {self.history_limit:,} steps: {first:,}-{last:,}"
                + (f"; {why}" if why else "") + ").")


class Lab:
    """One browser session's lab, in four named parts and a lock (see the module docstring):

    - ``run`` (``Run``): the settings, the engines, the requests and the recorded steps;
    - ``player`` (``Player``): the step on screen, a beam step's phase, Play;
    - ``protocol`` (``PressProtocol``): the browser's press counter and what presses said;
    - ``session`` (``SessionLimits``): a class server's trimming of the recorded steps and memory charge.

    The lab's methods change them together under one lock (a press moves the player, steps the run and
    counts in the protocol at once). A field is read on its part: ``lab.run.history``, ``lab.player.cursor``,
    ``lab.protocol.token``, ``lab.session.history_limit``."""

    def __init__(self, settings: RunSpec, paged: LLMEngine, contiguous: LLMEngine | None, *,
                 notes: list[str] | None = None, semantics_note: str | None = None) -> None:
        self.run = Run(settings, paged, contiguous, notes=list(notes or []), semantics_note=semantics_note)
        self.player = Player()
        self.protocol = PressProtocol()
        self.session = SessionLimits()
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return (f"Lab(preset={self.run.settings.preset!r}, steps={self.steps_run}, cursor={self.player.cursor}, "
                f"playing={self.player.playing}, token={self.protocol.token!r})")

    @staticmethod
    def needs_final_lengths(settings: RunSpec) -> bool:
        """Whether ``create`` first runs the preset on a headless paged engine to learn final lengths: under
        "pow2" / "oracle", unless every request's length is known anyway (``ignore_eos``, no stop tokens:
        prompt + max_tokens, which the engine derives itself)."""
        # n samples and beams run on the contiguous side too (a row each): their lengths are learnt as well
        return settings.preset != "custom" and settings.needs_final_lengths()

    @classmethod
    def create(cls, settings: RunSpec, loaded=None, on_step=None) -> "Lab":
        """Build both engines and queue the preset's requests (under "pow2" / "oracle" with the final
        lengths a headless paged run of the same requests reached: ``needs_final_lengths``; ``on_step``
        receives each of that run's StepRecords, for a progress bar). The settings
        are first fitted to their semantics (``fit_semantics``): ``lab.run.settings`` are those in effect and
        ``lab.run.semantics_note`` says what changed.

        Raises ValueError (bad settings or model) before anything is kept, so a caller can leave its
        previous lab in place.
        """
        settings, semantics_note = fit_semantics(settings)
        limits.check_spec(settings)  # a class server's caps and models, before anything is loaded or allocated
        paged = LLMEngine(settings.engine_config("paged"), loaded)
        contiguous = None
        notes = []
        try:
            contiguous = LLMEngine(settings.engine_config("contiguous"), (paged.model, paged.tokenizer))
        except ValueError as exc:
            if paged.block_manager.hybrid:  # a sliding-window model: said short, it shows on a projector
                notes.append("No contiguous baseline: it runs the paper's scheduler, one block table for every "
                             "layer, which cannot give back what a sliding window left; vLLM V1's KV cache groups "
                             "(a table per kind of layer) can.")
            else:
                notes.append(f"contiguous baseline not available with these settings: {exc}")
        lab = cls(settings, paged, contiguous, notes=notes, semantics_note=semantics_note)
        if settings.preset != "custom" or settings.scenario is not None:
            tokenize = lambda t: paged.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
            # a preset's shipped file (engine.scenarios.scenario_file.preset_workload), or a loaded file under "custom"
            workload = settings.workload(tokenize)
            # a class server's request cap, for the whole file at once (not at the arrival step it is reached)
            limits.check_request_count(len(workload.requests) - 1)
            if settings.preset == "custom":  # a request passing max_model_len stops there, as in vLLM: said
                lab.run.notes.extend(length_notes(settings.scenario, tokenize))
            for r in workload.requests:
                lab.check(r.prompt, r.params)
            finals: list[int | None] = [None] * len(workload.requests)
            learn = cls.needs_final_lengths(settings) if settings.preset != "custom" else (
                settings.contiguous_policy in FINAL_LENGTH_POLICIES
                and not all(r.params.length_known for r in workload.requests if r.params.num_seqs == 1))
            if contiguous is not None and learn:  # else the engine derives them
                # a headless paged run under the baseline's scheduler (the paper's): the same tokens
                finals = baseline_final_lengths(settings, workload, (paged.model, paged.tokenizer), on_step=on_step)
            lab.run.pending = sorted(zip(workload.requests, finals), key=lambda rf: rf[0].arrival_step)
            lab.run.queued = len(lab.run.pending)
        return lab

    # ------------------------------------------------------------------------------------------- requests
    def check(self, prompt, params: SamplingParams) -> None:
        """Raise ValueError if the paged engine would refuse this request (nothing is added)."""
        self.run.paged.check_request(prompt, params)

    def add_request(self, prompt, params: SamplingParams, final_len: int | None = None, priority: int = 0) -> str:
        """Add a request to both engines now (the contiguous one only if it serves it). Returns its id.

        ``final_len``: its final length known in advance (the "pow2" and "oracle" policies need it; without
        it such a request runs on the paged engine only and ``run.notes`` says why). ``priority``: V1's priority
        policy runs lower values first (the paper's scheduler and the baseline ignore it).
        Raises ValueError and adds nothing if the paged engine refuses it (in V1: beam search), or on a class
        server if the run with it would not fit the session's share (``plan_memory``; it may keep fewer steps)."""
        with self._lock:
            if self.session.memory is not None:  # charged before it runs: refused, or fewer recorded steps kept
                self.check(prompt, params)
                self.plan_memory(self.session.memory.kv_parts, self.session.memory.budget, extra=[(prompt, params)])
            return self._add_request(prompt, params, final_len, priority)

    def _add_request(self, prompt, params: SamplingParams, final_len: int | None, priority: int = 0) -> str:
        # a class server's cap on requests per run, before anything is added (V1 adds n child requests at once)
        limits.check_request_count(len(self.run.paged.requests),
                                   getattr(params, "n", 1) if self.run.paged.semantics == "v1" else 1)
        rid = self.run.paged.add_request(prompt, params, priority=priority)
        self.run.order.append(rid)
        self.run.arrivals.append((rid, PrioritizedRequest(self.steps_run, prompt, params, priority)))
        if self.run.contiguous is not None:
            try:
                self.run.contiguous.add_request(prompt, params, request_id=rid, final_len=final_len)
            except ValueError as exc:
                self.run.notes.append(f"{rid} is not run on the contiguous baseline: {exc}")
            else:  # its final length when known in advance: learnt, or fixed by ignore_eos (prompt + max_tokens)
                known = final_len or (self.run.contiguous.requests[rid].max_len if params.length_known else None)
                if known:
                    self.run.final_lens[rid] = known
        return rid

    # ------------------------------------------------------------------------------------------- memory
    def run_sizes(self, extra=()) -> limits.RunSizes:
        """The sizes of this lab's run for a class server's charge (``limits.RunSizes``): every request added or
        still to arrive, plus ``extra`` ((prompt, SamplingParams) pairs about to be added)."""
        requests = [(r.prompt, r.params) for _, r in self.run.arrivals] + [(r.prompt, r.params) for r, _ in self.run.pending]
        return run_sizes(self.run.settings, requests + list(extra), self.run.paged.num_blocks,
                         getattr(self.run.paged.block_manager, "num_swap_blocks", 0),
                         engines=1 + (self.run.contiguous is not None))

    def plan_memory(self, kv_parts: dict, budget: int | None = None, extra=()) -> limits.SessionPlan:
        """Charge this lab's run to its session's share on a class server (``limits.plan_session``: the KV
        parts ``kv_parts``, the engines' state, the page and the recorded steps) and keep at most the steps
        the charge allows (``session.history_limit``, oldest dropped first). ``extra``: requests about to be added.
        Raises ValueError, changing nothing, when the run does not fit even with ``MIN_HISTORY_STEPS``."""
        class_limits = limits.class_limits()
        if class_limits is None:
            raise ValueError("plan_memory: not a class server (PAL_CLASS_SERVER is not set)")
        plan = limits.plan_session(kv_parts, self.run_sizes(extra), class_limits, budget)
        with self._lock:
            self.session.memory = plan
            self.session.history_limit = plan.history_steps
            self._trim_history()
        return plan

    # --------------------------------------------------------------------------------------------- steps
    @property
    def step_count(self) -> int:
        return len(self.run.history)

    def has_work(self) -> bool:
        return self.run.has_work()

    def step(self) -> tuple[StepRecord, StepRecord | None]:
        """Admit arrivals due now, then one step of each engine (an engine with nothing to do idles), recorded.

        Atomic: under the lab's lock and without any Streamlit call, so a second script run (a double click, a
        key, a Play tick) waits for the first, and Streamlit's stopping of a script run (at its next Streamlit
        call) can never fall between the paged step, the baseline's step and their record. Raises
        RuntimeError after a failed step (``run.failure``)."""
        with self._lock:
            return self._step()

    def _step(self) -> tuple[StepRecord, StepRecord | None]:
        if self.run.failure is not None:
            raise RuntimeError(f"the engines stopped after an error: {self.run.failure}")
        try:
            while self.run.pending and self.run.pending[0][0].arrival_step <= self.steps_run:
                r, final_len = self.run.pending.pop(0)
                self._add_request(r.prompt, r.params, final_len, getattr(r, "priority", 0))
            paged = self.run.paged.step()
            contiguous = self.run.contiguous.step() if self.run.contiguous is not None else None
        except Exception as exc:
            # one engine may have stepped and the other not: no later step may pretend they are in step
            self.run.failure = f"step {self.steps_run + 1} raised {type(exc).__name__}: {exc}"
            raise
        self.run.history.append((paged, contiguous))
        self._trim_history()
        return paged, contiguous

    @property
    def steps_run(self) -> int:
        """Steps run since the lab was built: the recorded ones and those dropped (``session.dropped_steps``)."""
        return self.session.dropped_steps + self.step_count

    def _trim_history(self) -> None:
        """Keep at most ``session.history_limit`` recorded steps (a class server's memory bound): drop the oldest,
        keep the cursor on the same step (or on the oldest kept, when its step was dropped)."""
        excess = self.session.excess(len(self.run.history))
        if not excess:
            return
        del self.run.history[:excess]
        self.session.dropped_steps += excess
        # A step's snapshot may hold only what changed since the step before (records.PoolDelta), which keeps
        # that step alive: build the oldest kept step's lists, so the dropped steps are freed
        for record in self.run.history[0] if self.run.history else ():
            if record is not None:
                record.snapshot.ref_counts  # noqa: B018 - reading the lists builds them (records._materialize)
        if self.player.cursor >= 0:
            self.player.cursor = max(0, self.player.cursor - excess)

    def history_note(self) -> str | None:
        """What the page says once old steps were dropped (``_trim_history``), or None."""
        with self._lock:
            return self.session.note(self.steps_run)

    def release(self, why: str) -> None:
        """Free this lab's engines and records (a class server releases an idle session's lab): nothing runs
        or draws from it afterwards; ``run.failure`` says ``why``. The session drops it and builds a fresh one."""
        with self._lock:
            self.player.playing = False
            self.run.failure = why
            self.run.history.clear()
            self.run.pending.clear()
            for engine in (self.run.paged, self.run.contiguous):
                if engine is not None:
                    engine.close()
            self.run.paged = self.run.contiguous = None  # the KV pools and the model's activations go with them

    # ------------------------------------------------------------------------------------- the stage
    def press(self, kind: str) -> str:
        """One press of Step / Forward ("forward"), Back ("back") or Play / Pause ("play"): replay forward
        through the recorded steps while looking back, else run one step; Back shows the previous step; Play
        toggles ``player.playing``. Atomic like ``step``.

        On a beam step (``phases``) Step / Forward first shows its selection and Back its copies again: then
        it returns "phase". Returns what it did: "stepped", "forward", "back", "phase", "play", "pause" or
        "ignored" (then ``protocol.ignored`` counts it and ``protocol.ignored_why`` says why)."""
        with self._lock:
            return self._press(kind)

    def _press(self, kind: str) -> str:
        total = self.step_count
        if kind == "play":
            if self.player.playing:
                self.player.playing = False
                return "pause"
            if self.run.failure is not None or not self.has_work():
                return self._ignore("Play: the engines stopped after an error; press Reset" if self.run.failure
                                    else "Play: all requests have finished (Reset runs them again)" if total
                                    else "Play: nothing to run; add a request first")
            self.player.playing = True
            self._start_play_clock()
            return "play"
        if kind in ("next", "end"):
            return self._run_until(kind)
        shown = self.run.history[self.player.cursor] if total else None  # cursor -1: the latest
        if kind == "back":
            if shown is not None and self.phase_of(shown[0]) > 0:  # a beam step: its copies again
                self.player.phase = (shown[0].step, self.phase_of(shown[0]) - 1)
                return "phase"
            if total < 2 or self.player.cursor == 0:
                return self._ignore("Back: already at the first step" if total else "Back: nothing has run yet")
            self.player.cursor = max(0, (self.player.cursor if self.player.cursor >= 0 else total - 1) - 1)
            before = self.run.history[self.player.cursor][0]  # lands on its last phase, as a slide deck on its last build
            self.player.phase = (before.step, self.phases(before) - 1)
            return "back"
        if kind != "forward":
            return self._ignore(f"unknown press {kind!r}")
        if shown is not None and self.phase_of(shown[0]) < self.phases(shown[0]) - 1:  # the next phase first
            self.player.phase = (shown[0].step, self.phase_of(shown[0]) + 1)
            return "phase"
        if 0 <= self.player.cursor < total - 1:  # looking back: show the next recorded step (nothing re-runs)
            self.player.cursor += 1
            if self.player.cursor == total - 1:
                self.player.cursor = -1  # the latest step again: follow it
            return "forward"
        if self.run.failure is not None:
            return self._ignore("Step: the engines stopped after an error; press Reset")
        if not self.has_work():
            return self._ignore("Step: all requests have finished (Reset runs them again)"
                                if total else "Step: nothing to run; add a request first")
        if not self._try_step():
            return self._ignore("Step: the engines stopped after an error; press Reset")
        self.player.cursor = -1
        return "stepped"

    # ------------------------------------------------------------------------ a beam step's two phases
    @staticmethod
    def phases(record: StepRecord) -> int:
        """How many moments the stage shows of paged step ``record``: 2 for a beam-search step that selected
        beams (``viz.block_table.selection_phases``: 0 the copies, 1 the selection), else 1.

        One phase choice drives every view of the step (the pool, the slot view, the block tables, the
        numbers and titles beside them): the lab's ``player.phase``, moved by the stage's presses (Step / PageDown /
        a clicker shows a beam step's selection before the next step; Back / PageUp its copies again before
        the step before, which it shows in its last phase, as a slide deck shows a slide's last build) and by
        the Playground's phase control (``set_phase``). A step newly shown (run, Next event, Play, the slider)
        opens on phase 0, the moment its key sentence says (the copy-on-write)."""
        from viz.block_table import selection_events

        return 2 if selection_events(record.events, record.snapshot)[1] else 1

    def phase_of(self, record: StepRecord) -> int:
        """The phase shown of paged step ``record`` (0 unless a press or ``set_phase`` chose another on it)."""
        chosen = self.player.phase
        if chosen is None or chosen[0] != record.step:
            return 0
        return min(chosen[1], self.phases(record) - 1)

    def set_phase(self, record: StepRecord, phase: int) -> None:
        """Show phase ``phase`` (0-based) of paged step ``record`` (the Playground's phase control). Raises
        ValueError for a phase the step does not have."""
        n = self.phases(record)
        if isinstance(phase, bool) or not isinstance(phase, int) or not 0 <= phase < n:
            raise ValueError(f"phase must be 0..{n - 1} for step {record.step}, got {phase!r}")
        with self._lock:
            self.player.phase = (record.step, phase)

    def _try_step(self) -> bool:
        """``_step`` for a press or a Play tick: a failure is kept in ``run.failure`` (and logged with its
        traceback) for the page to say, instead of an exception in the middle of the stage."""
        try:
            self._step()
        except Exception:  # noqa: BLE001 - any failure: the page says it and nothing more runs
            logging.getLogger(__name__).exception("Playground step failed")
            return False
        return True

    def _ignore(self, why: str, said_on: int | None = None, short: str | None = None) -> str:
        """A press that did nothing: counted in ``protocol.ignored`` and said (``protocol.ignored_why``). With ``said_on`` (a
        Next event at a finished run's end: the step on screen) it is an answer, not an ignored press: not
        counted in ``protocol.ignored`` (the page's "N presses ignored" toast), said once as a ``protocol.notice`` and beside
        the step (``protocol.next_said``; ``short``: the stage's one-line form)."""
        return self.protocol.ignore(why, said_on, short)

    def take_presses(self, token, total, log) -> int:
        """The browser's press counter: ``total`` presses counted so far for the lab named ``token``, and
        ``log`` the kinds of the last of them, oldest first ("F" forward, "B" back, "P" play / pause). Runs
        each press not handled yet, in order, exactly once (``protocol.handled`` counts them), however many script
        runs hand over the same or an older total. A total for another lab (``token``) or that is not a count runs
        nothing. Presses older than the log reaches are counted as ignored. Returns how many were new."""
        with self._lock:
            if not self._is_new_total(token, total, log):
                return 0
            new, kinds = total - self.protocol.handled, self.pending_kinds(token, total, log)
            for _ in range(new - len(kinds)):
                self._ignore("more presses at once than the page could keep apart")
            for k in kinds:
                self._press(PRESS_KINDS.get(k, k))
            self.protocol.handled = total
            return new

    def _is_new_total(self, token, total, log) -> bool:
        return self.protocol.is_new_total(token, total, log)

    def pending_kinds(self, token, total, log) -> str:
        """The kinds of the presses in the browser's counter (``take_presses``'s arguments) not run yet, as far
        as ``log`` reaches; "" for none, another lab's ``token`` or a malformed count. Read without the lock
        (a peek: ``take_presses`` runs them)."""
        return self.protocol.pending_kinds(token, total, log)

    def play_tick(self, now: float | None = None) -> int:
        """One Play tick: while ``player.playing``, as many steps as keep Play at ``player.speed`` steps per second
        since it started (at least one, at most ``MAX_PLAY_CATCH_UP``: a page that draws slower than the speed
        shows every k-th step, the steps themselves keep the pace). Returns the steps run; 0, and Play stops
        (``player.playing`` False), when there is nothing to run or the engines failed; 0 too when not playing (a
        Pause that came first). ``now``: monotonic seconds (tests)."""
        with self._lock:
            if not self.player.playing:
                return 0
            now = time.monotonic() if now is None else now
            started, done = self.player.clock
            due = int((now - started) * self.player.speed) + 1 - done  # the first step runs at once
            ran = 0
            for _ in range(max(1, min(due, MAX_PLAY_CATCH_UP))):
                if self.run.failure is not None or not self.has_work() or not self._try_step():
                    break
                ran += 1
            if ran == 0:
                self.player.playing = False
                return 0
            self.player.clock = (started, done + ran)
            self.player.cursor = -1
            return ran

    def set_play_speed(self, speed: float) -> None:
        """Play's speed in steps per second (> 0); the pace counts afresh from now."""
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0:
            raise ValueError(f"play speed must be a positive number of steps per second, got {speed!r}")
        with self._lock:
            if speed != self.player.speed:
                self.player.speed = float(speed)
                self._start_play_clock()

    def _start_play_clock(self) -> None:
        self.player.start_clock(self.run.history[-1][0].step if self.run.history else 0)

    def play_pace(self, now: float | None = None) -> float | None:
        """Steps per second Play has run since it started (what ``play_tick`` keeps at ``player.speed``; None
        before its first second). More than the page shows when it draws slower than the speed: see
        ``play_rate``."""
        with self._lock:
            return self.player.pace(time.monotonic() if now is None else now)

    def play_drawn(self, step: int, now: float | None = None) -> None:
        """The page has finished drawing engine step ``step`` while playing (``now``: monotonic seconds, for
        tests). A step drawn again (a redraw without a new step) counts once."""
        with self._lock:
            self.player.drawn(step, time.monotonic() if now is None else now)

    def play_rate(self) -> float | None:
        """The rate the page says it measured while playing: the steps it advanced on screen per second since
        Play started, i.e. (the step number last drawn - the latest step when Play started: ``player.base``) over
        the seconds from Play's start to that drawing (``play_drawn``). What a viewer counts on the step
        counter, however many steps each drawing advances: a tick that comes late runs the steps it owes
        (``play_tick``) and the page draws the last of them, so counting drawings instead said 3.5 while the
        counter advanced 8.5 steps a second (issue 23). None before a second has passed or a step was drawn."""
        with self._lock:
            return self.player.rate()

    def bytes_per_block(self) -> int | None:
        """Bytes of one block of the paged pool (``engine.kv_cache.page_bytes``: one KV cache group's layers),
        None before an engine exists."""
        from engine.kv_cache import page_bytes

        e = self.run.paged
        if e is None:
            return None
        return page_bytes(e.geometry, e.block_size, e.kv_cache_groups)

    def key_events_said(self) -> str:
        """What Next event looks for, in words: a block leaving a window too on a hybrid model's run."""
        hybrid = getattr(getattr(self.run.paged, "block_manager", None), "hybrid", False)
        return KEY_EVENTS_SAID_HYBRID if hybrid else KEY_EVENTS_SAID

    @staticmethod
    def key_events(record: StepRecord) -> list[str]:
        """The ``KEY_EVENT_KINDS`` a paged step recorded, in order, once each (a re-admission's own-block hit
        after a preemption is not a sharing moment: left out)."""
        kinds = [str(e.kind) for e in record.events if e.kind in KEY_EVENT_KINDS
                 and not (e.kind == "prefix_hit" and e.data.get("readmission"))]
        return list(dict.fromkeys(kinds))

    def _run_until(self, kind: str) -> str:
        """"next": the next step with a key event (``key_events``): while looking back, the next recorded one;
        else (or when no later recorded step has one) steps run until one has. "end": run until no work is
        left. At most ``MAX_RUN_STEPS`` steps per press. Returns "next" / "end"; "none-left" when no key
        event remained (the page says it: ``protocol.notice``); ignores the press when nothing can run.

        When "next" finds no key event in the steps it ran, the screen stays on the step it showed (the steps
        are recorded: the slider and Step reach them). A presenter pressing N after the last moment expects
        what a slide deck does after its last slide (nothing moves, and it says why), not to land silently on
        a last step hundreds of steps on (issue 23: ``chat-workload`` ran 629 steps without a word)."""
        total = self.step_count
        self.player.playing = False  # the moment a speaker jumps to must stay on screen: Play stops
        if kind == "next" and 0 <= self.player.cursor < total - 1:
            later = [i for i in range(self.player.cursor + 1, total) if self.key_events(self.run.history[i][0])]
            if later:
                self.player.cursor = -1 if later[0] == total - 1 else later[0]
                return "next"
            if not self.has_work() or self.run.failure is not None:
                return self._ignore(f"Next event: no {self.key_events_said()} after "
                                    f"step {self._shown_step():,}, and the run has finished",
                                    said_on=self._shown_step(),
                                    short=f"Next event: none after step {self._shown_step():,}; the run has "
                                          f"finished")
        if self.run.failure is not None:
            return self._ignore("the engines stopped after an error; press Reset")
        if not self.has_work():
            if kind == "next" and total:  # what N was asked: no event is left (not only that nothing runs)
                return self._ignore(f"Next event: no {self.key_events_said()} is left "
                                    f"after step {self._shown_step():,}: the run has finished (Reset runs it "
                                    f"again)", said_on=self._shown_step(),
                                    short=f"Next event: none after step {self._shown_step():,}; the run has "
                                          f"finished")
            return self._ignore("all requests have finished (Reset runs them again)" if total
                                else "nothing to run; add a request first")
        shown = self._shown_step()  # the step on screen (None: nothing yet), kept while searching on
        if total:
            self.player.cursor = self.player.cursor if self.player.cursor >= 0 else total - 1  # pinned: a trimmed history moves it
        ran = 0
        for _ in range(MAX_RUN_STEPS):
            if not self.has_work() or not self._try_step():
                break
            ran += 1
            if kind == "next" and self.key_events(self.run.history[-1][0]):
                self.player.cursor = -1
                return kind
        if kind == "end" or self.run.failure is not None:  # a failure: the page says it
            self.player.cursor = -1
            return kind
        if shown is None:  # nothing was on screen to stay on: the last step run
            self.player.cursor = -1
            where = f"showing step {self.steps_run:,}"
        else:
            where = f"still showing step {shown:,}"
        if self.has_work():
            self._say(f"Next event: none in the next {ran:,} steps (run and recorded, up to step "
                      f"{self.steps_run:,}); {where}: press N again to look further",
                      f"Next event: none up to step {self.steps_run:,} (recorded); N looks further")
        else:
            self._say(f"Next event: no {self.key_events_said()} is left: the remaining "
                      f"{ran:,} steps ran to the end (recorded up to step {self.steps_run:,}: the slider and "
                      f"Step show them); {where}",
                      f"Next event: none is left (the run ended at step {self.steps_run:,}, recorded)")
        return "none-left"

    def _shown_step(self) -> int | None:
        """The engine step number of the step on screen (None when nothing has run)."""
        if not self.run.history:
            return None
        return self.run.history[self.player.cursor if self.player.cursor >= 0 else -1][0].step

    def _say(self, what: str, short: str | None = None) -> None:
        self.protocol.say(self._shown_step(), what, short)

    def said_on(self, record: StepRecord) -> str | None:
        """What the last Next event that found no event said (``protocol.next_said``), while the step it was said on
        (``record``) is still on screen; else None. The stage shows it beside the step (a toast is easily
        missed: at a finished run's end N showed only the last step's sentence, issue 23)."""
        return self.protocol.said_on(record.step)

    def said_short_on(self, record: StepRecord) -> str | None:
        """``said_on`` in one short line, for the presenter view's column beside the strip (the long one,
        three or four lines there, made the figures above it shorter: the block tables then dropped logical
        blocks on the same step, issue 24's trial)."""
        return self.protocol.said_on(record.step, short=True)

    def step_budget(self) -> int | None:
        """The paged engine's token budget per step in vLLM V1 (``max_num_batched_tokens``, tokens); None in
        the paper's semantics (a step is a prefill or a decode step, no budget)."""
        return self.run.paged.max_num_batched_tokens if self.run.paged.semantics == "v1" else None

    def contiguous_final_lengths(self) -> dict[str, int]:
        """The baseline's sequences' final lengths known in advance (tokens), by sequence id: from its
        policy's learnt lengths or ``ignore_eos``. ``viz.region`` draws a live row's slots past it as internal
        fragmentation; without it a row's future is only "reserved, not yet used"."""
        with self._lock:
            return self.run.final_lengths()

    def seek(self, cursor: int) -> None:
        """Show recorded step ``cursor`` (0-based; -1 or the last step: follow the latest)."""
        with self._lock:
            total = self.step_count
            self.player.cursor = -1 if cursor < 0 or cursor >= total - 1 else cursor

    def frame(self) -> tuple[list[tuple[StepRecord, StepRecord | None]], int, bool]:
        """What to draw, read at one moment: the recorded steps (a copy), the 0-based index of the step shown
        (-1 when nothing has run) and whether work is left."""
        with self._lock:
            history = list(self.run.history)
            index = len(history) - 1 if self.player.cursor < 0 else min(self.player.cursor, len(history) - 1)
            return history, index, self.has_work()

    def counts(self) -> dict:
        """The stage's counts, read at one moment: steps recorded, each engine's own step count (None without
        a baseline), presses handled and ignored."""
        with self._lock:
            return dict(recorded=self.step_count, pagedSteps=self.run.paged.step_count,
                        contiguousSteps=self.run.contiguous.step_count if self.run.contiguous is not None else None,
                        handled=self.protocol.handled, ignored=self.protocol.ignored)

    def reset_prefix_cache(self) -> str | None:
        """vLLM's ``reset_prefix_cache`` on the paged engine, between steps: the engine's own message, or None
        when it refuses (requests still hold blocks)."""
        with self._lock:
            if not self.run.paged.reset_prefix_cache():
                return None
            said = [e.message for e in self.run.paged.log.events if e.kind == "reset_prefix_cache"]
            return said[-1] if said else "prefix cache reset"

    def record(self, index: int) -> tuple[StepRecord, StepRecord | None]:
        """The recorded step ``index`` (0-based), for time travel."""
        return self.run.history[index]
