"""A consumer of KV events written against vLLM itself, to show that the lab's publisher speaks vLLM.

Usage (in the peer venv, never the project's own):

    .peer-venv/bin/python peer/vllm_subscriber.py ENDPOINT REPLAY_ENDPOINT LIVE_BATCHES

Decodes with vLLM's own ``msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)``; asks
the replay socket for every batch from sequence number 0 (vLLM 0.32's ROUTER protocol: an empty delimiter
and 8 bytes big-endian; answers (topic, seq, payload) then seq -1), prints ``ready`` on stderr, then reads
LIVE_BATCHES batches from the PUB socket. Prints one JSON object on stdout: {"replayed": [BATCH],
"live": [BATCH]} with BATCH = {"seq", "ts", "data_parallel_rank", "events": [msgspec.to_builtins(event)
with "type" = the vLLM class name]}. Standalone: imports vLLM, pyzmq and msgspec only.
"""

from __future__ import annotations

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def as_json(seq: int, batch: KVEventBatch) -> dict:
    events = []
    for e in batch.events:
        d = msgspec.to_builtins(e)
        d["type"] = type(e).__name__
        events.append(d)
    return {"seq": seq, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def main(endpoint: str, replay_endpoint: str, live: int) -> int:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while replay.poll(5000):
        _, topic, seq, payload = replay.recv_multipart()
        if seq == END_SEQ:
            break
        replayed.append(as_json(int.from_bytes(seq, "big"), decoder.decode(payload)))
    print("ready", file=sys.stderr, flush=True)
    got = []
    while len(got) < live and sub.poll(20000):
        _, seq, payload = sub.recv_multipart()
        got.append(as_json(int.from_bytes(seq, "big"), decoder.decode(payload)))
    json.dump({"replayed": replayed, "live": got}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
