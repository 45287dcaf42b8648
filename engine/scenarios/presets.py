"""Named scenarios: a workload plus the engine settings that make it interesting.

The CLI, the app and the tests share this registry; later features add scenarios with ``register``.
A scenario is reproducible from its name and a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..config import EMBEDDED_HYBRID_MODEL, SamplingParams
from .workloads import Workload, WorkloadRequest, lognormal_lengths, synthetic_workload


# LESSON_BRIEF section 2: final lengths of 8 requests (numpy, seed 7), max length 2,048, block size 16.
LESSON_LENGTHS = [853, 581, 631, 812, 541, 709, 758, 241]


@dataclass
class Scenario:
    """``make(seed, tokenize)`` returns the Workload; ``engine_defaults`` are EngineConfig fields the
    scenario needs (e.g. a small pool; the lessons' scenarios set ``watermark`` 0 to keep the exact pool), which command-line flags may override; ``compare`` scenarios run
    the paged engine and the contiguous baseline on the same requests by default. An ``engine_defaults``
    "model" names the model the scenario is about (a folder, e.g. ``EMBEDDED_HYBRID_MODEL``; ``model``); without it
    the scenario runs on the embedded model or the one the caller names (``RunSpec.from_preset``)."""

    name: str
    description: str
    build: Callable
    engine_defaults: dict = field(default_factory=dict)
    compare: bool = False

    @property
    def model(self) -> str | None:
        """The model this scenario is about, or None (any model; the embedded one by default)."""
        return self.engine_defaults.get("model")

    def make(self, seed: int, tokenize: Callable[[str], list[int]]) -> Workload:
        built = self.build(seed, tokenize)
        if isinstance(built, Workload):
            return built
        return Workload(self.name, seed, [WorkloadRequest(0, p, sp) for p, sp in built], self.description)


SCENARIOS: dict[str, Scenario] = {}


def register(scenario: Scenario) -> Scenario:
    SCENARIOS[scenario.name] = scenario
    return scenario


def get_scenario(name: str) -> Scenario:
    """Raises ValueError naming the unknown scenario and the known ones."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(sorted(SCENARIOS))}") from None


BATCH_PROMPTS = [
    "ROMEO. ",
    "To be, or not to be, that is the question:",
    "KING LEAR. Where is my fool? Ho, I think the world's asleep.",
    "Now is the winter of our discontent made glorious summer by this sun of York;",
    "HAMLET. ",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
]


def _single(seed: int, tokenize=None) -> list[tuple[str, SamplingParams]]:
    return [("ROMEO. But soft, what light through yonder window breaks?",
             SamplingParams(max_tokens=48, temperature=0.0))]


def _batch(seed: int, tokenize=None) -> list[tuple[str, SamplingParams]]:
    # Different prompt and output lengths, sampled with per-request seeds derived from the run's seed.
    return [
        (p, SamplingParams(max_tokens=24 + 8 * i, temperature=0.8, top_p=0.95, seed=seed * 1000 + i))
        for i, p in enumerate(BATCH_PROMPTS)
    ]


def _parallel_sampling(seed: int, tokenize=None) -> list[tuple[str, SamplingParams]]:
    return [("JULIET. O Romeo, Romeo, wherefore art thou Romeo?",
             SamplingParams(n=4, max_tokens=32, temperature=0.9, top_p=0.95, seed=seed))]


def _beam_search(seed: int, tokenize=None) -> list[tuple[str, SamplingParams]]:
    return [("HAMLET. To be, or not to be,", SamplingParams(beam_width=4, max_tokens=24, temperature=0.0))]


SYSTEM_PROMPT = (
    "You are the Chorus of an old play. Speak in plain verse, keep each answer short, never break the "
    "scene, and remember that the audience sits in a small wooden theatre on a cold winter night. "
    "The players are tired, the candles burn low, and the king has not yet come home from the war. "
)
QUESTIONS = ["Who comes?", "Where is the king?", "What news from France?", "Why so sad, my lord?",
             "Shall we dance tonight?", "Is the queen well?", "What of the battle?", "Who holds the crown?"]


def _shared_prefix(seed: int, tokenize=None) -> list[tuple[str, SamplingParams]]:
    return [(SYSTEM_PROMPT + "Q: " + q + "\nA:", SamplingParams(max_tokens=24, temperature=0.8, seed=seed + i))
            for i, q in enumerate(QUESTIONS)]


def _swap(seed: int, tokenize=None) -> list[tuple[str, SamplingParams]]:
    return [(p, SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=seed * 1000 + i, ignore_eos=True))
            for i, p in enumerate(BATCH_PROMPTS)]


# Every scenario names its max_model_len, so the CLI, the Playground and Compare run the same thing (the
# contiguous "max" reservation is that length).
register(Scenario("single", "one prompt, greedy, 48 tokens, roomy pool", _single,
                  {"block_size": 16, "num_blocks": 64, "max_model_len": 256}))
register(Scenario(
    "parallel-sampling",
    "one prompt, n=4 samples: the samples share the prompt's blocks; the partly filled last block is "
    "copied on write by every sample but the last",
    # "max_tokens" (prompt + max_tokens, what a server knows at admission): four rows of 256 slots would
    # not fit the 512-slot region at all, and the baseline beside the copy-on-write presets is the point
    _parallel_sampling, {"block_size": 16, "num_blocks": 32, "max_model_len": 256, "contiguous_policy": "max_tokens"},
))
register(Scenario(
    "beam-search",
    "one prompt, beam search with 4 beams: beams fork from their parents and share their prefix blocks",
    _beam_search, {"block_size": 8, "num_blocks": 64, "max_model_len": 256, "contiguous_policy": "max_tokens"},
))
register(Scenario(
    "shared-prefix",
    "eight chat requests with one long common system prompt: automatic prefix caching stores its full "
    "blocks once",
    _shared_prefix, {"block_size": 16, "num_blocks": 64, "max_model_len": 256},
))
register(Scenario(
    "swap",
    "six requests in a pool of 16 blocks of 8: preemption copies the victim's blocks to a CPU swap pool "
    "and back, no recompute",
    _swap, {"block_size": 8, "num_blocks": 16, "max_model_len": 96, "preemption_mode": "swap",
            "swap_space_blocks": 64},
))
register(Scenario(
    "batch",
    "six prompts of different lengths decoding together in a pool of 12 blocks of 16: "
    "too small for all of them, so the scheduler preempts and recomputes",
    _batch,
    {"block_size": 16, "num_blocks": 12, "max_model_len": 128},
))


def _lesson_lengths(seed: int, tokenize) -> list[tuple[str, SamplingParams]]:
    # a short prompt, then exactly L - prompt tokens: the final lengths are the lesson's
    prompt = "ROMEO. "
    n = len(tokenize(prompt))
    return [(prompt, SamplingParams(max_tokens=length - n, temperature=0.8, seed=seed + i, ignore_eos=True))
            for i, length in enumerate(LESSON_LENGTHS)]


def _chat_workload(seed: int, tokenize) -> Workload:
    rng = np.random.default_rng(seed)
    n = 32
    prompts = lognormal_lengths(rng, n, median=48, sigma=0.8, lo=8, hi=300)
    outputs = lognormal_lengths(rng, n, median=64, sigma=0.7, lo=8, hi=200)
    return synthetic_workload("chat-workload", seed, tokenize, n, prompts, outputs)


def reply_end_ids(tokenize) -> tuple[int, ...]:
    """Token ids of the text's question and exclamation marks: where a chat reply of the embedded model
    (trained on plays) ends, since it almost never writes its end-of-sequence token."""
    return tuple(sorted({t for mark in ("?", "!", "?--", "!--") for t in tokenize(mark) if len(tokenize(mark)) == 1}))


def _chat_arrivals(seed: int, tokenize) -> Workload:
    rng = np.random.default_rng(seed)
    n = 32
    prompts = lognormal_lengths(rng, n, median=48, sigma=0.8, lo=8, hi=300)
    return synthetic_workload("chat-arrivals", seed, tokenize, n, prompts, [160] * n, arrival="poisson", rate=0.5,
                              stop_token_ids=reply_end_ids(tokenize))


register(Scenario(
    "lesson-lengths",
    "lesson 2's 8 requests (final lengths 853, 581, 631, 812, 541, 709, 758, 241), max length 2,048, B=16: "
    "how much of its memory each allocator leaves empty",
    _lesson_lengths, {"block_size": 16, "num_blocks": 1024, "max_model_len": 2048, "reservation_tokens": 2048,
                      "watermark": 0.0},
    compare=True,
))
register(Scenario(
    "chat-workload",
    "32 chat-like requests with long-tailed prompt and reply lengths in 128 blocks of 16 (2,048 slots): "
    "the contiguous baseline reserves 512 slots each, so it runs 4 at a time and queues the rest",
    _chat_workload, {"block_size": 16, "num_blocks": 128, "max_model_len": 512, "reservation_tokens": 512},
    compare=True,
))
register(Scenario(
    "chat-arrivals",
    "32 chat requests arriving over time (Poisson, 0.5 per step) whose replies end where the model writes "
    "'?' or '!' (160 tokens at most), in 128 blocks of 16: no one knows a reply's length in advance, so a "
    "contiguous reservation must guess it",
    _chat_arrivals, {"block_size": 16, "num_blocks": 128, "max_model_len": 512, "reservation_tokens": 512},
    compare=True,
))


# ------------------------------------------------------------------------------------ lesson scenarios
def exact_prompt(tokenize: Callable[[str], list[int]], text: str, n: int) -> list[int]:
    """A prompt of exactly ``n`` token ids: ``text``'s tokens, repeated as needed, cut at ``n``."""
    piece = tokenize(text)
    if not piece or n < 1:
        raise ValueError(f"cannot make a {n}-token prompt from {text!r}")
    return (piece * (n // len(piece) + 1))[:n]


LIFE_TEXT = "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
PRESSURE_TEXTS = ["ROMEO. But soft, what light through yonder window breaks? ",
                  "HAMLET. To be, or not to be, that is the question: ",
                  "KING LEAR. Where is my fool? Ho, I think the world's asleep. ",
                  "MACBETH. Is this a dagger which I see before me? "]
PRESSURE_LONG_TEXT = "JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. "


def _life_of_a_request(seed: int, tokenize) -> list[tuple[list[int], SamplingParams]]:
    return [(exact_prompt(tokenize, LIFE_TEXT, 40), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]


def _memory_pressure(seed: int, tokenize) -> list[tuple[list[int], SamplingParams]]:
    short = [(exact_prompt(tokenize, t, 20), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
             for t in PRESSURE_TEXTS]
    return short + [(exact_prompt(tokenize, PRESSURE_LONG_TEXT, 100),
                     SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))]


register(Scenario(
    "life-of-a-request",
    "one prompt of exactly 40 tokens writes 12 more, greedy, in a pool of 8 blocks of 16: watch prefill fill "
    "whole blocks and decode take a new block only when the last one is full (lesson 3)",
    _life_of_a_request, {"block_size": 16, "num_blocks": 8, "max_model_len": 52, "enable_prefix_caching": False,
                         "watermark": 0.0},
))
register(Scenario(
    "memory-pressure",
    "four 20-token prompts writing 30 tokens each and one 100-token prompt, greedy, in 10 blocks of 16: the long "
    "prompt waits at the door, and mid-generation the pool runs out and the newest request is preempted "
    "(lesson 5)",
    _memory_pressure, {"block_size": 16, "num_blocks": 10, "max_model_len": 128, "enable_prefix_caching": False,
                       "swap_space_blocks": 16, "watermark": 0.0},
))


# ------------------------------------------------------------------------------------ hybrid models
HYBRID_TEXT = "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "


def _hybrid_window(seed: int, tokenize) -> list[tuple[list[int], SamplingParams]]:
    # 62 prompt tokens: the step that computes position 63 = 48 - 1 + 16 (step 3) frees block 0 of the sliding
    # group, the one that computes 79 (step 19) block 1; the short request never leaves its window
    return [(exact_prompt(tokenize, HYBRID_TEXT, 62), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
            (exact_prompt(tokenize, PRESSURE_TEXTS[1], 20),
             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]


register(Scenario(
    "hybrid-window",
    "the hybrid model (layers 0, 2: a sliding window of 48 tokens; 1, 3: full attention), vLLM V1: a 62-token "
    "prompt decodes past the window, so at step 3 its first block leaves the window: the sliding group's table "
    "holds the null block and the pool one block fewer than the same model with every layer full",
    _hybrid_window, {"model": EMBEDDED_HYBRID_MODEL, "semantics": "v1", "block_size": 16, "num_blocks": 24,
                     "max_model_len": 128, "enable_prefix_caching": False, "watermark": 0.0},
))
