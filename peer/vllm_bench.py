"""vLLM's side of ``bench/peer.py``: a persistent vLLM process that times workloads on request.

    .peer-venv/bin/python peer/vllm_bench.py --model assets/tiny_model [--max-threads 2]

Standalone like ``peer/vllm_driver.py``: vLLM and the standard library only, never the project's packages.
Engine start-up (~15-20 s for the first engine of a process: imports, model load) is paid once per
workload and never timed.

Line protocol: one JSON object per line on stdin, one JSON answer per line on stdout (nothing else is
written to stdout: file descriptor 1 is pointed at stderr at start, so vLLM's and C++'s prints land in
the log). Logs go to stderr. The first line written is ``{"ready": true, "vllm_version", "torch_version",
"transformers_version", "max_threads", "pid"}``.

    {"cmd": "build", "name": str, "block_size": int (multiple of 32), "num_gpu_blocks": int (INCLUDING
     vLLM's null block: usable = num_gpu_blocks - 1), "max_num_seqs": int, "max_num_batched_tokens": int,
     "max_model_len": int, "requests": [{"prompt_token_ids": [int], "max_tokens": int}, ...]}
        shuts the previous engine down, starts one with these settings (prefix caching and chunked prefill
        on, float32, enforce_eager, async scheduling off), warms it up with one short request and keeps the
        requests for "run". -> {"ok": true, "settings": {what vLLM applied}, "build_s", "warmup_s"}
    {"cmd": "run", "threads": int}
        ``reset_prefix_cache()`` (every run starts cold), torch/OpenMP threads = ``threads``, then adds every
        request (greedy, ignore_eos, token ids in and out) at t = 0 and calls ``LLMEngine.step()`` until
        none is unfinished. -> {"ok": true, "wall_s" (first add_request to the end of the step that
        finished the last request), "steps", "tokens", "ttft_s": [per request, in order: t = 0 to the end
        of the step that returned its first token], "outputs": [[token ids] per request], "threads"}
    {"cmd": "quit"} -> {"ok": true}; the process exits (also when stdin closes).
    Any failure -> {"ok": false, "error": str}; the process keeps serving.

Threads: ``OMP_NUM_THREADS`` is set to ``--max-threads`` before vLLM is imported (vLLM's CPU worker reads it
at start), and each run calls torch's real ``set_num_threads`` (kept before vLLM's CPU worker replaces
``torch.set_num_threads`` with a no-op) in this, the only thread that steps: the in-process engine core
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor) runs the model in the caller's thread, on torch's
intra-op pool, and vLLM's CPU attention kernels use the same OpenMP runtime.

Outputs are streamed (``RequestOutputKind.DELTA``): every step returns the new tokens of every request that
got one, as a streaming server would, and as the lab's ``step()`` does; that is how the first token's step
is known.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

from vllm_driver import set_env  # this script runs from peer/, beside the driver

_NAME = "vllm_bench"


def _log(msg: str) -> None:
    print(f"[{_NAME}] {msg}", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, model: str, set_threads) -> None:
        self.model = model
        self.set_threads = set_threads  # torch's own set_num_threads, before vLLM's worker stubs it out
        self.engine = None
        self.name = None
        self.requests: list[dict] = []
        self.runs = 0

    # ------------------------------------------------------------------------------------------- build
    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.engine_core.shutdown()
            finally:
                self.engine = None
                gc.collect()

    def build(self, cmd: dict) -> dict:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.close()
        block_size = int(cmd["block_size"])
        num_gpu_blocks = int(cmd["num_gpu_blocks"])
        if block_size % 32:  # vLLM itself: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"
            raise ValueError(f"vLLM's CPU attention needs block_size % 32 == 0, got {block_size}")
        if int(cmd["max_model_len"]) > (num_gpu_blocks - 1) * block_size:
            raise ValueError(f"max_model_len {cmd['max_model_len']} > usable blocks {num_gpu_blocks - 1} x "
                             f"{block_size}: vLLM refuses a pool that cannot hold one sequence")
        has_tok = any(os.path.exists(os.path.join(self.model, f))
                      for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        t0 = time.perf_counter()
        args = EngineArgs(
            model=self.model,
            tokenizer=self.model,
            skip_tokenizer_init=not has_tok,
            dtype="float32",
            seed=0,
            max_model_len=int(cmd["max_model_len"]),
            block_size=block_size,
            num_gpu_blocks_override=num_gpu_blocks,
            # only a cap (the pool is num_gpu_blocks pages); 1 GiB is far above these tiny models' need
            kv_cache_memory_bytes=int(cmd.get("kv_cache_memory_bytes", 1 << 30)),
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=int(cmd["max_num_batched_tokens"]),
            max_num_seqs=int(cmd["max_num_seqs"]),
            async_scheduling=False,
            enforce_eager=True,
            use_tqdm_on_load=False,
            disable_log_stats=True,
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.name = str(cmd.get("name", "workload"))
        self.requests = [{"prompt_token_ids": [int(t) for t in r["prompt_token_ids"]],
                          "max_tokens": int(r["max_tokens"])} for r in cmd.get("requests", [])]
        t1 = time.perf_counter()
        warm = [{"prompt_token_ids": list(range(1, 9)), "max_tokens": 4}]
        self._run(warm, f"warmup{self.runs}")
        t2 = time.perf_counter()
        vcfg = self.engine.vllm_config
        sc, cc = vcfg.scheduler_config, vcfg.cache_config
        core = self.engine.engine_core.engine_core
        settings = {
            "block_size": int(cc.block_size),
            "num_gpu_blocks": int(core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks),
            "max_num_seqs": int(sc.max_num_seqs),
            "max_num_batched_tokens": int(sc.max_num_batched_tokens),
            "max_model_len": int(vcfg.model_config.max_model_len),
            "enable_prefix_caching": bool(cc.enable_prefix_caching),
            "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
            "async_scheduling": bool(sc.async_scheduling),
            "enforce_eager": bool(vcfg.model_config.enforce_eager),
            "dtype": str(vcfg.model_config.dtype),
            "policy": str(sc.policy),
        }
        return {"ok": True, "settings": settings, "build_s": round(t1 - t0, 3), "warmup_s": round(t2 - t1, 3)}

    # --------------------------------------------------------------------------------------------- run
    def _run(self, requests: list[dict], tag: str) -> dict:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine still holds requests from an earlier run")
        if not engine.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache() was refused")
        ids = [f"{tag}-{i}" for i in range(len(requests))]
        index = {rid: i for i, rid in enumerate(ids)}
        outputs: list[list[int]] = [[] for _ in requests]
        ttft: list[float | None] = [None] * len(requests)
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False,
                                 output_kind=RequestOutputKind.DELTA) for r in requests]
        steps = 0
        t0 = time.perf_counter()
        try:
            for rid, r, sp in zip(ids, requests, params):
                engine.add_request(rid, {"prompt_token_ids": r["prompt_token_ids"]}, sp)
            t_end = t0
            step_s: list[float] = []
            while engine.has_unfinished_requests():
                before = time.perf_counter()
                outs = engine.step()
                steps += 1
                now = time.perf_counter()
                step_s.append(now - before)
                for ro in outs:
                    i = index[ro.request_id]
                    new = ro.outputs[0].token_ids
                    if new:
                        if ttft[i] is None:
                            ttft[i] = now - t0
                        outputs[i].extend(new)
                    if ro.finished:
                        t_end = now
        except BaseException:
            try:  # leave the engine empty for the next run
                engine.abort_request(ids)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            raise
        wall = t_end - t0
        return {"wall_s": wall, "steps": steps, "tokens": sum(len(o) for o in outputs), "ttft_s": ttft,
                "outputs": outputs, "step_s": step_s}

    def run(self, cmd: dict) -> dict:
        import torch

        if self.engine is None:
            raise RuntimeError("no engine: send a build command first")
        threads = int(cmd.get("threads", 1))
        self.set_threads(threads)
        self.runs += 1
        res = self._run(self.requests, f"{self.name}-r{self.runs}")
        res.update(ok=True, threads=int(torch.get_num_threads()))
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm_bench.py")
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    set_env(args.max_threads)
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout
    os.dup2(2, 1)  # anything else printed to stdout (vLLM, C++) goes to the log
    sys.stdout = sys.stderr

    def answer(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        import torch

        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces torch.set_num_threads with a no-op
        set_threads(args.max_threads)
        import transformers
        import vllm
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        answer({"ready": False, "error": f"cannot import vLLM in {sys.executable}: {e}"})
        return 2
    if not os.path.isdir(args.model):
        answer({"ready": False, "error": f"model folder not found: {args.model!r}"})
        return 2
    bench = Bench(args.model, set_threads)
    answer({"ready": True, "vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "max_threads": args.max_threads,
            "pid": os.getpid()})
    try:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                cmd = json.loads(line)
                kind = cmd.get("cmd")
                if kind == "quit":
                    answer({"ok": True})
                    break
                if kind == "build":
                    answer(bench.build(cmd))
                elif kind == "run":
                    answer(bench.run(cmd))
                else:
                    answer({"ok": False, "error": f"unknown command {kind!r}"})
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                answer({"ok": False, "error": f"{type(e).__name__}: {e}"})
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
