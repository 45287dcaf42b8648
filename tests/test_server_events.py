"""The lab watching a real vLLM server: vLLM's OpenAI-compatible server (``peer/vllm_server.py``, in the
``.peer-venv`` environment) runs the shared-prefix workload with KV events on; the lab's subscriber
(``engine/watch/kv_subscriber.py``) rebuilds its prefix cache from the events, and the test holds that view
against the lab's own V1 engine on the same requests: the same blocks stored and removed, batch by batch,
identified by content (the token prefix each block ends, since the two hash functions differ), the same
final cache, the same prefix-cache hits as vLLM's /metrics; a capture of the stream replays to the same
final state. Requests are sent one at a time, so each server step holds one request, as in the lab run."""

from __future__ import annotations

import time

import pytest

from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine, SamplingParams
from engine.watch.cache_mirror import PrefixCacheMirror, by_content
from engine.watch.capture import CaptureReplay, capture_from_raw, dumps_capture, new_header, read_capture
from engine.kv_events import decode_batch, encode_batch
from engine.watch.kv_subscriber import KVEventSubscriber
from engine.watch.server_metrics import fetch_metrics

pytestmark = [pytest.mark.peer, pytest.mark.slow]

NUM_GPU_BLOCKS = 25  # vLLM's pool incl. its null block: 24 usable blocks of 32 tokens, small enough to evict
BLOCK_SIZE = 32
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def served():
    from peer import vllm_server, workload

    why = vllm_server.server_available()
    if why:
        pytest.skip(f"vLLM's server cannot run here: {why}")
    requests = workload.shared_prefix_requests(EMBEDDED_MODEL)
    with vllm_server.VllmServer(num_gpu_blocks=NUM_GPU_BLOCKS, block_size=BLOCK_SIZE,
                                max_num_seqs=MAX_NUM_SEQS) as server:
        sub = KVEventSubscriber(server.events_endpoint, server.replay_endpoint)
        try:
            assert sub.wait_for(lambda v: v.state == "connected", 30), sub.view().state
            results = workload.send(server, requests, concurrency=1)
            # the last batch is published after the last response is sent: wait until the stream is quiet
            last = -1
            while True:
                time.sleep(1.0)
                n = sub.view().received
                if n == last:
                    break
                last = n
            metrics = fetch_metrics(server.metrics_url)
            view = sub.view()
            raw = sub.raw_batches()
        finally:
            sub.stop()
        yield {"requests": requests, "results": results, "view": view, "raw": raw, "metrics": metrics,
               "max_model_len": server.max_model_len}


@pytest.fixture(scope="module")
def lab_run(served):
    engine = LLMEngine(EngineConfig(semantics="v1", block_size=BLOCK_SIZE, num_blocks=NUM_GPU_BLOCKS - 1,
                                    max_model_len=served["max_model_len"], max_num_seqs=MAX_NUM_SEQS,
                                    device="cpu", dtype="float32"))
    batches, outputs = [], []
    for r in served["requests"]:
        rid = engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                    ignore_eos=True))
        while engine.has_unfinished():
            record = engine.step()
            if record.kv_events:
                batches.append(record.kv_events)
        outputs.append(engine.get_output(rid))
    return {"batches": batches, "outputs": outputs, "stats": engine.block_manager.stats}


def test_the_server_answered_with_the_labs_tokens(served, lab_run):
    theirs = [r["completion_token_ids"] for r in served["results"]]
    ours = [o.outputs[0].token_ids for o in lab_run["outputs"]]
    assert theirs == ours


def test_the_watched_cache_equals_the_lab_engines_batch_by_batch(served, lab_run):
    view = served["view"]
    assert view.malformed == 0 and view.lost == 0, view.errors
    server_batches = [decode_batch(r.payload).events for r in sorted(served["raw"], key=lambda r: r.seq)]
    lab_batches = [decode_batch(encode_batch(b)).events for b in lab_run["batches"]]
    theirs, ours = by_content(server_batches), by_content(lab_batches)
    assert len(theirs) == len(ours)
    for k, (a, b) in enumerate(zip(theirs, ours)):
        assert a == b, f"batch {k} differs"
    assert sum(s == "removed" for batch in theirs for s, _ in batch) > 0, "the workload was meant to evict"
    lab_mirror = PrefixCacheMirror()
    for seq, events in enumerate(lab_batches):
        lab_mirror.apply(seq, 0.0, events)
    assert view.mirror.prefixes() == lab_mirror.prefixes()
    assert view.mirror.num_blocks == lab_mirror.num_blocks > 0


def test_the_servers_own_hit_counters_agree(served, lab_run):
    m, stats = served["metrics"], lab_run["stats"]
    assert m["prefix_cache_queries"] == stats["queries"]
    assert m["prefix_cache_hits"] == stats["hits"] > 0
    assert m["num_gpu_blocks"] == NUM_GPU_BLOCKS and m["block_size"] == BLOCK_SIZE


def test_a_capture_of_the_stream_replays_to_the_same_cache(served):
    capture = capture_from_raw(served["raw"], new_header("test", ["tcp://127.0.0.1"]))
    back = read_capture(dumps_capture(capture).encode())
    final = CaptureReplay(back).state(len(back.batches)).mirrors[0]
    live = served["view"].mirror
    assert {h: b.copies for h, b in final.blocks.items()} == {h: b.copies for h, b in live.blocks.items()}
    assert [(h.seq, h.stored, h.removed) for h in final.history] == [(h.seq, h.stored, h.removed)
                                                                     for h in live.history]
