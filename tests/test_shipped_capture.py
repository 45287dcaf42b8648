"""The capture the Server page ships (``assets/captures/vllm-shared-prefix.jsonl``, recorded from a real
vLLM 0.32 server by ``peer/record_capture.py``) replays offline, and the lab's V1 engine, given the same
requests and pool, produces the same KV events batch by batch (by content): no vLLM needed to check it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.watch.cache_mirror import by_content
from engine.watch.capture import CaptureReplay, read_capture
from engine.kv_events import decode_batch, encode_batch
from peer.workload import shared_prefix_requests

CAPTURE = Path(__file__).resolve().parent.parent / "assets" / "captures" / "vllm-shared-prefix.jsonl"


@pytest.fixture(scope="module")
def capture():
    return read_capture(CAPTURE)


def test_the_capture_replays_offline(capture):
    h = capture.header
    assert h["block_size"] == 32 and h["num_gpu_blocks"] == 25 and "vLLM" in h["source"]
    replay = CaptureReplay(capture)
    final = replay.state(len(replay)).mirrors[0]
    assert final.num_blocks <= h["num_gpu_blocks"] - 1  # never more cached than the usable pool
    assert final.total_removed > 0 and final.total_stored > final.num_blocks  # it filled and evicted
    assert len(final.children()[None]) == 3  # the three system prompts are the roots
    assert [b.seq for b in capture.batches] == list(range(len(capture.batches)))
    assert len(capture.metrics) == 20 and capture.metrics[-1]["values"]["prefix_cache_hits"] > 0


def test_the_lab_reproduces_the_real_servers_events(capture):
    engine = LLMEngine(EngineConfig(semantics="v1", block_size=32, num_blocks=capture.header["num_gpu_blocks"] - 1,
                                    max_model_len=512, max_num_seqs=4, device="cpu", dtype="float32"))
    batches = []
    for r in shared_prefix_requests():
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            record = engine.step()
            if record.kv_events:
                batches.append(decode_batch(encode_batch(record.kv_events)).events)
    theirs = by_content([decode_batch(b.payload).events for b in capture.batches])
    ours = by_content(batches)
    assert len(ours) == len(theirs)
    for k, (a, b) in enumerate(zip(theirs, ours)):
        assert a == b, f"batch {k} differs"
    # the server's own hit counter after the last response, against the lab's
    assert capture.metrics[-1]["values"]["prefix_cache_hits"] == engine.block_manager.stats["hits"]


def test_the_capture_keeps_the_servers_time_for_a_paced_replay(capture):
    # written before captures had a ``ts`` field: the replay reads each batch's own time from its payload
    from engine.watch.capture import replay_gap, server_time

    stamps = [server_time(b) for b in capture.batches]
    assert all(s is not None for s in stamps) and stamps == sorted(stamps)
    gaps = [replay_gap(a, b) for a, b in zip(capture.batches, capture.batches[1:])]
    assert gaps == [b - a for a, b in zip(stamps, stamps[1:])] and sum(gaps) > 0
