"""The embedded hybrid model (``assets/tiny_hybrid_model``): sliding-window and full-attention layers, loaded
by transformers here and by vLLM's CPU build in its own environment (issue 25, item 1)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from engine.model_loader import transformers_api

ROOT = Path(__file__).resolve().parent.parent
HYBRID = ROOT / "assets" / "tiny_hybrid_model"
PEER_PYTHON = ROOT / ".peer-venv" / "bin" / "python"
# vLLM's CPU attention head sizes (CPUAttentionBackend.get_supported_head_sizes, vLLM 0.32)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
LONG_TEXT = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
             "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief that thou her "
             "maid art far more fair than she. Be not her maid, since she is envious; her vestal livery is but "
             "sick and green, and none but fools do wear it; cast it off. It is my lady, O, it is my love! O that she "
             "knew she were! She speaks, yet she says nothing. What of that? Her eye discourses; I will answer it. "
             "I am too bold, 'tis not to me she speaks. Two of the fairest stars in all the heaven, having some "
             "business, do entreat her eyes to twinkle in their spheres till they return.")


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((HYBRID / "config.json").read_text())


@pytest.fixture(scope="module")
def hybrid():
    tf = transformers_api()
    model = tf.AutoModelForCausalLM.from_pretrained(HYBRID, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(HYBRID)
    return model, tokenizer


def test_config_mixes_sliding_and_full_layers(config):
    kinds = config["layer_types"]
    assert set(kinds) == {"sliding_attention", "full_attention"}, kinds
    assert len(kinds) == config["num_hidden_layers"]
    assert config["model_type"] == "ministral" and config["architectures"] == ["MinistralForCausalLM"]
    window = config["sliding_window"]
    assert 16 < window < 4 * 32, f"a window of a few blocks (16 and 32 tokens), got {window}"
    assert config["head_dim"] in VLLM_CPU_HEAD_SIZES
    assert (HYBRID / "model.safetensors").stat().st_size < 10 * 2**20


def test_same_tokenizer_as_the_first_model():
    assert (HYBRID / "tokenizer.json").read_bytes() == (ROOT / "assets" / "tiny_model" / "tokenizer.json").read_bytes()


def test_transformers_loads_it_with_a_window_per_layer(hybrid, config):
    model, _ = hybrid
    assert type(model).__name__ == "MinistralForCausalLM"
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [config["sliding_window"] if k == "sliding_attention" else None
                       for k in config["layer_types"]]


def test_the_window_changes_what_the_model_computes(hybrid, config):
    """Past the window the sliding layers see fewer tokens: the same weights with every layer full give other
    logits there, and the same logits before it."""
    model, tokenizer = hybrid
    ids = tokenizer(LONG_TEXT, return_tensors="pt")["input_ids"]
    window = config["sliding_window"]
    assert ids.shape[1] > 2 * window
    with torch.no_grad():
        windowed = model(ids).logits[0]
        full_cfg = type(model.config).from_dict({**model.config.to_dict(), "layer_types": ["full_attention"] * 4})
        twin = type(model)(full_cfg).eval()
        twin.load_state_dict(model.state_dict())
        full = twin(ids).logits[0]
    assert torch.allclose(windowed[:window], full[:window], atol=1e-4)
    assert (windowed[window + 1:] - full[window + 1:]).abs().max() > 1e-2


def test_it_writes_text(hybrid):
    model, tokenizer = hybrid
    ids = tokenizer("ROMEO. ", return_tensors="pt")["input_ids"]
    out = model.generate(ids, do_sample=False, max_new_tokens=40)
    text = tokenizer.decode(out[0, ids.shape[1]:])
    words = [w for w in text.split() if w.strip(".,;:!?'").isalpha()]
    assert len(words) >= 8, text


def test_model_card_states_the_measured_losses():
    stats = json.loads((HYBRID / "training_stats.json").read_text())
    card = (HYBRID / "README.md").read_text()
    assert stats["val_loss"] < stats["unigram"] - 2.0
    assert f"{stats['val_loss']:.3f}" in card and f"{stats['unigram']:.3f}" in card
    assert "Why this architecture" in card


_VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[3])
    import vllm_driver
    vllm_driver.set_env(1)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    spec = json.load(open(sys.argv[1]))
    args = EngineArgs(model=spec["model"], tokenizer=spec["model"], dtype="float32", seed=0, max_model_len=512,
                      block_size=32, num_gpu_blocks_override=40, kv_cache_memory_bytes=64 * 2**20,
                      enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=256,
                      max_num_seqs=4, async_scheduling=False, enforce_eager=True, use_tqdm_on_load=False)
    engine = LLMEngine.from_engine_args(args)
    core = engine.engine_core.engine_core
    groups = [{"spec": type(g.kv_cache_spec).__name__,
               "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
               "layers": g.layer_names} for g in core.scheduler.kv_cache_config.kv_cache_groups]
    managers = [type(m).__name__ for m in core.scheduler.kv_cache_manager.coordinator.single_type_managers]
    engine.add_request("a", {"prompt_token_ids": spec["prompt"]},
                       SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = list(o.outputs[0].token_ids)
    engine.engine_core.shutdown()
    json.dump({"groups": groups, "managers": managers, "tokens": out}, open(sys.argv[2], "w"))
""")


@pytest.mark.slow
@pytest.mark.peer
def test_vllm_serves_it_with_two_kv_cache_groups_and_the_same_tokens(hybrid, config, tmp_path):
    if not PEER_PYTHON.exists():
        pytest.skip(f"no vLLM peer environment at {PEER_PYTHON.parent.parent}")
    model, tokenizer = hybrid
    prompt = tokenizer(LONG_TEXT)["input_ids"]
    spec = {"model": str(HYBRID), "prompt": prompt, "max_tokens": 40}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "run.py").write_text(_VLLM_SCRIPT)
    proc = subprocess.run([str(PEER_PYTHON), str(tmp_path / "run.py"), str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json"), str(ROOT / "peer")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    names = {k: [f"model.layers.{i}.self_attn.attn" for i, t in enumerate(config["layer_types"]) if t == k]
             for k in ("sliding_attention", "full_attention")}
    sliding, full = names["sliding_attention"], names["full_attention"]
    assert got["groups"] == [
        {"spec": "SlidingWindowSpec", "sliding_window": config["sliding_window"], "layers": sliding},
        {"spec": "FullAttentionSpec", "sliding_window": None, "layers": full},
    ]
    assert got["managers"] == ["SlidingWindowManager", "FullAttentionManager"]
    ids = torch.tensor([prompt])
    expected = model.generate(ids, do_sample=False, max_new_tokens=40)[0, ids.shape[1]:].tolist()
    assert len(prompt) > 3 * config["sliding_window"]
    assert got["tokens"] == expected
