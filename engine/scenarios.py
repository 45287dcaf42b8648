"""Named scenarios: a set of requests plus the engine settings that make them interesting.

The CLI, the app and the tests share this registry; later features add scenarios with ``register``.
A scenario is reproducible from its name and a seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .config import SamplingParams


@dataclass
class Scenario:
    """``build(seed)`` returns ``[(prompt, SamplingParams)]``; ``engine_defaults`` are EngineConfig fields
    the scenario needs (e.g. a small pool), which command-line flags may override."""

    name: str
    description: str
    build: Callable[[int], list[tuple[str, SamplingParams]]]
    engine_defaults: dict = field(default_factory=dict)


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


def _single(seed: int) -> list[tuple[str, SamplingParams]]:
    return [("ROMEO. But soft, what light through yonder window breaks?",
             SamplingParams(max_tokens=48, temperature=0.0))]


def _batch(seed: int) -> list[tuple[str, SamplingParams]]:
    # Different prompt and output lengths, sampled with per-request seeds derived from the run's seed.
    return [
        (p, SamplingParams(max_tokens=24 + 8 * i, temperature=0.8, top_p=0.95, seed=seed * 1000 + i))
        for i, p in enumerate(BATCH_PROMPTS)
    ]


def _parallel_sampling(seed: int) -> list[tuple[str, SamplingParams]]:
    return [("JULIET. O Romeo, Romeo, wherefore art thou Romeo?",
             SamplingParams(n=4, max_tokens=32, temperature=0.9, top_p=0.95, seed=seed))]


def _beam_search(seed: int) -> list[tuple[str, SamplingParams]]:
    return [("HAMLET. To be, or not to be,", SamplingParams(beam_width=4, max_tokens=24, temperature=0.0))]


SYSTEM_PROMPT = (
    "You are the Chorus of an old play. Speak in plain verse, keep each answer short, never break the "
    "scene, and remember that the audience sits in a small wooden theatre on a cold winter night. "
    "The players are tired, the candles burn low, and the king has not yet come home from the war. "
)
QUESTIONS = ["Who comes?", "Where is the king?", "What news from France?", "Why so sad, my lord?",
             "Shall we dance tonight?", "Is the queen well?", "What of the battle?", "Who holds the crown?"]


def _shared_prefix(seed: int) -> list[tuple[str, SamplingParams]]:
    return [(SYSTEM_PROMPT + "Q: " + q + "\nA:", SamplingParams(max_tokens=24, temperature=0.8, seed=seed + i))
            for i, q in enumerate(QUESTIONS)]


def _swap(seed: int) -> list[tuple[str, SamplingParams]]:
    return [(p, SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=seed * 1000 + i, ignore_eos=True))
            for i, p in enumerate(BATCH_PROMPTS)]


register(Scenario("single", "one prompt, greedy, 48 tokens, roomy pool", _single))
register(Scenario(
    "parallel-sampling",
    "one prompt, n=4 samples: the samples share the prompt's blocks; the partly filled last block is "
    "copied on write by every sample but the last",
    _parallel_sampling, {"block_size": 16, "num_blocks": 32},
))
register(Scenario(
    "beam-search",
    "one prompt, beam search with 4 beams: beams fork from their parents and share their prefix blocks",
    _beam_search, {"block_size": 8, "num_blocks": 64},
))
register(Scenario(
    "shared-prefix",
    "eight chat requests with one long common system prompt: automatic prefix caching stores its full "
    "blocks once",
    _shared_prefix, {"block_size": 16, "num_blocks": 64},
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
