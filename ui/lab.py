"""A ``Lab``: one browser session's pair of engines (paged and contiguous baseline) on the same requests,
with the recorded StepRecords for time travel. No Streamlit here, so it is tested directly.

Both engines get the same KV byte budget and the same requests at the same steps. Stepping the lab steps
each engine that still has work; stepping back only moves a cursor over the recorded steps (nothing is
re-run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import EngineConfig, LLMEngine, SamplingParams, StepRecord
from engine.scenarios import get_scenario
from engine.workloads import WorkloadRequest


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

    def config(self, allocator: str) -> EngineConfig:
        budget = int(self.kv_budget_mb * 2**20) if self.kv_budget_mb > 0 else None
        return EngineConfig(model=self.model, device="auto", block_size=self.block_size,
                            num_blocks=None if budget else self.num_blocks, kv_budget_bytes=budget,
                            max_model_len=self.max_model_len, enable_prefix_caching=self.enable_prefix_caching,
                            preemption_mode=self.preemption_mode, swap_space_blocks=self.swap_space_blocks,
                            allocator=allocator, reservation_tokens=self.reservation)


@dataclass
class Lab:
    settings: LabSettings
    paged: LLMEngine
    contiguous: LLMEngine | None
    pending: list[WorkloadRequest] = field(default_factory=list)
    history: list[tuple[StepRecord, StepRecord | None]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, settings: LabSettings, loaded=None) -> "Lab":
        """Build both engines and queue the preset's requests.

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
            lab.pending = sorted(workload.requests, key=lambda r: r.arrival_step)
        return lab

    # ------------------------------------------------------------------------------------------- requests
    def check(self, prompt, params: SamplingParams) -> None:
        """Raise ValueError if the paged engine would refuse this request (nothing is added)."""
        self.paged.check_request(prompt, params)

    def add_request(self, prompt, params: SamplingParams) -> str:
        """Add a request to both engines now (the contiguous one only if it serves it). Returns its id.
        Raises ValueError and adds nothing if the paged engine refuses it."""
        rid = self.paged.add_request(prompt, params)
        self.order.append(rid)
        if self.contiguous is not None:
            try:
                self.contiguous.add_request(prompt, params, request_id=rid)
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
        """Admit arrivals due now, then one step of each engine (an engine with nothing to do idles)."""
        while self.pending and self.pending[0].arrival_step <= self.step_count:
            r = self.pending.pop(0)
            self.add_request(r.prompt, r.params)
        paged = self.paged.step()
        contiguous = self.contiguous.step() if self.contiguous is not None else None
        self.history.append((paged, contiguous))
        return paged, contiguous

    def record(self, index: int) -> tuple[StepRecord, StepRecord | None]:
        """The recorded step ``index`` (0-based), for time travel."""
        return self.history[index]
