"""Workloads: requests with arrival steps, generated reproducibly from (name, seed).

Shared by the CLI scenarios, the app and the benchmarks, so the paged engine and the contiguous baseline
can be run on exactly the same requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config import SamplingParams

# Public-domain text (Shakespeare, Coriolanus I.1) that prompts are cut from, so prompts are real text.
SOURCE_TEXT = (
    "FIRST CITIZEN. Before we proceed any further, hear me speak. ALL. Speak, speak. FIRST CITIZEN. You are "
    "all resolved rather to die than to famish? ALL. Resolved, resolved. FIRST CITIZEN. First, you know Caius "
    "Marcius is chief enemy to the people. ALL. We know't, we know't. FIRST CITIZEN. Let us kill him, and "
    "we'll have corn at our own price. Is't a verdict? ALL. No more talking on't; let it be done. Away, away! "
    "SECOND CITIZEN. One word, good citizens. FIRST CITIZEN. We are accounted poor citizens, the patricians "
    "good. What authority surfeits on would relieve us: if they would yield us but the superfluity while it "
    "were wholesome, we might guess they relieved us humanely; but they think we are too dear: the leanness "
    "that afflicts us, the object of our misery, is as an inventory to particularise their abundance; our "
    "sufferance is a gain to them. Let us revenge this with our pikes, ere we become rakes: for the gods know "
    "I speak this in hunger for bread, not in thirst for revenge. SECOND CITIZEN. Would you proceed "
    "especially against Caius Marcius? ALL. Against him first: he's a very dog to the commonalty. "
)


@dataclass
class WorkloadRequest:
    """One request of a workload: added to the engine when it reaches step ``arrival_step``."""

    arrival_step: int
    prompt: str | list[int]
    params: SamplingParams


@dataclass
class Workload:
    name: str
    seed: int
    requests: list[WorkloadRequest] = field(default_factory=list)
    description: str = ""


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    """Long-tailed lengths (a log-normal with this median and sigma), clipped to [lo, hi]: most requests
    short, a few long, as in chat traffic (e.g. the ShareGPT length distributions vLLM was evaluated on)."""
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int).tolist()


def uniform_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return rng.integers(lo, hi + 1, n).tolist()


def arrivals(rng: np.random.Generator, n: int, mode: str, rate: float) -> list[int]:
    """Arrival steps: "all" at step 0, or "poisson" with ``rate`` requests per step on average."""
    if mode == "all":
        return [0] * n
    if mode == "poisson":
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 1e-3):
            raise ValueError(f"poisson arrival rate must be a finite number >= 0.001 requests per step, got {rate}")
        return np.floor(np.cumsum(rng.exponential(1.0 / rate, n))).astype(int).tolist()
    raise ValueError(f"arrival mode must be 'all' or 'poisson', got {mode!r}")


def synthetic_workload(name: str, seed: int, tokenize: Callable[[str], list[int]], num_requests: int,
                       prompt_lens: list[int], output_lens: list[int], arrival: str = "all", rate: float = 1.0,
                       system_prompt: str = "", temperature: float = 0.8,
                       stop_token_ids: tuple[int, ...] = ()) -> Workload:
    """Requests whose prompts are ``prompt_lens[i]`` tokens of real text (after an optional shared
    ``system_prompt``). Without ``stop_token_ids`` each generates exactly ``output_lens[i]`` tokens
    (``ignore_eos``); with them each stops where the model first writes one of them (or at the end-of-sequence
    token), ``output_lens[i]`` at most, so no one knows its length in advance."""
    for name, lens in (("prompt_lens", prompt_lens), ("output_lens", output_lens)):
        if len(lens) != num_requests or any(int(n) < 1 for n in lens):
            raise ValueError(f"{name} must hold {num_requests} lengths >= 1, got {list(lens)[:8]}...")
    rng = np.random.default_rng(seed)
    source = tokenize(SOURCE_TEXT)
    system = tokenize(system_prompt) if system_prompt else []
    steps = arrivals(rng, num_requests, arrival, rate)
    reqs = []
    for i in range(num_requests):
        start = int(rng.integers(0, len(source)))
        body = [source[(start + j) % len(source)] for j in range(prompt_lens[i])]
        params = SamplingParams(max_tokens=output_lens[i], temperature=temperature, top_p=0.95,
                                seed=seed * 10_000 + i, ignore_eos=not stop_token_ids, stop_token_ids=stop_token_ids)
        reqs.append(WorkloadRequest(steps[i], system + body, params))
    return Workload(name, seed, reqs)


def learn_final_lengths(outputs, records=None) -> list[int]:
    """Each request's final length (tokens), as a run found it: what the contiguous "pow2" and "oracle"
    policies must know in advance, so that every row of the request is long enough to repeat the run.

    ``outputs``: the run's RequestOutputs; ``records``: its StepRecords, if kept. A request's length is
    - prompt + the generated tokens of its longest completion: with ``n`` samples every sample's row is
      reserved that long (``LLMEngine.add_request``), so none stops at "length" before it did here;
    - with ``records``, at least the longest any of its sequences reached, counting the token each step
      samples past what it computed (``start_pos + num_tokens + 1`` of a scheduled sequence; "<id>.<k>" are
      V1's child requests of a request with n samples). Beam search needs it: its outputs are the best
      finished hypotheses, but the search may go on past the longest of them (live beams run until none can
      beat the worst finished one), and a row shorter than that depth stops every beam at "length" early,
      which changes the result. Without ``records`` a beam search under "pow2" / "oracle" may end early.
    Returns one length per output, in order.
    """
    finals = [len(o.prompt_token_ids) + max((len(c.token_ids) for c in o.outputs), default=0) for o in outputs]
    if records is None:
        return finals
    deepest: dict[str, int] = {}
    for record in records:
        for s in record.scheduled:
            deepest[s.request_id] = max(deepest.get(s.request_id, 0), s.start_pos + s.num_tokens + 1)
    return [max([final] + [n for rid, n in deepest.items() if rid == o.request_id
                           or rid.startswith(f"{o.request_id}.")]) for o, final in zip(outputs, finals)]


def run_workload(engine, workload: Workload, on_step=None, max_steps: int = 1_000_000,
                 final_lens: list[int] | None = None) -> list:
    """Feed the workload to ``engine`` by arrival step and step until every request finished.

    ``final_lens``: each request's final length known in advance (``learn_final_lengths`` of an earlier
    run of the same workload), passed to ``add_request``.

    Returns the RequestOutputs in workload order. Raises RuntimeError if ``max_steps`` pass first.
    """
    pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_step)
    ids: dict[int, str] = {}
    start = engine.step_count
    while pending or engine.has_unfinished():
        now = engine.step_count - start
        while pending and workload.requests[pending[0]].arrival_step <= now:
            i = pending.pop(0)
            r = workload.requests[i]
            ids[i] = engine.add_request(r.prompt, r.params, final_len=final_lens[i] if final_lens else None)
        record = engine.step()
        if on_step is not None:
            on_step(record)
        if engine.step_count - start > max_steps:
            raise RuntimeError(f"workload {workload.name!r} did not finish within {max_steps} steps")
    return [engine.get_output(ids[i]) for i in range(len(workload.requests))]
