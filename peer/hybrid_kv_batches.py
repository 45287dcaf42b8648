"""Write ``tests/data/vllm_hybrid_kv_batches.json``: the KV event batches vLLM published in the conformance
case ``hybrid-evict-sliding-B32``, encoded by vLLM's own structs and msgpack encoder.

    .peer-venv/bin/python peer/hybrid_kv_batches.py RESULT.json tests/data/vllm_hybrid_kv_batches.json

RESULT.json: the case's ``.peer-cache/case-*.json`` (``{"meta", "result"}``) or a driver OUT.json holding
it. Every field the driver recorded is given back to vLLM's ``BlockStored`` / ``BlockRemoved`` (hashes as
the ints vLLM published, ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, medium
"GPU"), and ``extra_keys`` as ``BlockPool.cache_full_blocks`` passes them for a request without LoRA,
multimodal input or cache salt (``to_event_extra_keys``: one None per hash, None for no hash); ``ts`` is
made up (a fixed start plus the step). Standalone: imports vLLM, msgspec and the standard library only.
"""

from __future__ import annotations

import json
import sys

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

CASE = "hybrid-evict-sliding-B32"


def main(src: str, dst: str) -> int:
    data = json.load(open(src))
    rec = data["result"] if "result" in data else data["cases"][CASE]
    enc = msgspec.msgpack.Encoder()
    out = []
    for s in rec["steps"]:
        events = []
        for e in s["kv_events"]:
            hashes = [int(h) for h in e["block_hashes"]]
            if e["type"] == "BlockStored":
                parent = e["parent_block_hash"]
                events.append(BlockStored(
                    block_hashes=hashes, parent_block_hash=None if parent is None else int(parent),
                    token_ids=e["token_ids"], block_size=e["block_size"], lora_id=None, medium="GPU",
                    lora_name=None, extra_keys=[None] * len(hashes) or None, group_idx=e["group_idx"],
                    kv_cache_spec_kind=e["kv_cache_spec_kind"],
                    kv_cache_spec_sliding_window=e["kv_cache_spec_sliding_window"]))
            elif e["type"] == "BlockRemoved":
                events.append(BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=e["group_idx"]))
        if events:
            batch = KVEventBatch(ts=1764790000.0 + s["step"], events=events, data_parallel_rank=0)
            out.append((s["step"], enc.encode(batch).hex()))
    with open(dst, "w") as f:
        json.dump({"case": CASE, "made_by": "peer/hybrid_kv_batches.py", "batches": out}, f, indent=0)
    print(f"{len(out)} batches written to {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
