"""Bad input at the edges: memory limits, sampling parameter types, prompts, model files, --trace paths.

Nothing here allocates much memory: the available-memory reading is patched to a small number, and the
tests of pools that must be refused replace the KV cache and the block manager by stubs that fail the
test, instead of allocating, should the engine get that far.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine, SamplingParams, memory
from engine.cli import main
from engine.model_loader import ModelLoadError, geometry_from_config, load_model
from engine.sampler import sample_batch

GIB = 2**30
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def loaded():
    return load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32")


@pytest.fixture(scope="module")
def per_block(loaded) -> int:
    """KV bytes of one block of 16 tokens of the embedded model (float32)."""
    return geometry_from_config(loaded[0].config, "float32").bytes_per_block(16)


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test instead of allocating the pools, should the memory check let them through."""
    import engine.llm_engine as le

    def refuse(*args, **kwargs):
        raise AssertionError("the memory check let the pools through to allocation")

    for name in ("KVCache", "BlockManager", "ContiguousAllocator"):
        monkeypatch.setattr(le, name, refuse, raising=False)
    monkeypatch.setattr(LLMEngine, "_build_memory", refuse, raising=False)


def host_memory(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(memory, "available_host_memory_bytes", lambda: nbytes)


def build(loaded, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", **kwargs), loaded)


# ------------------------------------------------------------------------------------ host memory
@pytest.mark.parametrize("swap_blocks", [10**6, 10**9])
def test_swap_pool_beyond_host_memory_is_refused_before_allocation(loaded, no_allocation, swap_blocks):
    # no patching: 10**6 blocks of 16 tokens are 23 GiB, 10**9 are 23 TiB
    with pytest.raises(ValueError, match=rf"swap_space_blocks {swap_blocks} needs [\d.]+ GiB .* GiB are free"):
        build(loaded, num_blocks=64, preemption_mode="swap", swap_space_blocks=swap_blocks)


def test_swap_pool_is_checked_against_a_small_host(loaded, per_block, monkeypatch, no_allocation):
    host_memory(monkeypatch, 1000 * per_block)
    with pytest.raises(ValueError, match="swap_space_blocks 2000 needs"):
        build(loaded, num_blocks=64, preemption_mode="swap", swap_space_blocks=2000)


def test_pool_and_swap_pool_on_the_cpu_must_fit_together(loaded, per_block, monkeypatch, no_allocation):
    host_memory(monkeypatch, 1000 * per_block)  # each of 600 blocks fits alone; 1200 do not
    with pytest.raises(ValueError, match="swap_space_blocks 600 needs .* besides the KV pool's"):
        build(loaded, num_blocks=600, preemption_mode="swap", swap_space_blocks=600)
    with pytest.raises(ValueError, match="swap_space_blocks 600 needs"):  # None: as many as the pool
        build(loaded, num_blocks=600, preemption_mode="swap")


def test_pool_and_swap_pool_that_fit_together_are_built(loaded, per_block, monkeypatch):
    host_memory(monkeypatch, 1000 * per_block)
    engine = build(loaded, num_blocks=600, preemption_mode="swap", swap_space_blocks=300)
    assert engine.num_blocks == 600
    assert build(loaded, num_blocks=600).num_blocks == 600  # recompute mode: no swap pool


def test_huge_pool_of_one_token_blocks_is_refused_before_allocation(loaded, monkeypatch, no_allocation):
    host_memory(monkeypatch, 64 * 2**20)
    with pytest.raises(ValueError, match=r"KV pool of 60000 blocks x 1 tokens needs [\d.]+ GiB"):
        build(loaded, num_blocks=60_000, block_size=1)


def test_pool_too_large_to_record_is_refused_even_when_memory_would_hold_it(loaded, monkeypatch, no_allocation):
    """3 million one-token blocks fit in 8 GiB, but every step's snapshot would list them all (~250 MB a
    step): refused before anything is allocated, with the way out (a larger block size)."""
    host_memory(monkeypatch, 64 * 2**30)
    with pytest.raises(ValueError, match=r"3,000,000 blocks is more than the 65,536 .* larger block_size than 1"):
        build(loaded, num_blocks=3_000_000, block_size=1)


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """Point the cgroup v2 and v1 files at tmp_path (absent until written), with 8 GiB free on the host."""
    v2 = (tmp_path / "memory.max", tmp_path / "memory.current")
    v1 = (tmp_path / "memory.limit_in_bytes", tmp_path / "memory.usage_in_bytes")
    monkeypatch.setattr(memory, "CGROUP_V2_FILES", tuple(map(str, v2)))
    monkeypatch.setattr(memory, "CGROUP_V1_FILES", tuple(map(str, v1)))
    monkeypatch.setattr(memory, "physical_free_bytes", lambda: 8 * GIB)
    return v2, v1


def test_cgroup_limit_wins_when_smaller(cgroup, monkeypatch):
    (v2_max, v2_current), (v1_limit, v1_usage) = cgroup
    assert memory.available_host_memory_bytes() == 8 * GIB  # no cgroup files: the host's free RAM
    v1_limit.write_text(f"{9223372036854771712}\n")  # cgroup v1's "no limit"
    v1_usage.write_text(f"{GIB}\n")
    assert memory.available_host_memory_bytes() == 8 * GIB
    v1_limit.write_text(f"{3 * GIB}\n")
    assert memory.available_host_memory_bytes() == 2 * GIB
    v2_max.write_text("max\n")  # cgroup v2 without a limit; v1 files are not read then either
    v2_current.write_text(f"{GIB}\n")
    assert memory.cgroup_available_bytes() == 2 * GIB  # ... falls through to v1
    v2_max.write_text(f"{2 * GIB}\n")
    v2_current.write_text(f"{GIB // 2}\n")
    assert memory.available_host_memory_bytes() == 3 * GIB // 2
    v2_current.write_text(f"{3 * GIB}\n")  # over the limit: nothing left
    assert memory.available_host_memory_bytes() == 0
    v2_max.write_text(f"{100 * GIB}\n")  # a limit above the host's free RAM: the host wins
    assert memory.available_host_memory_bytes() == 8 * GIB


def test_engine_pool_is_checked_against_the_cgroup_limit(loaded, per_block, cgroup, no_allocation):
    (v2_max, v2_current), _ = cgroup
    v2_max.write_text(f"{200 * per_block}\n")
    v2_current.write_text(f"{100 * per_block}\n")
    with pytest.raises(ValueError, match="KV pool of 1000 blocks x 16 tokens needs"):
        build(loaded, num_blocks=1000)


# --------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("temperature", [1e-300, 1e-39, 1e-6])
def test_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    logits = torch.tensor([[1.0, 5.0, 3.0, 9.0, 2.0, 0.5, -4.0, 8.5]] * 3)  # argmax 3, not 0
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    assert sample_batch(logits, [params] * 3, gens) == [3, 3, 3]
    assert params.greedy


def test_sampling_eps_is_vllms_threshold():
    assert SamplingParams.SAMPLING_EPS == 1e-5
    assert not SamplingParams(temperature=1e-5).greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("field, value", [
    ("top_p", True), ("top_p", "0.5"), ("length_penalty", "x"), ("length_penalty", True),
    ("ignore_eos", "yes"), ("ignore_eos", 1), ("ignore_eos", None), ("temperature", True), ("temperature", "1"),
    ("top_k", True), ("top_k", "5"), ("max_tokens", True), ("max_tokens", "16"), ("n", True), ("n", 2.0),
    ("beam_width", "2"), ("seed", True), ("seed", "7"),
])
def test_sampling_params_refuse_bools_and_strings(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must .* got {value!r}$"):
        SamplingParams(**{field: value})


# ---------------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize("prompt", ["   ", "\n\t", " \u3000\n"])
def test_whitespace_only_prompt_is_refused(loaded, prompt):
    engine = build(loaded, num_blocks=64)
    with pytest.raises(ValueError, match=r"^prompt is only whitespace"):
        engine.add_request(prompt)
    assert engine.requests == {}
    assert engine.check_request(" a ")  # text with spaces around it is fine


@pytest.mark.parametrize("prompt, pos", [("abc\ud800", 3), ("\udfffxyz", 0), ("ok \ud83d then", 3)])
def test_lone_surrogate_is_refused_with_its_position(loaded, prompt, pos):
    engine = build(loaded, num_blocks=64)
    with pytest.raises(ValueError, match=rf"invalid character .* at position {pos}$"):
        engine.add_request(prompt)
    assert engine.requests == {}


# ---------------------------------------------------------------------------------- model loading
def model_copy(path: Path) -> Path:
    """assets/tiny_model's config and tokenizer files (no weights) in ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy(Path(EMBEDDED_MODEL) / name, path / name)
    return path


def refusal(model: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(model, torch.device("cpu"), "float32")
    msg = str(info.value)
    assert "\n" not in msg and repr(model) in msg
    return msg


def test_corrupt_config_json_is_one_line_naming_the_model(tmp_path):
    model = model_copy(tmp_path / "m")
    (model / "config.json").write_text('{"model_type": "llama", ')
    msg = refusal(str(model))
    assert "config.json" in msg and "hub" not in msg  # not the offline message


def test_truncated_weights_are_one_line_naming_the_model(tmp_path):
    model = model_copy(tmp_path / "m")
    weights = (Path(EMBEDDED_MODEL) / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert refusal(str(model)).startswith(f"cannot load model {str(model)!r}: ")
    (model / "model.safetensors").write_bytes(weights[:1000])  # even the header is cut
    refusal(str(model))


def test_model_path_that_is_a_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert "is a file, not a model directory" in refusal(str(tmp_path / "weights.bin"))


def save_config(path: Path, config) -> str:
    config.save_pretrained(path)  # config.json only: a refusal must come before the weights are read
    return str(path)


def tiny(cls, **kwargs):
    return cls(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kwargs)


def test_sliding_window_models_load_and_only_v1_runs_them(tmp_path, model_path):
    """Sliding-window layers load (issue 25: V1's KV cache groups hold them); the paper's semantics (and the
    contiguous baseline, which runs them), keeping one table or row for every layer, refuse them saying why."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    qwen = tiny(Qwen2Config, sliding_window=32, use_sliding_window=True, max_window_layers=1)
    for name, cls, config in (("mistral", MistralForCausalLM, tiny(MistralConfig, sliding_window=64)),
                              ("qwen2", Qwen2ForCausalLM, qwen)):
        cls(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        loaded = load_model(str(tmp_path / name), torch.device("cpu"), "float32")
        kwargs = dict(model=str(tmp_path / name), device="cpu", dtype="float32", num_blocks=32, max_num_seqs=4)
        with pytest.raises(ValueError, match=f"{name}' has sliding-window layers .* semantics='v1'"):
            LLMEngine(EngineConfig(**kwargs), loaded=loaded)
        with pytest.raises(ValueError, match="sliding-window layers .* semantics='v1'"):
            LLMEngine(EngineConfig(**kwargs, allocator="contiguous"), loaded=loaded)
        assert LLMEngine(EngineConfig(**kwargs, semantics="v1"), loaded=loaded).kv_cache_groups[-1].sliding_window


def test_inactive_sliding_windows_still_load(tmp_path, model_path):
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    cases = {
        "mistral-none": (MistralForCausalLM, tiny(MistralConfig, sliding_window=None)),
        "mistral-longer": (MistralForCausalLM, tiny(MistralConfig, sliding_window=256)),  # = the longest
        "qwen2-off": (Qwen2ForCausalLM, tiny(Qwen2Config, sliding_window=32, use_sliding_window=False)),
        "qwen2-no-layer": (Qwen2ForCausalLM, tiny(Qwen2Config, sliding_window=32, use_sliding_window=True,
                                                  max_window_layers=2)),  # every layer is below it
    }
    for name, (cls, config) in cases.items():
        cls(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        model, _ = load_model(str(tmp_path / name), torch.device("cpu"), "float32")
        assert model.config.model_type == name.split("-")[0]


# ------------------------------------------------------------------------------------------- --trace
@pytest.mark.parametrize("path", ["/proc/version", "/dev/null"])
def test_trace_to_a_path_that_is_not_a_writable_file_is_refused_before_the_run(capsys, path):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    code = main(["run", "--scenario", "single", "--device", "cpu", "--num-blocks", "16", "--trace", path])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"error: --trace {path!r} is not a writable file path"
    assert captured.out == ""  # refused before anything ran


def test_trace_to_an_existing_file_passes_the_check_without_truncating_it(capsys, tmp_path):
    trace = tmp_path / "old.jsonl"
    trace.write_text("keep me\n")
    # the trace check passes; the bad block size is the first error, before anything runs
    assert main(["run", "--scenario", "single", "--device", "cpu", "--block-size", "0", "--trace", str(trace)]) == 2
    assert capsys.readouterr().err.strip() == "error: block_size must be a positive integer, got 0"
    assert trace.read_text() == "keep me\n"
    assert main(["run", "--scenario", "single", "--device", "cpu", "--trace", str(tmp_path)]) == 2  # a folder
    assert "is not a writable file path" in capsys.readouterr().err
