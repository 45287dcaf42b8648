"""The server mirror of a hybrid model (KV cache groups), against vLLM's own batches and the lab's engine.

- ``tests/data/vllm_hybrid_kv_batches.json`` (vLLM 0.32's hybrid allocator, conformance case
  ``hybrid-evict-sliding-B32``: window 48, blocks of 32): the mirror keeps each group's blocks (checked against
  a per-group multiset of the events' hashes, kept here independently), every hash's tokens and parent are
  those the full group's event gives (the sliding group's event, sent first with 2 hashes over 4 blocks,
  does not say which blocks they are), and the router's predicted hit follows vLLM's per-group rule (the
  sliding group's eviction in batch 43 takes the hit to 0 though the full group still holds the prefix).
- The lab's hybrid engine (``assets/tiny_hybrid_model``, window 48, blocks of 16) publishing its events
  over ZMQ (its publisher, in-process) to the lab's subscriber: after every step the mirror's
  hashes per group equal the pool's cached-block maps per group, and for each next prompt the router's
  predicted cached prefix equals the engine's ``num_cached_tokens``.
- A single-group server reads exactly as before: one group, no per-group line on the Server page.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from engine import EMBEDDED_HYBRID_MODEL

from engine.kv_events import decode_batch, external_hash
from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.router import cached_prefix

DATA = Path(__file__).resolve().parent / "data" / "vllm_hybrid_kv_batches.json"
HYBRID = EMBEDDED_HYBRID_MODEL


@pytest.fixture(scope="module")
def vllm_batches():
    data = json.loads(DATA.read_text())
    return [(step, decode_batch(bytes.fromhex(payload))) for step, payload in data["batches"]]


def held_by_group(batches) -> dict[int, Counter]:
    """The oracle: group -> multiset of hashes, from the events alone (store adds, removal takes one)."""
    out: dict[int, Counter] = {}
    for _, b in batches:
        for e in b.events:
            c = out.setdefault(e.get("group_idx") or 0, Counter())
            if e["type"] == "BlockStored":
                c.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                c.subtract(e["block_hashes"])
    return {g: +c for g, c in out.items()}


def mirror_groups(m: PrefixCacheMirror) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for h, b in m.blocks.items():
        for g in b.copy_groups():
            out.setdefault(g, Counter())[h] += 1
    return out


def test_vllms_batches_are_kept_per_group(vllm_batches):
    m = PrefixCacheMirror()
    counts = []
    for i, (step, b) in enumerate(vllm_batches):
        m.apply(step, b.ts, b.events)
        oracle = held_by_group(vllm_batches[:i + 1])
        assert mirror_groups(m) == {g: c for g, c in oracle.items() if c}
        assert m.group_blocks() == {g: sum(c.values()) for g, c in oracle.items()}
        assert sum(m.group_blocks().values()) == m.num_blocks
        counts.append(m.group_blocks())
    # the sliding group holds 2 of the first prompt's 4 blocks; batch 43 evicts them from it alone
    assert counts == [{0: 2, 1: 4}, {0: 2, 1: 5}, {0: 2, 1: 10}, {0: 4, 1: 9}]
    assert m.unknown_removals == 0 and m.inferred_blocks == 0 and m.notes == []
    assert m.hybrid and m.group_label(0) == "group 0 (sliding window, 48 tokens)"
    assert m.group_label(1) == "group 1 (full attention)"


def test_a_sliding_groups_hashes_get_the_full_groups_tokens_and_parent(vllm_batches):
    """The sliding group's BlockStored comes first with 2 hashes over 4 blocks; they are blocks 2 and 3."""
    truth = {}  # hash -> (parent, tokens) from the full group's events, one block per hash in order
    for _, b in vllm_batches:
        for e in b.events:
            if e["type"] == "BlockStored" and e["kv_cache_spec_kind"] == "full_attention":
                parent, size = e["parent_block_hash"], e["block_size"]
                for i, h in enumerate(e["block_hashes"]):
                    truth[h] = (parent, e["token_ids"][i * size:(i + 1) * size])
                    parent = h
    m = PrefixCacheMirror()
    for step, b in vllm_batches:
        m.apply(step, b.ts, b.events)
        for h, block in m.blocks.items():
            assert (block.parent, block.token_ids) == truth[h], f"batch {step}: block {h}"


def test_the_router_needs_every_group(vllm_batches):
    """The first prompt's 4 blocks + the decode's block: a hit needs the full group's chain from the left and
    the sliding group's last ceil(47 / 32) = 2 blocks before the hit point."""
    first, decode = vllm_batches[0][1].events[1], vllm_batches[1][1].events[1]
    ids = first["token_ids"] + decode["token_ids"] + [7]
    m = PrefixCacheMirror()
    hits = []
    for step, b in vllm_batches:
        m.apply(step, b.ts, b.events)
        hits.append(cached_prefix(m, ids).tokens)
    assert hits == [128, 128, 0, 128]
    # batch 43: the full group still has the prompt's first 5 blocks; the sliding group lost blocks 2 and 3
    m = PrefixCacheMirror()
    for step, b in vllm_batches[:3]:
        m.apply(step, b.ts, b.events)
    assert set(first["block_hashes"] + decode["block_hashes"]) <= m.group_hashes(1)
    assert not set(first["block_hashes"]) & m.group_hashes(0)
    assert cached_prefix(m, ids).matched_blocks == 0


def test_a_masked_store_no_event_explains_is_taken_as_the_ranges_tail():
    """A uniform sliding-window model: no full group names the hashes; they are counted and said."""
    m = PrefixCacheMirror()
    tokens = list(range(12))
    m.apply(0, 1.0, [{"type": "BlockStored", "block_hashes": ["aa"], "parent_block_hash": None, "token_ids": tokens,
                      "block_size": 4, "group_idx": 0, "kv_cache_spec_kind": "sliding_window",
                      "kv_cache_spec_sliding_window": 6}])
    assert m.blocks["aa"].token_ids == [8, 9, 10, 11] and m.blocks["aa"].parent is None
    assert m.inferred_blocks == 1 and "last blocks" in m.notes[-1]
    assert m.hybrid and m.group_blocks() == {0: 1}


def test_a_single_group_server_reads_as_before():
    from viz.server import groups_line, prefix_tree_figure, rank_numbers

    for extra in ({}, {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}):
        m = PrefixCacheMirror()
        m.apply(0, 1.0, [{"type": "BlockStored", "block_hashes": ["a", "b"], "parent_block_hash": None,
                          "token_ids": [1, 2, 3, 4], "block_size": 2, **extra}])
        m.apply(1, 2.0, [{"type": "BlockRemoved", "block_hashes": ["b"], **({"group_idx": 0} if extra else {})}])
        assert not m.hybrid and m.group_blocks() == {0: 1} and m.num_blocks == 1
        n = rank_numbers(m)
        assert n["groups"] == [] and groups_line(n) == ""
        assert "group" not in " ".join(prefix_tree_figure(m).data[1].hovertext)
        assert cached_prefix(m, [1, 2, 3, 4, 5]).tokens == 2


def test_the_server_page_names_each_groups_count(vllm_batches):
    from viz.server import groups_line, rank_numbers

    m = PrefixCacheMirror()
    for step, b in vllm_batches[:1]:
        m.apply(step, b.ts, b.events)
    n = rank_numbers(m)
    assert n["blocks"] == 6 == sum(g["blocks"] for g in n["groups"])
    assert [(g["group"], g["blocks"], g["tokens"]) for g in n["groups"]] == [(0, 2, 64), (1, 4, 128)]
    assert groups_line(n) == ("cached blocks by KV cache group: group 0 (sliding window, 48 tokens) 2 · "
                              "group 1 (full attention) 4")
    from viz.server import prefix_tree_figure

    hover = {t.split("<br>")[0].split(":")[0]: t for t in prefix_tree_figure(m).data[1].hovertext}
    held_twice = [t for t in hover.values() if "copies: 2" in t]
    assert len(held_twice) == 2 and all(
        "(group 0 (sliding window, 48 tokens) x1, group 1 (full attention) x1)" in t for t in held_twice)


# ------------------------------------------------------------------------------------ the lab's hybrid engine
@pytest.fixture(scope="module")
def hybrid_run(hybrid_loaded):
    """A workload on the tiny hybrid model (a pool of 40 blocks of 16: evictions happen) whose engine publishes
    its KV events over ZMQ (the lab's publisher, in-process, on a free port) to the lab's subscriber, whose
    mirror is read after every step; per prompt: (predicted, engine's cached tokens, full-group-only
    prediction); per step: the mirror's and the pool's hashes per group."""
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.watch.kv_subscriber import KVEventSubscriber

    loaded = hybrid_loaded
    e = LLMEngine(EngineConfig(model=HYBRID, device="cpu", dtype="float32", semantics="v1", block_size=16,
                               num_blocks=40, enable_prefix_caching=True, max_num_seqs=4,
                               kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0"),
                  loaded=loaded)
    pub = e.kv_event_publisher
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    rng = random.Random(0)
    a = [rng.randrange(1, 2000) for _ in range(160)]
    c = [rng.randrange(1, 2000) for _ in range(200)]
    prompts = [(a, 3), (a[:112] + [rng.randrange(1, 2000) for _ in range(30)], 3), (a[:150] + [7, 8, 9], 3), (a, 3),
               (c, 30), (c[:100] + [5] * 20, 3), *[([rng.randrange(1, 2000) for _ in range(120)], 3) for _ in range(4)],
               (a, 3), (c[:190], 3)]
    rows, states, published = [], [], 0
    try:
        for ids, n in prompts:
            m = sub.view().mirror
            predicted = cached_prefix(m, ids)
            full_only = min(sum(1 for _ in _chain_in(m, ids, 1)), (len(ids) - 1) // 16) * 16
            rid = e.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            while e.has_unfinished():
                published += bool(e.step().kv_events)  # the engine publishes a batch for a step with events
                assert sub.wait_for(lambda v: (-1 if v.mirror.last_seq is None else v.mirror.last_seq) == published - 1,
                                    10), sub.view().state
                pool = e.block_manager.pool
                states.append((mirror_groups(sub.view().mirror),
                               {g: Counter({format(external_hash(h), "016x"): len(bs) for h, bs in cache.items() if bs})
                                for g, cache in enumerate(pool.group_cached_blocks)}))
            rows.append((predicted.tokens, e.requests[rid].num_cached_tokens, full_only))
        final = sub.view().mirror
    finally:
        sub.stop()
        e.close()
    return rows, states, final


def _chain_in(m, ids, group):
    """The prompt's blocks held in ``group`` from the left (what a single-group router would count)."""
    index = {(b.parent, tuple(b.token_ids)): h for h, b in m.blocks.items()}
    held, parent = m.group_hashes(group), None
    for i in range(len(ids) // 16):
        h = index.get((parent, tuple(ids[i * 16:(i + 1) * 16])))
        if h is None or h not in held:
            return
        yield h
        parent = h


def test_the_mirror_holds_the_engines_blocks_per_group(hybrid_run):
    _, states, m = hybrid_run
    for step, (mirror, pool) in enumerate(states):
        assert mirror == {g: c for g, c in pool.items() if c}, f"step {step}"
    assert len(m.group_specs) == 2 and m.inferred_blocks == 0


def test_the_router_predicts_the_engines_cached_tokens(hybrid_run):
    rows, _, _ = hybrid_run
    assert [p for p, _, _ in rows] == [cached for _, cached, _ in rows]
    assert any(p > 0 for p, _, _ in rows)  # hits happen
    # and the sliding group decides some: the full group alone would predict more than the engine serves
    assert any(full > cached for _, cached, full in rows)


def test_the_server_page_replays_a_hybrid_capture_with_its_groups(vllm_batches, tmp_path):
    """vLLM's hybrid batches as a capture, replayed on the Server page: the total is every group's, and a
    caption says which group each count is."""
    from streamlit.testing.v1 import AppTest

    from engine.watch.capture import Capture, CaptureBatch, dumps_capture, new_header

    data = json.loads(DATA.read_text())
    capture = Capture(header=new_header("vLLM 0.32, hybrid-evict-sliding-B32", ["tcp://vllm:5557"], block_size=32),
                      batches=[CaptureBatch(rank=0, seq=step, t=float(i), payload=bytes.fromhex(payload))
                               for i, (step, payload) in enumerate(data["batches"])])
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=180)
    at.run()
    at.switch_page("ui/server.py").run()
    at.radio(key="server_mode").set_value("Replay a capture").run()
    at.sidebar.file_uploader(key="replay_upload").set_value(
        ("hybrid.jsonl", dumps_capture(capture).encode(), "application/octet-stream")).run()
    at.slider(key="replay_scrub").set_value(len(data["batches"])).run()
    assert not at.exception
    assert [m.value for m in at.metric if m.label == "cached blocks"] == ["13"]
    captions = [c.value for c in at.caption]
    assert ("cached blocks by KV cache group: group 0 (sliding window, 48 tokens) 4 · group 1 (full attention) 9"
            in captions), captions


def test_by_content_names_a_sliding_groups_blocks_by_their_own_prefix(vllm_batches):
    """``by_content`` (how the lab's and vLLM's batches are compared) describes batch 1's sliding store as the
    prompt's blocks 2 and 3 (prefixes of 96 and 128 tokens), as the full group's do."""
    from engine.watch.cache_mirror import by_content

    first = by_content([b.events for _, b in vllm_batches])[0]
    tokens = vllm_batches[0][1].events[1]["token_ids"]
    assert first == [("stored", tuple(tokens[:96])), ("stored", tuple(tokens[:128]))] + [
        ("stored", tuple(tokens[:32 * k])) for k in (1, 2, 3, 4)]
