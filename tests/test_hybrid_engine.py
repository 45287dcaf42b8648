"""The engine on the hybrid model (issue 25, item 2): KV cache groups with V1 semantics give the tokens
transformers gives, on prompts several windows long, with prefix caching on and off and under preemption;
a request decoding past the window holds fewer blocks than its all-full-attention twin by the arithmetic
(``engine.metrics.hybrid_blocks_saved``); a uniform sliding-window model (Mistral) runs too; the paper's
semantics refuse a sliding-window model, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TEXT

from engine import EMBEDDED_HYBRID_MODEL, EngineConfig, LLMEngine, SamplingParams
from engine.metrics import blocks_for, hybrid_blocks_saved
from engine.model_loader import load_model
from engine.single_type_kv_cache_manager import NULL_BLOCK, FullAttentionManager, SlidingWindowManager

HYBRID = EMBEDDED_HYBRID_MODEL
MAX_NEW = 24


@pytest.fixture(scope="module")
def loaded(hybrid_loaded):
    return hybrid_loaded


@pytest.fixture(scope="module")
def window(loaded) -> int:
    return loaded[0].config.sliding_window


@pytest.fixture(scope="module")
def prompts(loaded, window) -> list[list[int]]:
    """Prompts of 2 to 4 windows, cut from the conftest text at different places; the last two share
    their first 120 tokens (a prefix-cache hit across the window)."""
    ids = loaded[1](TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 200
    out = [ids[10:10 + 2 * window + 5], ids[:4 * window], ids[:120] + ids[150:170], ids[:120] + ids[130:150]]
    assert all(len(p) > 2 * window for p in out)
    return out


@pytest.fixture(scope="module")
def expected(loaded, prompts) -> list[list[int]]:
    model = loaded[0]
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW)
        outs.append(out[0, len(p):].tolist())
    return outs


def engine(loaded, **kwargs) -> LLMEngine:
    kwargs = {"device": "cpu", "dtype": "float32", "semantics": "v1", "block_size": 16, "max_num_seqs": 8, **kwargs}
    return LLMEngine(EngineConfig(model=HYBRID, **kwargs), loaded=loaded)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_the_engine_makes_vllms_two_groups(loaded, window):
    e = engine(loaded, num_blocks=64)
    kinds = [(type(m), getattr(m, "sliding_window", None)) for m in e.block_manager.managers]
    assert kinds == [(SlidingWindowManager, window), (FullAttentionManager, None)]
    assert e.kv_cache.layer_group == [0, 1, 0, 1]
    # two groups of two layers share the bytes: a block holds 2 layers' K and V, not 4
    assert e.kv_cache.nbytes == 64 * e.geometry.bytes_per_block(16) // 2


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_tokens_equal_transformers(loaded, prompts, expected, prefix_caching):
    e = engine(loaded, num_blocks=96, enable_prefix_caching=prefix_caching, max_num_batched_tokens=64)
    outs = e.generate(prompts, GREEDY)  # 64-token budget: the prompts are prefilled in chunks across windows
    assert [o.output_token_ids for o in outs] == expected
    if prefix_caching:  # the last prompt shares 112 tokens (7 blocks) with the one before it
        assert max(o.num_cached_tokens for o in outs) >= 96
    assert e.block_manager.num_free_blocks == e.num_blocks
    assert e.block_manager.pool.invariant_violations([]) == []


@pytest.mark.parametrize("prefix_caching, num_blocks", [(True, 28), (False, 30)])
def test_greedy_tokens_equal_transformers_under_preemption(loaded, prompts, expected, prefix_caching, num_blocks):
    e = engine(loaded, num_blocks=num_blocks, enable_prefix_caching=prefix_caching, max_num_batched_tokens=256,
               max_model_len=256)
    preempted = []
    outs = e.generate(prompts, GREEDY, on_step=lambda r: preempted.extend(
        ev.request_id for ev in r.events if ev.kind == "preempt"))
    assert preempted, f"{num_blocks} blocks of 16 should be too few for the four requests at once"
    assert [o.output_token_ids for o in outs] == expected


def test_a_request_past_the_window_holds_fewer_blocks_than_its_full_twin(loaded, prompts, window):
    e = engine(loaded, num_blocks=64)
    seq = e.requests[e.add_request(prompts[1], GREEDY)].seqs[0]
    seen = []
    while e.has_unfinished():
        computed = seq.num_computed_tokens  # before this step's schedule: what the window frees by
        e.step()
        if seq.seq_id not in e.block_manager.num_tokens:  # finished
            break
        sliding, full = e.block_manager.group_block_tables(seq.seq_id)
        held = sum(b != NULL_BLOCK for b in sliding + full)
        twin = 2 * blocks_for(e.block_manager.num_tokens[seq.seq_id], 16)  # both groups holding every block
        assert twin - held == hybrid_blocks_saved(computed, 16, [window, None])
        seen.append(twin - held)
    assert max(seen) >= (len(prompts[1]) + MAX_NEW - 2 - window + 1) // 16 > 0


def test_a_uniform_sliding_window_model_runs_exactly(tmp_path, loaded):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                           sliding_window=24, bos_token_id=0, eos_token_id=0)
    MistralForCausalLM(config).save_pretrained(tmp_path / "m")
    loaded[1].save_pretrained(tmp_path / "m")
    mistral = load_model(str(tmp_path / "m"), torch.device("cpu"), "float32")
    prompt = list(range(5, 85))
    ids = torch.tensor([prompt])
    expected = mistral[0].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=20)[0, 80:].tolist()
    e = LLMEngine(EngineConfig(model=str(tmp_path / "m"), device="cpu", dtype="float32", semantics="v1",
                               block_size=8, num_blocks=32, max_num_batched_tokens=32, max_num_seqs=4),
                 loaded=mistral)
    assert [type(m) for m in e.block_manager.managers] == [SlidingWindowManager]
    [out] = e.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert out.output_token_ids == expected


def test_the_paper_semantics_refuse_a_sliding_window_model_saying_why(loaded):
    with pytest.raises(ValueError, match="sliding-window layers.*semantics='v1'"):
        engine(loaded, semantics="paper", num_blocks=64)
    with pytest.raises(ValueError, match="sliding-window layers .* one block table per sequence for every layer"):
        engine(loaded, semantics="paper", allocator="contiguous", num_blocks=64)


@pytest.mark.slow  # Triton's interpreter: ~10 s on the CPU
def test_the_triton_kernels_run_the_hybrid_model_exactly(loaded, prompts, expected):
    """The same engine with the Triton kernels (Triton's interpreter on the CPU): each layer's window in
    the kernel, the null blocks never read; a prompt of two windows prefilled in chunks, then decoded."""
    e = engine(loaded, num_blocks=32, max_num_batched_tokens=64, attention_backend="triton")
    [out] = e.generate([prompts[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert out.output_token_ids == expected[0][:6]


@pytest.mark.gpu
def test_the_hybrid_model_on_the_gpu_matches_transformers(loaded, prompts, expected):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cuda = load_model(HYBRID, torch.device("cuda"), "float32")
    e = LLMEngine(EngineConfig(model=HYBRID, device="cuda", dtype="float32", semantics="v1", block_size=16,
                               max_num_seqs=8, num_blocks=96, max_num_batched_tokens=64), loaded=cuda)
    assert e.backend == "triton"
    outs = e.generate(prompts, GREEDY)
    # float32 on the GPU: the first tokens agree with the CPU's transformers; a near tie may flip later
    assert [o.output_token_ids[:8] for o in outs] == [x[:8] for x in expected]
