"""A real vLLM server and the lab's engine watched side by side as two servers (issue 27): each with its own
pool and counters, and the router view's cached-prefix figures checked against what each server then
reports when the prompt is actually sent to it (vLLM's ``usage.prompt_tokens_details.cached_tokens``, the
lab's ``num_cached_tokens``).

vLLM 0.32 (``peer/vllm_server.py``, ``.peer-venv``) serves the embedded model with KV events on, 25 blocks
of 32 tokens; the lab's V1 engine in this process publishes its events in vLLM's format, blocks of 32. vLLM
is sent the "library" requests of ``peer/workload.py``, the lab the "bakery" ones; then new prompts of each
system prompt are routed and sent to both."""

from __future__ import annotations

import io
import json
import time
from argparse import Namespace

import pytest

from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine, SamplingParams, metrics
from engine.watch.command import watch as watch_cli
from engine.watch.router import main as route_main
from engine.watch.server_metrics import fetch_metrics

pytestmark = [pytest.mark.peer, pytest.mark.slow]

BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 25


@pytest.fixture(scope="module")
def side_by_side():
    from peer import vllm_server, workload

    why = vllm_server.server_available()
    if why:
        pytest.skip(f"vLLM's server cannot run here: {why}")
    reqs = workload.shared_prefix_requests(EMBEDDED_MODEL, max_tokens=8)
    by = {(r.system, r.question): r for r in reqs}
    lab = LLMEngine(EngineConfig(semantics="v1", block_size=BLOCK_SIZE, num_blocks=64, max_model_len=512,
                                 device="cpu", dtype="float32", kv_events_endpoint="tcp://127.0.0.1:0",
                                 kv_events_replay_endpoint="tcp://127.0.0.1:0"))

    def lab_send(ids: list[int]) -> int:
        rid = lab.add_request(list(ids), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while lab.has_unfinished():
            lab.step()
        return lab.get_output(rid).num_cached_tokens

    try:
        with vllm_server.VllmServer(num_gpu_blocks=NUM_GPU_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=4) as server:
            workload.send(server, [by[("library", "hours")], by[("library", "hamlet")]])
            for q in ("loaf", "cake"):
                lab_send(by[("bakery", q)].prompt_token_ids)
            lab.kv_event_publisher.flush()
            time.sleep(1.0)  # vLLM publishes its last batch after the last response
            yield {"server": server, "lab": lab, "lab_send": lab_send, "by": by}
    finally:
        lab.close()


def flags(s) -> list[str]:
    server, pub = s["server"], s["lab"].kv_event_publisher
    return ["--server", f"vllm={server.events_endpoint}", "--server", f"lab={pub.endpoint}",
            "--replay", f"vllm={server.replay_endpoint}", "--replay", f"lab={pub.replay_endpoint}",
            "--metrics", f"vllm={server.metrics_url}"]


def test_two_servers_each_with_its_own_pool_and_counters(side_by_side):
    from engine.cli import build_parser

    s = side_by_side
    args = build_parser().parse_args(["watch", *flags(s), "--duration", "4"])
    out = io.StringIO()
    assert watch_cli(args, out=out) == 0
    text = out.getvalue()
    values = fetch_metrics(s["server"].metrics_url)
    assert f"pool {NUM_GPU_BLOCKS} blocks" in text
    assert f"prefix cache hit rate {metrics.server_hit_rate_pct(values):.1f}% (lifetime)" in text
    vllm = next(line for line in text.splitlines() if line.startswith("vllm: "))
    lab = next(line for line in text.splitlines() if line.startswith("lab: "))
    n_vllm = int(vllm.split()[1])
    assert f"{metrics.cached_share_pct(n_vllm, NUM_GPU_BLOCKS):.1f}% of its pool of {NUM_GPU_BLOCKS - 1} usable" in vllm
    want_lab = sum(len(b) for b in s["lab"].block_manager.cached_blocks.values())
    assert lab.startswith(f"lab: {want_lab} cached blocks") and "pool" not in lab  # no /metrics: no pool claimed
    assert "rank 1" not in text


@pytest.mark.parametrize("system, question, favoured", [("library", "maps", "vllm"), ("bakery", "rolls", "lab")])
def test_the_routers_cached_prefix_is_what_each_server_then_reports(side_by_side, system, question, favoured,
                                                                     capsys):
    from engine.cli import build_parser

    s = side_by_side
    ids = s["by"][(system, question)].prompt_token_ids
    args = build_parser().parse_args(["route", *flags(s), "--prompt-ids", ",".join(map(str, ids)), "--json",
                                      "--wait", "3"])
    out = io.StringIO()
    assert route_main(args, out=out) == 0
    got = json.loads(out.getvalue())
    assert got["problems"] == [] and got["choice"] == favoured
    want = {name: got["servers"][name]["cached_prefix_tokens"] for name in ("vllm", "lab")}
    assert want[favoured] >= BLOCK_SIZE  # the system prompt's whole blocks are cached there
    # now send it: each server's own count of cached tokens is the router's figure
    vllm_cached = s["server"].complete(ids, max_tokens=8)["usage"]["prompt_tokens_details"]["cached_tokens"]
    lab_cached = s["lab_send"](ids)
    assert {"vllm": vllm_cached, "lab": lab_cached} == want
