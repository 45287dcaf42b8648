"""Does a request get the same tokens in a batch as alone? A measurement of this engine (lessons 5 and 7).

The engine samples all sequences of a step together: one forward pass over the batch, one sort and softmax
(``engine/sampler.py``). Only each sequence's uniform draw comes from its own seeded ``torch.Generator``.
So a seeded request draws the same random numbers in any batch, but the probabilities it draws against
are computed by matrix products whose shape depends on the batch; float32 rounding can differ in the last
bits. A draw that lands within that rounding of a boundary between two tokens' cumulative probabilities
picks a different token, and the reply goes its own way from there. Greedy decoding takes the argmax, which
such differences change only at a near-tie.

``measure`` runs the same requests (seeded sampling, and greedy) once all together and once each alone on
the lesson engine (CPU, float32) and compares every reply token for token. For each seeded reply that
differs it reports the first token that differs and how far that step's draw (in the run alone) lay from
the nearest boundary of the cumulative distribution it was inverted against. ``python -m
lessons.batch_invariance`` measures and writes ``lessons/data/batch_invariance.json``, which the lessons
quote (with the machine it ran on); it is a measurement, so it is read, never typed into a lesson.

vLLM on GPUs is not batch-invariant by default either (its kernels reduce in an order that depends on the
batch); vLLM 0.32 has an opt-in batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, ``vllm/envs.py``). The
lessons say where "the same tokens" holds: greedy decoding on this CPU float32 engine.

Measured (``lessons/data/batch_invariance.json``, one thread): the logits of a request (raw scores,
log-probability units) differed by up to 2.8e-05 (2.77e-05, rounded up) between the batch and the run
alone, over 116 seeded and 116 greedy replies of 64 tokens, none of which changed. That logit difference
moves a cumulative probability (0 to 1) by at most e^(2 x 2.8e-05) - 1 = 5.6e-05 (``cdf_shift_bound``); a
seeded flip needs a draw that close to
a boundary, so it is rare and depends on the machine, the thread count and the workload; the lessons quote
whatever the file holds, each figure named with its own quantity.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "batch_invariance.json"
# The measured workload: prompts from the lessons' texts at several lengths, each request seeded apart.
TEXTS = ["ROMEO. But soft, what light through yonder window breaks? ",
         "HAMLET. To be, or not to be, that is the question: ",
         "KING LEAR. Where is my fool? Ho, I think the world's asleep. ",
         "MACBETH. Is this a dagger which I see before me? ",
         "JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. "]
WORKLOAD = {"requests": 116, "max_tokens": 64, "temperature": 1.0, "first_seed": 1000,
            "prompt_lengths": [8, 13, 21, 34], "block_size": 16}


@dataclass
class Flip:
    """One seeded reply that differed: the request, the first output token that differed, and how far the
    draw at that token lay from the nearest boundary of its cumulative distribution (run alone)."""

    request: int           # 0-based index in the workload
    position: int          # output token index (0: the first token after the prompt)
    alone_token: int
    batch_token: int
    draw_distance: float   # |u x total - nearest cumulative probability|, run alone


@dataclass
class Measurement:
    requests: int
    max_tokens: int
    temperature: float
    seeded_differed: int
    greedy_differed: int
    flips: list[Flip] = field(default_factory=list)
    max_logit_diff: float = 0.0  # largest |logit alone - logit in the batch| where the tokens so far agree
    machine: str = ""
    torch_version: str = ""
    threads: int = 0

    @property
    def max_draw_distance(self) -> float:
        return max((f.draw_distance for f in self.flips), default=0.0)


def workload(tokenizer, greedy: bool = False, w: dict = WORKLOAD):
    """The (prompt token ids, params) pairs: request i uses text i % 5 cut to one of the prompt lengths and
    seed ``first_seed + i`` (greedy: temperature 0)."""
    from engine import SamplingParams
    from engine.scenarios.presets import exact_prompt

    tokenize = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    lengths = w["prompt_lengths"]
    return [(exact_prompt(tokenize, TEXTS[i % len(TEXTS)], lengths[(i // len(TEXTS)) % len(lengths)]),
             SamplingParams(max_tokens=w["max_tokens"], temperature=0.0 if greedy else w["temperature"],
                            seed=w["first_seed"] + i, ignore_eos=True))
            for i in range(w["requests"])]


def _cdf(logits: torch.Tensor, params) -> torch.Tensor:
    """The cumulative distribution ``engine.sampler.sample_batch`` inverts for one row (same operations)."""
    vocab = logits.shape[-1]
    k = params.top_k if params.top_k > 0 else vocab
    sorted_logits, _ = torch.sort(logits[None].float() / params.temperature, dim=-1, descending=True)
    sorted_logits.masked_fill_(torch.arange(vocab)[None, :] >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    probs.masked_fill_(before >= params.top_p, 0.0)
    return torch.cumsum(probs, dim=-1)[0]


class _Recorder:
    """Wraps the engine's ``sample_batch`` and keeps, per sequence (its generator, in order of first
    appearance) and step, the logits row and the uniform draw the row's generator is about to make (read
    from a copy of its state, so the run is unchanged)."""

    def __init__(self, inner):
        self.inner, self.rows, self.order = inner, {}, []

    def __call__(self, logits, params, generators):
        for row, p, g in zip(logits, params, generators):
            if id(g) not in self.rows:
                self.rows[id(g)] = []
                self.order.append(id(g))
            copy = torch.Generator(device="cpu")
            copy.set_state(g.get_state())
            u = float(torch.rand((), generator=copy)) if not p.greedy else 0.0
            self.rows[id(g)].append((row.detach().float().cpu().clone(), p, u))
        return self.inner(logits, params, generators)

    def per_sequence(self) -> list[list]:
        return [self.rows[k] for k in self.order]


def _run(loaded, requests, config):
    """(every request's output token ids, the recorded rows per sequence in order of first sampling)."""
    import engine.llm_engine as llm
    from lessons.common import run_engine

    inner = llm.sample_batch
    llm.sample_batch = recorder = _Recorder(inner)
    try:
        run = run_engine(loaded, requests, label="batch invariance", **config)
    finally:
        llm.sample_batch = inner
    return [run.outputs[r].output_token_ids for r in run.request_ids], recorder.per_sequence()


def measure(loaded, w: dict = WORKLOAD) -> Measurement:
    """Run the workload batched and each request alone, seeded and greedy; see the module docstring."""
    tokenizer = loaded[1]
    longest = max(w["prompt_lengths"]) + w["max_tokens"]
    per_request = -(-longest // w["block_size"])
    config = dict(block_size=w["block_size"], num_blocks=per_request * w["requests"] + 8,
                  max_model_len=longest, watermark=0.0, enable_prefix_caching=False)
    counts, flips, largest = {}, [], 0.0
    for greedy in (False, True):
        reqs = workload(tokenizer, greedy, w)
        batched, batch_rows = _run(loaded, reqs, config)
        differed = 0
        for i, req in enumerate(reqs):
            (alone,), (rows,) = _run(loaded, [req], dict(config, num_blocks=per_request + 1))
            same = next((j for j, (a, b) in enumerate(zip(alone, batched[i])) if a != b), len(alone))
            # the logits are comparable up to the first token that differs (the same tokens before it)
            for j in range(min(same + 1, len(rows))):
                largest = max(largest, float((rows[j][0] - batch_rows[i][j][0]).abs().max()))
            if alone == batched[i]:
                continue
            differed += 1
            if not greedy:
                row, p, u = rows[same]
                cdf = _cdf(row, p)
                x = u * float(cdf[-1])
                flips.append(Flip(i, same, alone[same], batched[i][same], float((cdf - x).abs().min())))
        counts[greedy] = differed
    return Measurement(w["requests"], w["max_tokens"], w["temperature"], counts[False], counts[True], flips,
                       largest, platform.processor() or platform.machine(), torch.__version__,
                       torch.get_num_threads())


def load(path: Path = DATA) -> Measurement:
    """The measurement the lessons quote. Raises FileNotFoundError or ValueError naming the file."""
    try:
        d = json.loads(path.read_text())
        d["flips"] = [Flip(**f) for f in d["flips"]]
        return Measurement(**d)
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a batch-invariance measurement ({exc})") from exc


def cdf_shift_bound(max_logit_diff: float, temperature: float) -> float:
    """How far a cumulative probability can move when every logit moves by at most ``max_logit_diff``.

    Units: logits are the model's raw scores (natural-log units, divided by ``temperature`` before the
    softmax); the result is a probability (0 to 1). Each logit over T moves by at most d = max_logit_diff / T
    and the softmax's normaliser by at most d too, so every token's probability changes by a factor within
    e^(±2d), and a cumulative probability C (at most 1) by at most (e^(2d) - 1) x C <= e^(2d) - 1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature {temperature!r}: the bound is for sampling (a temperature above 0)")
    return math.expm1(2 * max_logit_diff / temperature)


def round_up(x: float, digits: int = 2) -> float:
    """``x`` rounded up to ``digits`` significant figures (2.765e-05 -> 2.8e-05, 5.5e-05 stays 5.5e-05), so an
    "up to" or "at most" quoted with it stays true."""
    if x <= 0 or not math.isfinite(x):
        return x
    scale = 10 ** (math.floor(math.log10(x)) - digits + 1)
    shown = float(f"{x:.{digits - 1}e}")
    return shown if shown >= x else float(f"{math.ceil(x / scale) * scale:.{digits - 1}e}")


def facts(m: Measurement | None = None) -> dict:
    """The figures and sentences the lessons quote, from the measurement (``load()``). Two quantities are
    kept apart and each is named with its unit where it is said: the **logit** difference (raw scores,
    log-probability units) between a batch and a run alone, and the **cumulative probability** (0 to 1) a
    seeded draw is compared with: how far it can move (``cdf_shift_bound``), or, for a reply that changed, how
    close the draw lay to a boundary."""
    m = m or load()
    n, k, tokens = m.requests, m.seeded_differed, m.max_tokens
    # The logit figure is shown rounded UP (a true "up to"), and the bound is computed from the figure as
    # shown, so a reader can redo e^(2 x shown) - 1 from the page; it is still a bound for the real maximum.
    shown_logit = round_up(m.max_logit_diff)
    logit = f"{shown_logit:.1e}"
    shift = f"{cdf_shift_bound(float(logit), m.temperature):.1e}"
    if float(shift) < cdf_shift_bound(m.max_logit_diff, m.temperature):  # rounded below the real bound
        shift = f"{round_up(cdf_shift_bound(float(logit), m.temperature)):.1e}"
    # the maximum is taken over every reply the measurement compared: the seeded ones and the greedy ones
    replies = f"{n} seeded and {n} greedy replies of {tokens} tokens"
    logit_clause = (f"the logits (the model's raw scores, in log-probability units) of a step differed by up to "
                    f"{logit} between one batch and a run alone")
    if m.flips:
        long = (f"{k} of {n} seeded samples of {tokens} tokens came out different in one batch than run alone; "
                f"over those and {n} greedy replies, {logit_clause}; and at each reply that changed, the random "
                f"draw lay within {m.max_draw_distance:.1e} (a cumulative probability, on a scale of 0 to 1) of "
                "the boundary between two tokens, close enough for that difference to move the boundary past it")
        short = f"{k} of {n} seeded samples differed between a batch and a run alone"
    else:
        long = (f"over {replies}, {logit_clause}; a difference d of that size moves the cumulative "
                f"probabilities a seeded draw is compared with (on a scale of 0 to 1) by at most e^(2d) - 1 = "
                f"{shift}. None of these replies changed, but a draw that lands closer than that to the "
                "boundary between two tokens could pick the other one")
        short = (f"the logits (raw scores) of {replies} differed by up to {logit} between a batch and a run "
                 "alone")
    return {"bi_seeded": f"{k} of {n}", "bi_greedy": f"{m.greedy_differed} of {n}", "bi_tokens": tokens,
            "bi_logit": logit, "bi_cdf_shift": shift,
            "bi_distance": f"{m.max_draw_distance:.1e}" if m.flips else "(none)",
            "bi_long": long, "bi_short": short,
            "bi_source": f"`lessons/batch_invariance.py`, run on {m.machine} with torch {m.torch_version}, "
                         f"{m.threads} thread{'s' * (m.threads != 1)}"}


if __name__ == "__main__":
    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_model

    # one thread: the measurement is of the engine's arithmetic, and a busy machine's oversubscribed threads
    # made each run 40x slower (the thread count is recorded with the result)
    torch.set_num_threads(1)
    result = measure(load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"))
    DATA.write_text(json.dumps(asdict(result), indent=1) + "\n")
    print(json.dumps(asdict(result), indent=1))
