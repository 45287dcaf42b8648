"""vLLM's own code reads the lab's KV events unchanged: its ``KVEventBatch`` decoder, over the lab's PUB
socket and replay socket (``peer/vllm_subscriber.py`` runs in the vLLM peer environment)."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from engine import SamplingParams
from engine.kv_events import external_hash
from peer import conformance

pytestmark = [pytest.mark.peer]


def test_vllms_decoder_reads_the_lab_stream(make_engine, text_ids):
    why = conformance.peer_available()
    if why:
        pytest.skip(f"vLLM is not installed here: {why}")
    engine = make_engine(semantics="v1", block_size=8, num_blocks=24, max_model_len=96,
                         kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0")
    try:
        records = []
        for i in range(3):
            engine.add_request(text_ids[:20] + text_ids[30 + i:36 + i], SamplingParams(max_tokens=4))
        while engine.has_unfinished():
            records.append(engine.step())
        pub = engine.kv_event_publisher
        pub.flush()
        proc = subprocess.Popen([str(conformance.PEER_PYTHON), str(conformance.ROOT / "peer" / "vllm_subscriber.py"),
                                 pub.endpoint, pub.replay_endpoint, "1"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=conformance.ROOT)
        ready = threading.Event()

        def watch_stderr(lines: list):
            for line in proc.stderr:
                lines.append(line)
                if line.strip() == "ready":
                    ready.set()
        err: list[str] = []
        threading.Thread(target=watch_stderr, args=(err,), daemon=True).start()
        assert ready.wait(180), "vLLM's subscriber did not start:\n" + "".join(err[-30:])
        time.sleep(0.5)  # its SUB subscription reaches the publisher
        assert engine.reset_prefix_cache()
        engine.add_request(text_ids[:9], SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            records.append(engine.step())  # AllBlocksCleared, then a BlockStored: one live batch
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(err[-30:])
    finally:
        engine.close()
    got = json.loads(out)
    sent = [r.kv_events for r in records if r.kv_events]
    seen = got["replayed"] + got["live"]
    assert [b["seq"] for b in seen] == list(range(len(sent)))
    assert all(b["data_parallel_rank"] == 0 for b in seen)
    for batch, events in zip(seen, sent):
        assert [e["type"] for e in batch["events"]] == [e["type"] for e in events]
        for theirs, ours in zip(batch["events"], events):
            if ours["type"] == "AllBlocksCleared":
                continue
            assert theirs["block_hashes"] == [external_hash(h) for h in ours["block_hashes"]]
            if ours["type"] == "BlockStored":
                assert theirs["token_ids"] == ours["token_ids"]
                assert theirs["block_size"] == ours["block_size"] == 8
                parent = ours["parent_block_hash"]
                assert theirs["parent_block_hash"] == (None if parent is None else external_hash(parent))
                assert theirs["medium"] == "GPU"
    assert got["live"][0]["events"][0]["type"] == "AllBlocksCleared"
