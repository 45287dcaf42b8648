"""A real-size architecture on the lab's engine against transformers' own continuous batching, same device.

    python -m bench.real_size [--config smollm2-135m] [--device cuda] [--dtype bfloat16] [--batch 64]
                              [--prompt-len 128] [--max-tokens 128] [--layers N] [--out FILE.md] [--json FILE]

The model is built from one of the config files the lessons ship (``lessons/data/models/<name>.json``, the
model's own ``config.json`` fields with their source) with random weights (seed 0): the speed of a forward
pass does not depend on what the weights learned, and the hubs are out of reach here. Tokens in and out are
ids (the embedded model's tokenizer only names them; ids it does not know read as ""). ``--layers`` keeps the
first N layers (a CPU smoke run); the report says so.

Both sides get the same ``--batch`` prompts of ``--prompt-len`` random token ids, greedy, ``--max-tokens``
each with EOS ignored, all at once: the lab's ``LLMEngine.generate`` (V1 semantics, block 16, a pool of
every request's full length, attention through the device's backend: Triton on CUDA) and transformers'
``generate_batch`` (its paged continuous batching), each after an untimed warm-up. Tokens/s = generated tokens
/ wall seconds (CUDA synchronised). Part of ``bench/gpu_check.sh``, the one prepared GPU run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "lessons" / "data" / "models"


def build_model(name: str, device: str, dtype: str, layers: int | None = None):
    """(model, its config dict, source) from ``lessons/data/models/<name>.json`` with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = json.loads((MODELS / f"{name}.json").read_text())
    fields = dict(spec["config"])
    if layers is not None:
        if not 1 <= layers <= fields["num_hidden_layers"]:
            raise ValueError(f"--layers must be 1..{fields['num_hidden_layers']}, got {layers}")
        fields["num_hidden_layers"] = layers
    fields.pop("architectures", None)
    fields.pop("torch_dtype", None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.to(device).eval(), fields, spec.get("source", "")


def prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, min(vocab, 2048), (batch, prompt_len), generator=g).tolist()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_lab(model, tokenizer, device: str, dtype: str, ids: list[list[int]], max_tokens: int) -> dict:
    from engine import LLMEngine, SamplingParams
    from engine.scenarios.run_spec import RunSpec
    batch, total = len(ids), len(ids[0]) + max_tokens
    blocks = batch * -(-total // 16) + 16
    engine = LLMEngine(RunSpec(semantics="v1", device=device, dtype=dtype, block_size=16, num_blocks=blocks,
                               max_model_len=total, max_num_seqs=max(batch, 1),
                               max_num_batched_tokens=max(2048, len(ids[0]))).engine_config("paged"),
                       loaded=(model, tokenizer))
    engine.generate([ids[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    engine.reset_prefix_cache()  # the warm-up's prompt must not be a prefix hit for the timed run
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.output_token_ids) for o in outs)
    return {"engine": f"lab ({engine.backend} attention)", "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "outputs": [list(o.output_token_ids) for o in outs]}


def run_transformers(model, device: str, ids: list[list[int]], max_tokens: int) -> dict:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[ids[0]], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0))  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=ids, generation_config=cfg)
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"engine": "transformers generate_batch", "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def markdown(args, fields: dict, source: str, rows: list[dict], env: str) -> str:
    head = (f"## {args.device.upper()}: a real-size architecture, the lab vs transformers (`bench/real_size.py`)\n\n"
            f"`python -m bench.real_size --config {args.config} --device {args.device} --dtype {args.dtype} "
            f"--batch {args.batch} --prompt-len {args.prompt_len} --max-tokens {args.max_tokens}"
            + (f" --layers {args.layers}" if args.layers else "") + f"`. {env}. Architecture: `{args.config}` "
            f"({fields['num_hidden_layers']} layers{' kept of the real model' if args.layers else ''}, hidden "
            f"{fields['hidden_size']}, {fields['num_attention_heads']} query / {fields['num_key_value_heads']} KV heads, "
            f"vocab {fields['vocab_size']:,}; config from {source}) with random weights.\n\n")
    table = ["| engine | generated tokens | seconds | tokens/s |", "| --- | --- | --- | --- |"]
    table += [f"| {r['engine']} | {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} |" for r in rows]
    return head + "\n".join(table) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.real_size", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2-135m", choices=sorted(p.stem for p in MODELS.glob("*.json")))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (a CPU smoke run)")
    ap.add_argument("--out", type=Path, help="write the Markdown here")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    for name in ("batch", "prompt_len", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    from engine import EMBEDDED_MODEL
    from transformers import AutoTokenizer

    import transformers

    model, fields, source = build_model(args.config, args.device, args.dtype, args.layers)
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    ids = prompts(args.batch, args.prompt_len, fields["vocab_size"])
    rows = [run_lab(model, tokenizer, args.device, args.dtype, ids, args.max_tokens),
            run_transformers(model, args.device, ids, args.max_tokens)]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    env = f"{device_name}, torch {torch.__version__}, transformers {transformers.__version__}"
    text = markdown(args, fields, source, rows, env)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"out": str(args.out), "json": str(args.json)},
                                         "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
