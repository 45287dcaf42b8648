"""Issue 23, items 11 and 12: what can never run is refused at once, in both semantics, and a step's work does
not grow with the waiting queue beyond what it admits.

- n above vLLM's ``VLLM_MAX_N_SEQUENCES`` (16,384) is refused by ``SamplingParams``; V1 builds its n child
  requests from the parent validated once; ``params`` that is no ``SamplingParams`` is a ValueError.
- A prompt too long for the pool or max_model_len is refused by its length before any per-token work: a
  token list before its ids are read, a text before it is tokenized (at least len / L tokens, L the
  tokenizer's longest token in characters).
- A step's work: Python calls made inside ``engine/`` during one step, counted (not timed) with 100 and
  with 4,000 requests waiting behind a full pool; and the snapshot that keeps untouched requests' states
  equals one built from scratch, step by step, on random workloads of both semantics.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import engine as engine_pkg
from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine, SamplingParams
from infra import class_limits as limits
from engine.config import MAX_N_SEQUENCES
from engine.model_loader import load_model
from engine.sequence import FINISHED

ENGINE_DIR = str(Path(engine_pkg.__file__).resolve().parent)


@pytest.fixture(scope="module")
def loaded():
    return load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32")


def build(loaded, **kwargs) -> LLMEngine:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(**kwargs), loaded)


def state(engine):
    return (list(engine.requests), list(engine.parents), [r.request_id for r in engine.scheduler.waiting],
            [r.request_id for r in engine.scheduler.running], engine.block_manager.num_free_blocks)


# ------------------------------------------------------------------------------------------ item 11: n
@pytest.mark.parametrize("field", ["n", "beam_width"])
def test_more_sequences_than_vllms_cap_are_refused_by_name(field):
    SamplingParams(**{field: MAX_N_SEQUENCES})
    with pytest.raises(ValueError, match=rf"{field} must be at most 16,384 .*VLLM_MAX_N_SEQUENCES.*got 1,000,000"):
        SamplingParams(**{field: 10**6})


@pytest.mark.parametrize("semantics", ["paper", "v1"])
@pytest.mark.parametrize("params", ["x", {"n": 2}, 3, ""])
def test_params_that_are_not_sampling_params_are_refused_in_both_semantics(loaded, semantics, params):
    engine = build(loaded, num_blocks=16, max_model_len=64, semantics=semantics)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    before = state(engine)
    with pytest.raises(ValueError, match=f"params must be a SamplingParams, got {type(params).__name__}"):
        engine.add_request([5, 6], params)
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.check_request([5, 6], params)
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.generate([[5, 6]], params)
    assert state(engine) == before


def test_v1_children_are_the_parent_with_their_own_id_seed_and_sequence(loaded):
    engine = build(loaded, num_blocks=16, max_model_len=64, semantics="v1")
    engine.add_request([5, 6, 7], SamplingParams(n=3, seed=40, max_tokens=2, temperature=0.8), request_id="P")
    kids = [engine.requests[f"P.{i}"] for i in range(3)]
    assert engine.parents == {"P": ["P.0", "P.1", "P.2"]}
    assert [(k.seed, k.params.seed, k.params.n, k.parent_id) for k in kids] == [(40 + i, 40 + i, 1, "P") for i in range(3)]
    assert [k.seqs[0].seq_id for k in kids] == ["P.0", "P.1", "P.2"]
    assert len({id(k.seqs[0].token_ids) for k in kids}) == 3  # each appends to its own list
    assert all(k.seqs[0].token_ids == [5, 6, 7] and k.seqs[0].prompt_len == 3 for k in kids)
    # seeded children sample like a lone request of their seed
    outs = engine.generate([[5, 6, 7]], SamplingParams(n=2, seed=9, max_tokens=3, temperature=0.8))[0].outputs
    alone = build(loaded, num_blocks=16, max_model_len=64, semantics="v1")
    single = alone.generate([[5, 6, 7]], SamplingParams(seed=10, max_tokens=3, temperature=0.8))[0]
    assert outs[1].token_ids == single.output_token_ids


def test_v1_child_ids_already_taken_refuse_the_whole_request(loaded):
    engine = build(loaded, num_blocks=16, max_model_len=64, semantics="v1")
    engine.add_request([5], SamplingParams(max_tokens=1), request_id="Q.2")
    before = state(engine)
    with pytest.raises(ValueError, match="request_id 'Q.2' is already in use"):
        engine.add_request([5, 6], SamplingParams(n=4, max_tokens=1), request_id="Q")
    assert state(engine) == before


def test_a_class_server_counts_v1_child_requests_before_adding_any(loaded, monkeypatch):
    """The cap is the app's (infra/class_limits.py), applied where the Playground's lab adds a request."""
    from engine.scenarios.run_spec import RunSpec
    from ui.lab import Lab

    monkeypatch.setenv(limits.CLASS_SERVER_ENV, "1")
    lab = Lab.create(RunSpec(model=EMBEDDED_MODEL, preset="custom", num_blocks=16, max_model_len=64,
                                 semantics="v1"), loaded)
    engine = lab.run.paged
    cap = limits.class_limits().max_requests
    lab.add_request([5, 6], SamplingParams(max_tokens=1))
    before = state(engine)
    with pytest.raises(ValueError, match=rf"at most {cap} requests per run \(1 added already, {cap:,} more asked\)"):
        lab.add_request([5, 6], SamplingParams(n=cap, max_tokens=1))
    assert state(engine) == before
    lab.add_request([5, 6], SamplingParams(n=cap - 1, max_tokens=1))
    assert len(engine.requests) == cap


# ------------------------------------------------------------------------------ item 11: work per step
def calls_in_engine(fn) -> int:
    """Python function calls (and builtin calls) made from code in ``engine/`` while ``fn`` runs."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(ENGINE_DIR):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def step_work(loaded, waiting: int, policy: str, semantics: str) -> tuple[int, int, int]:
    """Work of the third step of an engine whose 8-block pool is full, with ``waiting`` requests behind:
    (calls inside engine/, requests admitted, requests still waiting)."""
    extra = {"scheduling_policy": policy} if semantics == "v1" else {}
    engine = build(loaded, block_size=16, num_blocks=8, max_model_len=128, semantics=semantics,
                   enable_prefix_caching=False, max_num_seqs=4, watermark=0.0, **extra)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for k in range(4):  # the running ones: 4 x 2 blocks fill the pool
        engine.add_request([10 + k] * 20, params, priority=0)
    if semantics == "v1":  # one request of `waiting` child requests: quick to add, and they all wait
        engine.add_request([7] * 20, SamplingParams(n=waiting, max_tokens=20, ignore_eos=True, seed=1), priority=1)
    else:
        for _ in range(waiting):
            engine.add_request([7] * 20, params)
    engine.step()
    engine.step()  # warm: every token text decoded once
    admitted = len(engine.scheduler.running)
    calls = calls_in_engine(engine.step)
    return calls, len(engine.scheduler.running) - admitted, len(engine.scheduler.waiting)


@pytest.mark.parametrize("semantics, policy", [("v1", "fcfs"), ("v1", "priority"), ("paper", "fcfs")])
def test_a_steps_work_does_not_grow_with_the_waiting_queue(loaded, semantics, policy):
    small = step_work(loaded, 100, policy, semantics)
    large = step_work(loaded, 4000, policy, semantics)
    assert small[1] == large[1] == 0 and large[2] == 4000  # nobody admitted: the pool is full
    assert large[0] == small[0], f"{large[0]} calls with 4,000 waiting, {small[0]} with 100"


def test_admitting_from_a_long_priority_queue_visits_only_the_admitted(loaded):
    """The priority policy's choice is a heap, not a min over the queue: admitting k requests out of
    4,000 costs what admitting them out of 100 does."""
    def admit(waiting: int) -> tuple[int, list[str]]:
        engine = build(loaded, block_size=16, num_blocks=8, max_model_len=128, semantics="v1",
                       scheduling_policy="priority", max_num_seqs=4, enable_prefix_caching=False)
        rng = random.Random(3)
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        for k in range(waiting):
            engine.add_request([7] * 3, params, request_id=f"W{k}",
                               priority=rng.randrange(-9, 10) if k != 50 else -100)
        engine.snapshot()  # the waiting requests' states are built once, when first shown
        engine.add_request([8] * 3, params, request_id="late", priority=-50)
        calls = calls_in_engine(engine.step)  # admits max_num_seqs = 4 of them
        return calls, [r.request_id for r in engine.scheduler.running]

    small, large = admit(100), admit(4000)
    assert small[1][:2] == large[1][:2] == ["W50", "late"]  # the lowest values first
    assert len(small[1]) == len(large[1]) == 4
    assert large[0] == small[0]


# ------------------------------------------------------------------- the snapshot it keeps is the same
def fresh_sequences(engine):
    """The snapshot's sequences built from scratch (what ``snapshot`` did before it kept states)."""
    bm = engine.block_manager
    return [st for req in engine._listed.values()
            if not (req.status == FINISHED and req.finish_step != engine.step_count)
            for st in engine._sequence_states(req, bm)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("semantics", ["paper", "v1"])
def test_kept_sequence_states_equal_a_fresh_build_every_step(loaded, semantics, seed):
    rng = random.Random(seed)
    extra = ({"scheduling_policy": rng.choice(["fcfs", "priority"]), "max_num_batched_tokens": 24}
             if semantics == "v1" else {"preemption_mode": rng.choice(["recompute", "swap"])})
    extra["max_num_seqs"] = 8
    engine = build(loaded, block_size=4, num_blocks=14, max_model_len=40, semantics=semantics, **extra)
    for step in range(40):
        for _ in range(rng.choice([0, 0, 1, 2])):
            kind = rng.random()
            params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0 if kind < 0.5 else 1.0,
                                    seed=rng.randrange(100), ignore_eos=True,
                                    n=rng.choice([1, 2, 3]) if kind > 0.6 else 1,
                                    beam_width=2 if semantics == "paper" and kind < 0.15 else 1)
            try:
                engine.add_request([rng.randrange(2048) for _ in range(rng.randrange(1, 14))], params,
                                   priority=rng.randrange(3))
            except ValueError:  # more samples than the pool could hold: refused, nothing added
                pass
        record = engine.step()
        assert record.snapshot.sequences == fresh_sequences(engine), f"step {step}"
    assert engine.snapshot().sequences == fresh_sequences(engine)


# ------------------------------------------------------------------------- item 12: prompt by length
class NoIteration(list):
    """A token list that fails the test if anything reads its ids (per-token work)."""

    def __iter__(self):
        raise AssertionError("the prompt's ids were read before its length was checked")

    def __getitem__(self, index):
        raise AssertionError("the prompt's ids were read before its length was checked")


class Untokenizable:
    """The engine's tokenizer, failing the test if asked to tokenize (its vocabulary may be read)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        raise AssertionError("the prompt was tokenized before its length was checked")


@pytest.mark.parametrize("semantics", ["paper", "v1"])
def test_a_huge_token_list_is_refused_by_its_length_alone(loaded, semantics):
    engine = build(loaded, num_blocks=64, max_model_len=256, semantics=semantics)
    prompt = NoIteration()
    prompt.extend([5] * 10)  # list.extend does not go through __iter__ of the target
    list.__init__(prompt, [5] * 1000)
    with pytest.raises(ValueError, match=r"prompt of 1000 tokens needs 63 blocks of 16 but the pool has only 64|"
                                         r"prompt of 1000 tokens leaves no room to generate within max_model_len 256"):
        engine.add_request(prompt, SamplingParams())
    list.__init__(prompt, [5] * 10_000_000)
    with pytest.raises(ValueError, match=r"prompt of 10000000 tokens needs 625,000 blocks of 16 but the pool has only 64"):
        engine.add_request(prompt, SamplingParams())
    assert not engine.requests


@pytest.mark.parametrize("semantics", ["paper", "v1"])
def test_a_huge_text_is_refused_before_it_is_tokenized(loaded, semantics, monkeypatch):
    engine = build(loaded, num_blocks=64, max_model_len=256, semantics=semantics)
    longest = engine._longest_token_chars()
    assert longest == max(len(t) for t in engine.tokenizer.get_vocab())
    monkeypatch.setattr(engine, "tokenizer", Untokenizable(engine.tokenizer))
    with pytest.raises(ValueError, match=rf"prompt of 10,000,000 characters \(at least {-(-10**7 // longest):,} "
                                         rf"tokens: no token of this tokenizer is longer than {longest} characters\) "
                                         r"needs [\d,]+ blocks of 16 but the pool has only 64"):
        engine.add_request("ab " * 3_333_333 + "a", SamplingParams())
    text = "x" * (256 * longest)
    with pytest.raises(ValueError, match=rf"prompt of {len(text):,} characters .* leaves no room to generate "
                                         r"within max_model_len 256"):
        engine.check_request(text)
    assert not engine.requests


def test_the_length_bound_never_refuses_a_text_that_fits(loaded):
    """A text of (max_model_len - 1) longest tokens is not refused by its length; one character more is,
    and really has max_model_len tokens or more."""
    engine = build(loaded, num_blocks=64, max_model_len=64)
    tokenizer = engine.tokenizer
    vocab = {t: i for t, i in tokenizer.get_vocab().items()
             if i not in tokenizer.all_special_ids and not tokenizer.decode([i]).isspace()}
    longest = max(vocab, key=len)
    piece = tokenizer.decode([vocab[longest]])
    assert len(piece) == len(longest) <= engine._longest_token_chars()
    text = piece * 63
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 64:
        assert engine.check_request(text) == ids
    try:
        engine.check_request(text)
    except ValueError as err:  # refused only by its real token count
        assert "characters" not in str(err) and f"prompt of {len(ids)} tokens" in str(err)
    over = "x" * (63 * engine._longest_token_chars() + 1)
    assert len(tokenizer(over, add_special_tokens=False)["input_ids"]) >= 64
    with pytest.raises(ValueError, match="characters"):
        engine.check_request(over)


def test_the_bound_holds_on_varied_text(loaded):
    """tokens >= characters / longest token, on text of every kind of character."""
    engine = build(loaded, num_blocks=64, max_model_len=64)
    longest = engine._longest_token_chars()
    rng = random.Random(0)
    alphabets = [" abcdefghij", "the and of to ", "é€😀\u0301\u200b\n\t", "".join(map(chr, range(32, 127))),
                 "".join(chr(c) for c in range(0x4E00, 0x4E40)), "<|endoftext|>  "]
    for _ in range(60):
        text = "".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.randrange(1, 400)))
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) * longest >= len(text), repr(text)


def test_a_long_whitespace_prompt_is_named_without_being_held(loaded):
    engine = build(loaded, num_blocks=64, max_model_len=256)
    with pytest.raises(ValueError) as err:
        engine.add_request(" " * 200, SamplingParams())
    assert "only whitespace" in str(err.value) and len(str(err.value)) < 150
