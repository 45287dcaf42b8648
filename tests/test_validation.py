"""Bad input gets a ValueError that names the bad value, and the engine's state is unchanged."""

from __future__ import annotations

import copy

import pytest

from engine import EngineConfig, SamplingParams
@pytest.mark.parametrize("kwargs, named", [
    ({"block_size": 0}, "block_size .*0"),
    ({"block_size": -3}, "block_size .*-3"),
    ({"num_blocks": 0}, "num_blocks .*0"),
    ({"num_blocks": -1}, "num_blocks .*-1"),
    ({"device": "tpu"}, "device .*'tpu'"),
    ({"dtype": "int8"}, "dtype .*'int8'"),
    ({"attention_backend": "cudnn"}, "attention_backend .*'cudnn'"),
    ({"num_blocks": 4, "kv_budget_bytes": 1000}, "not both"),
])
def test_bad_engine_config(kwargs, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, named", [
    ({"max_tokens": 0}, "max_tokens .*0"),
    ({"temperature": -0.5}, "temperature .*-0.5"),
    ({"top_p": 0.0}, "top_p .*0.0"),
    ({"top_p": 1.5}, "top_p .*1.5"),
    ({"top_k": -2}, "top_k .*-2"),
])
def test_bad_sampling_params(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**kwargs)


def test_budget_below_one_block(make_engine):
    with pytest.raises(ValueError, match="kv_budget_bytes 100 is below one block"):
        make_engine(kv_budget_bytes=100)


def test_budget_gives_floor_of_blocks(make_engine):
    probe = make_engine(num_blocks=1)
    per_block = probe.geometry.bytes_per_block(16)
    engine = make_engine(kv_budget_bytes=10 * per_block + per_block - 1)
    assert engine.num_blocks == 10
    assert engine.kv_cache.nbytes == 10 * per_block


def test_max_model_len_above_pool(make_engine):
    with pytest.raises(ValueError, match="max_model_len 100 exceeds the pool's 64 token slots"):
        make_engine(block_size=16, num_blocks=4, max_model_len=100)


def state(engine):
    return (copy.deepcopy(engine.block_manager.block_tables), list(engine.block_manager.free_block_queue),
            list(engine.requests), [r.request_id for r in engine.scheduler.waiting],
            [r.request_id for r in engine.scheduler.running])


@pytest.mark.parametrize("prompt, named", [
    ("", "prompt is empty"),
    ([], r"prompt is empty \(\[\]\)"),
    ([1, 99999], "token id 99999"),
    (42, "got int"),
])
def test_bad_prompt_leaves_engine_unchanged(prompt, named, make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=16, max_model_len=32)
    engine.add_request(text_ids[:5], SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    before = state(engine)
    with pytest.raises(ValueError, match=named):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    assert state(engine) == before


def test_prompt_longer_than_max_model_len(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=64, max_model_len=32)
    before = state(engine)
    with pytest.raises(ValueError, match="prompt of 40 tokens .* max_model_len 32"):
        engine.add_request(text_ids[:40], SamplingParams(max_tokens=4))
    assert state(engine) == before


def test_prompt_that_can_never_fit_the_pool(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=8, max_model_len=32)
    before = state(engine)
    with pytest.raises(ValueError, match="prompt of 40 tokens needs 10 blocks .* only 8"):
        engine.add_request(text_ids[:40], SamplingParams(max_tokens=4))
    assert state(engine) == before


def test_generate_checks_every_prompt_before_adding_any(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=16, max_model_len=32)
    before = state(engine)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([text_ids[:3], ""], SamplingParams(max_tokens=2))
    assert state(engine) == before
    # and the engine still works afterwards
    [out] = engine.generate([text_ids[:3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out.output_token_ids) == 2


def test_duplicate_request_id(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=16)
    engine.add_request(text_ids[:3], request_id="chat-1")
    with pytest.raises(ValueError, match="'chat-1' is already in use"):
        engine.add_request(text_ids[:3], request_id="chat-1")


def test_many_samples_recomputed_under_a_small_token_budget_finish(make_engine):
    """A preempted n=4 request must come back even if its recompute exceeds max_num_batched_tokens."""
    engine = make_engine(block_size=16, num_blocks=16, max_model_len=64, max_num_batched_tokens=64,
                         enable_prefix_caching=False)
    outs = engine.generate([[5] * 20, [7] * 20], [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(n=4, max_tokens=40, seed=1, ignore_eos=True)])
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [40, 40, 40, 40, 40]
    assert engine.block_manager.num_free_blocks == 16


def test_more_samples_than_max_num_seqs_is_refused(make_engine):
    engine = make_engine(block_size=16, num_blocks=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="4 samples/beams exceed max_num_seqs 2"):
        engine.add_request([5] * 10, SamplingParams(n=4))


def test_auto_ids_skip_ids_the_caller_chose(make_engine):
    engine = make_engine(block_size=16, num_blocks=64)
    engine.add_request([5] * 3, request_id="R1")
    assert engine.add_request([5] * 3) == "R2"
    assert [o.request_id for o in engine.generate([[6] * 3], SamplingParams(max_tokens=2))] == ["R3"]


def test_numpy_token_ids_are_accepted(make_engine):
    import numpy as np

    engine = make_engine(block_size=16, num_blocks=64)
    rid = engine.add_request(list(np.array([5, 6, 7], dtype=np.int64)), SamplingParams(max_tokens=2))
    assert engine.requests[rid].prompt_token_ids == [5, 6, 7]


@pytest.mark.parametrize("kwargs, named", [({"temperature": float("inf")}, "temperature .*inf"),
                                           ({"length_penalty": float("nan")}, "length_penalty .*nan"),
                                           ({"seed": 2**70}, "seed .*"), ({"seed": -1}, "seed .*-1")])
def test_non_finite_or_out_of_range_params(kwargs, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams(**kwargs)


def test_block_larger_than_the_longest_sequence(make_engine):
    with pytest.raises(ValueError, match="block_size 4096 exceeds max_model_len"):
        make_engine(block_size=4096, num_blocks=1, max_model_len=2048)


def test_check_request_ignores_ids_the_caller_chose(make_engine):
    engine = make_engine(block_size=16, num_blocks=64)
    engine.add_request([5] * 3, request_id="R-check")
    engine.add_request([5] * 3, request_id="R1")
    assert engine.check_request([6, 7], SamplingParams(max_tokens=2)) == [6, 7]
    assert list(engine.requests) == ["R-check", "R1"]  # nothing added
