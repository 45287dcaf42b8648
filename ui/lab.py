"""A ``Lab``: one browser session's pair of engines (paged and contiguous baseline) on the same requests,
with the recorded StepRecords for time travel. No Streamlit here, so it is tested directly.

Both engines get the same KV byte budget and the same requests at the same steps. Stepping the lab steps
each engine that still has work; stepping back only moves a cursor over the recorded steps (nothing is
re-run).

The contiguous policies "pow2" and "oracle" reserve by each request's true final length, which a server
cannot know at admission: for a preset the lab learns it first with a headless paged run of the same
requests (same settings, same seeds, so the same tokens; its records are not kept). A request added by
hand under those policies has no final length in advance and runs on the paged engine only (unless it
sets ``ignore_eos``, which fixes its length), and ``notes`` says so.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine import EngineConfig, LLMEngine, SamplingParams, StepRecord
from engine.config import FINAL_LENGTH_POLICIES
from engine.scenarios import get_scenario
from engine.workloads import WorkloadRequest, learn_final_lengths, run_workload

# The contiguous policies by the names of the vLLM paper's baselines (Kwon et al., SOSP 2023, section 6),
# and what each reserves per request at admission.
POLICY_LABELS = {"max": "Orca (Max)", "max_tokens": "prompt + max_tokens", "pow2": "Orca (Pow2)",
                 "oracle": "Orca (Oracle)"}
POLICY_RESERVES = {"max": "the maximum length R for every request",
                   "max_tokens": "prompt + max_tokens, what a server knows at admission",
                   "pow2": "the next power of two of the true final length (up to 2x too much)",
                   "oracle": "exactly the true final length"}


@dataclass
class LabSettings:
    """What the sidebar sets. ``preset``: a scenario name, or "custom" (requests added by hand)."""

    model: str
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
    contiguous_policy: str = "max"  # how much a contiguous request reserves (``POLICY_LABELS``)
    watermark: float = 0.01  # share of the paged pool admission keeps free, in [0, 1)

    def config(self, allocator: str) -> EngineConfig:
        """The ``EngineConfig`` of one allocator ("paged" | "contiguous"). Raises ValueError on bad values."""
        budget = int(self.kv_budget_mb * 2**20) if self.kv_budget_mb > 0 else None
        return EngineConfig(model=self.model, device="auto", block_size=self.block_size,
                            num_blocks=None if budget else self.num_blocks, kv_budget_bytes=budget,
                            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
                            preemption_mode=self.preemption_mode, swap_space_blocks=self.swap_space_blocks,
                            allocator=allocator, reservation_tokens=self.reservation,
                            contiguous_policy=self.contiguous_policy, watermark=self.watermark)


def _count_only_tokenizer(text: str) -> list[int]:
    """Stands in for the tokenizer when only a workload's sampling parameters are needed."""
    return [0] * max(1, len(text.split()))


@dataclass
class Lab:
    settings: LabSettings
    paged: LLMEngine
    contiguous: LLMEngine | None
    # requests still to arrive, by arrival step, each with its final length when the policy needs it
    pending: list[tuple[WorkloadRequest, int | None]] = field(default_factory=list)
    history: list[tuple[StepRecord, StepRecord | None]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    @staticmethod
    def needs_final_lengths(settings: LabSettings) -> bool:
        """Whether ``create`` first runs the preset on a headless paged engine to learn final lengths: under
        "pow2" / "oracle", unless every request's length is known anyway (``ignore_eos``, no stop tokens:
        prompt + max_tokens, which the engine derives itself)."""
        if settings.preset == "custom" or settings.contiguous_policy not in FINAL_LENGTH_POLICIES:
            return False
        workload = get_scenario(settings.preset).make(settings.seed, _count_only_tokenizer)
        # the contiguous side refuses requests with several samples or beams: nothing to learn for them
        return not all(r.params.length_known for r in workload.requests if r.params.num_seqs == 1)

    @classmethod
    def create(cls, settings: LabSettings, loaded=None) -> "Lab":
        """Build both engines and queue the preset's requests (under "pow2" / "oracle" with the final
        lengths a headless paged run of the same requests reached: ``needs_final_lengths``).

        Raises ValueError (bad settings or model) before anything is kept, so a caller can leave its
        previous lab in place.
        """
        paged = LLMEngine(settings.config("paged"), loaded)
        contiguous = None
        notes = []
        try:
            contiguous = LLMEngine(settings.config("contiguous"), (paged.model, paged.tokenizer))
        except ValueError as exc:
            notes.append(f"contiguous baseline not available with these settings: {exc}")
        lab = cls(settings, paged, contiguous, notes=notes)
        if settings.preset != "custom":
            tokenize = lambda t: paged.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
            workload = get_scenario(settings.preset).make(settings.seed, tokenize)
            for r in workload.requests:
                lab.check(r.prompt, r.params)
            finals: list[int | None] = [None] * len(workload.requests)
            if contiguous is not None and cls.needs_final_lengths(settings):  # else the engine derives them
                headless = LLMEngine(settings.config("paged"), (paged.model, paged.tokenizer))
                finals = learn_final_lengths(run_workload(headless, workload))
            lab.pending = sorted(zip(workload.requests, finals), key=lambda rf: rf[0].arrival_step)
        return lab

    # ------------------------------------------------------------------------------------------- requests
    def check(self, prompt, params: SamplingParams) -> None:
        """Raise ValueError if the paged engine would refuse this request (nothing is added)."""
        self.paged.check_request(prompt, params)

    def add_request(self, prompt, params: SamplingParams, final_len: int | None = None) -> str:
        """Add a request to both engines now (the contiguous one only if it serves it). Returns its id.

        ``final_len``: its final length known in advance (the "pow2" and "oracle" policies need it; without
        it such a request runs on the paged engine only and ``notes`` says why).
        Raises ValueError and adds nothing if the paged engine refuses it."""
        with self._lock:
            return self._add_request(prompt, params, final_len)

    def _add_request(self, prompt, params: SamplingParams, final_len: int | None) -> str:
        rid = self.paged.add_request(prompt, params)
        self.order.append(rid)
        if self.contiguous is not None:
            try:
                self.contiguous.add_request(prompt, params, request_id=rid, final_len=final_len)
            except ValueError as exc:
                self.notes.append(f"{rid} is not run on the contiguous baseline: {exc}")
        return rid

    # --------------------------------------------------------------------------------------------- steps
    @property
    def step_count(self) -> int:
        return len(self.history)

    def has_work(self) -> bool:
        return bool(self.pending) or self.paged.has_unfinished() or (
            self.contiguous is not None and self.contiguous.has_unfinished())

    def step(self) -> tuple[StepRecord, StepRecord | None]:
        """Admit arrivals due now, then one step of each engine (an engine with nothing to do idles).

        One step at a time: Streamlit may start a new script run (a second click, a key repeat) while the
        last one is still inside this method, and two runs stepping the same engines at once corrupt them
        (IndexError in the scheduler, "step 5 of 3"). The lock makes the second wait for the first (``add_request`` takes it too)."""
        with self._lock:
            return self._step()

    def _step(self) -> tuple[StepRecord, StepRecord | None]:
        while self.pending and self.pending[0][0].arrival_step <= self.step_count:
            r, final_len = self.pending.pop(0)
            self.add_request(r.prompt, r.params, final_len)
        paged = self.paged.step()
        contiguous = self.contiguous.step() if self.contiguous is not None else None
        self.history.append((paged, contiguous))
        return paged, contiguous

    def record(self, index: int) -> tuple[StepRecord, StepRecord | None]:
        """The recorded step ``index`` (0-based), for time travel."""
        return self.history[index]
