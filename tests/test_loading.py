"""Model loading: the embedded model offline, a hub id served from a local hub cache through the same
code path, clear one-line errors for missing or unsupported models, and KV geometry from the config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from engine.model_loader import geometry_from_config

ROOT = Path(__file__).resolve().parent.parent


def test_embedded_model_loads_offline_with_transformers_alone(model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    assert model.config.model_type == "llama"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    assert model.config.max_position_embeddings >= 2048
    assert 1000 <= tok.vocab_size <= 4096
    size = sum(f.stat().st_size for f in Path(model_path).iterdir() if f.is_file())
    assert size <= 10 * 1000 * 1000


def test_geometry_and_bytes_per_token(make_engine):
    engine = make_engine(num_blocks=8)
    cfg = engine.model.config
    g = engine.geometry
    # the embedded model v2 sets head_dim apart from hidden_size // heads (= 24): the geometry reads it
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
    assert g.bytes_per_token == 2 * g.num_layers * g.num_kv_heads * g.head_dim * 4 == 2048
    assert engine.kv_cache.key_cache[0].shape == (8, 16, g.num_kv_heads, g.head_dim)


def test_llama2_7b_geometry_is_512_kib_per_token():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=32)
    assert geometry_from_config(cfg, "float16").bytes_per_token == 512 * 1024
    cfg.num_key_value_heads = 8  # grouped-query attention: a quarter
    assert geometry_from_config(cfg, "float16").bytes_per_token == 128 * 1024


def make_hub_cache(cache: Path, repo_id: str, source: Path) -> None:
    """Lay out a Hugging Face hub cache (models--org--name/refs + snapshots) holding a copy of ``source``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def run_py(code: str, env_extra: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_extra}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def test_hub_id_loads_from_a_saved_copy_through_the_hub_path(tmp_path, model_path):
    make_hub_cache(tmp_path / "hub", "pal-test/tiny-copy", Path(model_path))
    code = (
        "from engine import EngineConfig, LLMEngine, SamplingParams\n"
        "e = LLMEngine(EngineConfig(model='pal-test/tiny-copy', device='cpu', num_blocks=32))\n"
        "[o] = e.generate(['ROMEO. '], SamplingParams(max_tokens=8, temperature=0))\n"
        "print(o.output_token_ids)\n"
    )
    proc = run_py(code, {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    engine = LLMEngine(EngineConfig(model=model_path, device="cpu", num_blocks=32))
    [expected] = engine.generate(["ROMEO. "], SamplingParams(max_tokens=8, temperature=0))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected.output_token_ids


def test_uncached_hub_id_offline_is_one_clear_line(tmp_path):
    code = (
        "from engine import EngineConfig, LLMEngine\n"
        "try:\n"
        "    LLMEngine(EngineConfig(model='HuggingFaceTB/SmolLM2-135M', device='cpu'))\n"
        "except ValueError as e:\n"
        "    print(str(e))\n"
    )
    proc = run_py(code, {"HF_HUB_CACHE": str(tmp_path / "empty-hub")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    message = proc.stdout.strip()
    assert "\n" not in message
    assert "HuggingFaceTB/SmolLM2-135M" in message and EMBEDDED_MODEL in message


def test_missing_local_directory():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model="./no/such/model/dir", device="cpu"))


def test_non_llama_model_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="model_type 'gpt2'"):
        LLMEngine(EngineConfig(model=str(tmp_path), device="cpu"))


def test_qwen2_architecture_runs_exactly(tmp_path, model_path):
    """A randomly initialised Qwen2 (q/k/v biases) saved locally runs through the same runner exactly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)  # nothing stops either side
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", block_size=4, num_blocks=64))
    prompt = list(range(5, 16))
    [out] = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert out.output_token_ids == ref[0, len(prompt):].tolist()


def test_transformers_imported_from_two_threads_at_once():
    """The app imports transformers from a page thread while the background preload imports it too;
    transformers' lazy module raised ImportError for the second thread ("cannot import name 'AutoConfig'")
    until every import went through ``engine.model_loader.transformers_api``. A fresh interpreter, since
    this one has imported transformers already."""
    code = """
import threading, time
from engine.model_loader import transformers_api  # torch imported; transformers not yet
from lessons import kv_math
t = threading.Thread(target=transformers_api)  # as the background preload does (infra.runs.load_reporting)
t.start()
time.sleep(0.3)
preset = next(iter(kv_math.model_presets().values()))
preset.config  # AutoConfig, from this thread, while the other thread imports transformers
t.join()
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
