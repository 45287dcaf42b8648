"""KV events of a hybrid model (KV cache groups), as vLLM 0.32 publishes them and as the lab does.

- ``engine.kv_events.decode_batch`` reads vLLM's hybrid batches: ``tests/data/vllm_hybrid_kv_batches.json``
  holds the four batches vLLM published in the conformance case ``hybrid-evict-sliding-B32`` (the driver's
  record of each event, every field, encoded by vLLM's own ``KVEventBatch`` structs and msgpack encoder in
  the peer environment by ``peer/hybrid_kv_batches.py``), among them a sliding-window group's BlockStored
  with no hash at all and one with 2 hashes over 4 blocks of tokens, and BlockRemoved events of both groups;
  and the lab, encoding what it decoded, sends the very same bytes (so vLLM's decoder reads the lab's).
- The lab's events carry ``group_idx`` on every BlockStored and BlockRemoved (0 included) and its
  BlockStored the group's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``, in its step records
  and through its publisher's encoding.
- What stays refused: a full-attention (or group-less) BlockStored whose tokens are not one block per hash,
  a sliding one whose tokens are not whole blocks or fewer than its hashes need, bad group fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import MalformedBatch, decode_batch, encode_batch
from engine.single_type_kv_cache_manager import KVCacheGroupSpec

DATA = Path(__file__).resolve().parent / "data" / "vllm_hybrid_kv_batches.json"
B = 4
GROUPS = (KVCacheGroupSpec((0, 2), 6), KVCacheGroupSpec((1, 3)))  # sliding (window 6 = 1.5 blocks), full


@pytest.fixture(scope="module")
def vllm_batches() -> list[tuple[int, bytes]]:
    data = json.loads(DATA.read_text())
    return [(step, bytes.fromhex(payload)) for step, payload in data["batches"]]


def test_vllms_hybrid_batches_decode_with_their_groups(vllm_batches):
    decoded = {step: decode_batch(p).events for step, p in vllm_batches}
    stored = [e for evs in decoded.values() for e in evs if e["type"] == "BlockStored"]
    # vLLM omits a field left None (omit_defaults): a full-attention group's window is not sent
    assert {(e["group_idx"], e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window")) for e in stored} == {
        (0, "sliding_window", 48), (1, "full_attention", None)}
    first = decoded[1]  # the 150-token prompt: 4 full blocks; the sliding group caches the 2 a hit can use
    assert [(e["group_idx"], len(e["block_hashes"]), len(e["token_ids"]) // e["block_size"]) for e in first] == [
        (0, 2, 4), (1, 4, 4)]
    assert first[0]["block_hashes"] == first[1]["block_hashes"][2:]  # the request's hashes, whatever the group
    none = decoded[11][0]  # the decode that fills block 4: out of the window's reach, no hash
    assert none["group_idx"] == 0 and none["block_hashes"] == [] and len(none["token_ids"]) == 32
    removed = [e["group_idx"] for evs in decoded.values() for e in evs if e["type"] == "BlockRemoved"]
    assert removed == [0, 0, 1, 1, 1, 1, 1]


def test_the_lab_publishes_vllms_hybrid_batches_byte_for_byte(vllm_batches):
    """What the lab sends for the events it read is what vLLM sent: field names, order, the group fields,
    the ones left out (a full group's window) and extra_keys."""
    for step, payload in vllm_batches:
        batch = decode_batch(payload)
        again = encode_batch(batch.events, ts=batch.ts, data_parallel_rank=batch.data_parallel_rank)
        assert again == payload, f"step {step}: the lab's bytes differ from vLLM's"


def test_the_lab_encodes_the_group_fields_and_reads_them_back():
    km = KVCacheManager(32, B, enable_prefix_caching=True, evict_uncached_first=True, groups=GROUPS)
    km.allocate_slots("a", list(range(100, 114)), 14)  # 3 full blocks of 4 + 2 tokens
    events = km.drain_kv_events()
    assert [(e["group_idx"], e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]) for e in events] == [
        (0, "sliding_window", 6), (1, "full_attention", None)]
    assert len(events[0]["block_hashes"]) < 3 == len(events[1]["block_hashes"])  # the sliding group's mask
    back = decode_batch(encode_batch(events)).events
    for lab, read in zip(events, back):
        assert {k: read.get(k) for k in ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")} == {
            k: lab[k] for k in ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")}
    km.free("a")
    for i in range(16):  # take the whole pool: the cached blocks are evicted
        km.allocate_slots(f"f{i}", [i], 1)
    removed = [e for e in km.drain_kv_events() if e["type"] == "BlockRemoved"]
    assert removed and {e["group_idx"] for e in removed} == {0, 1}
    assert [e["group_idx"] for e in decode_batch(encode_batch(removed)).events] == [e["group_idx"] for e in removed]


def _stored(hashes, tokens, **group) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, **group}


def _payload(*events) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


SLIDING = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 6}


@pytest.mark.parametrize("event, says", [
    (_stored([7], list(range(8))), "8 token ids for 1 blocks of 4, expected 4"),
    (_stored([7], list(range(8)), group_idx=1, kv_cache_spec_kind="full_attention"), "expected 4"),
    (_stored([7], list(range(6)), **SLIDING), "expected whole blocks"),
    (_stored([7, 8, 9], list(range(8)), **SLIDING), "at least 12 tokens"),
    (_stored([], [], **SLIDING), "at least one"),
    (_stored([7], list(range(4)), group_idx=-1), "group_idx int -1"),
    (_stored([7], list(range(4)), group_idx=True), "group_idx bool True"),
    (_stored([7], list(range(4)), kv_cache_spec_kind=3), "kv_cache_spec_kind int 3"),
    (_stored([7], list(range(4)), kv_cache_spec_sliding_window="48"), "kv_cache_spec_sliding_window str"),
    ({"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": "0"}, "group_idx str"),
])
def test_a_bad_hybrid_event_is_refused_naming_what(event, says):
    with pytest.raises(MalformedBatch, match=says):
        decode_batch(_payload(event))


def test_a_sliding_group_may_name_fewer_hashes_than_blocks():
    payload = _payload(_stored([], list(range(4)), **SLIDING), _stored([7], list(range(12)), **SLIDING))
    out = decode_batch(payload).events
    assert [len(e["block_hashes"]) for e in out] == [0, 1] and out[1]["kv_cache_spec_sliding_window"] == 6
