"""Step snapshots record only the blocks a step changed (``records.PoolDelta``) and build their per-block
lists when first read: whatever order they are read in, they must equal the full lists the block manager
held right after that step, in every scenario (sharing, copy-on-write, beams, swap, prefix-cache eviction,
preemption) and both semantics."""

from __future__ import annotations

import copy
import random

import pytest

from engine import EMBEDDED_MODEL, EngineConfig, LLMEngine
from engine.block_manager import BlockManager, TrackedList
from engine.records import POOL_LIST_FIELDS, Snapshot, make_snapshot
from engine.scenarios.presets import SCENARIOS
from engine.scenarios.workloads import run_workload

PAPER_ONLY = {"swap", "parallel-sampling", "beam-search"}
# hundreds of steps each, and nothing the others do not exercise (their other semantics stays)
LONG = {("lesson-lengths", "paper"), ("chat-arrivals", "paper"), ("chat-arrivals", "v1"), ("chat-workload", "paper")}


@pytest.fixture(scope="module")
def loaded_model(model_path):
    import torch

    from engine.model_loader import load_model

    return load_model(model_path, torch.device("cpu"), "float32")


def _run(name: str, semantics: str, loaded):
    sc = SCENARIOS[name]
    fields = {k: v for k, v in sc.engine_defaults.items() if k not in ("semantics", "model")}
    if sc.model and sc.model != EMBEDDED_MODEL:
        loaded = None  # a preset on another model (hybrid-window): the engine loads it
        fields["model"] = sc.model
    if semantics == "v1":
        fields.pop("preemption_mode", None)
        fields.pop("swap_space_blocks", None)
    engine = LLMEngine(EngineConfig(device="cpu", semantics=semantics, **fields), loaded=loaded)
    tokenize = lambda t: engine.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    records, truth = [], []

    def keep(record):
        records.append(record)  # read nothing from it yet: its lists stay unbuilt
        truth.append(engine.block_manager.pool_fields())  # fresh lists (owners' inner lists too)

    run_workload(engine, sc.make(0, tokenize), on_step=keep)
    return records, truth


def _scenarios():
    for name in sorted(SCENARIOS):
        for semantics in ("paper", "v1"):
            v1_only = SCENARIOS[name].model not in (None, EMBEDDED_MODEL)  # the hybrid model runs only in V1
            if (semantics == "v1" and name in PAPER_ONLY) or (name, semantics) in LONG or \
                    (semantics == "paper" and v1_only):  # a hybrid model has no paper semantics
                continue
            yield name, semantics


@pytest.mark.parametrize("name,semantics", list(_scenarios()))
def test_snapshots_equal_the_pool_after_their_step(name, semantics, loaded_model):
    records, truth = _run(name, semantics, loaded_model)
    assert len(records) > 3
    order = list(range(len(records)))
    random.Random(name).shuffle(order)  # views read steps in any order (scrubbing back and forth)
    for i in order:
        snap = records[i].snapshot
        for f in POOL_LIST_FIELDS:
            assert getattr(snap, f) == truth[i][f], f"{name}/{semantics} step {i + 1}: {f} differs"
        assert snap.num_free_blocks == truth[i]["num_free_blocks"]


def test_a_step_records_only_what_it_changed(loaded_model):
    engine = LLMEngine(EngineConfig(device="cpu", semantics="v1", block_size=16, num_blocks=4096,
                                    max_model_len=256), loaded=loaded_model)
    for i in range(4):
        engine.add_request([10 + i] * 40, None)
    first = engine.step().snapshot
    assert "ref_counts" in first.__dict__  # the first snapshot is a full one
    second = engine.step().snapshot
    delta = second.__dict__["_pool_delta"]
    assert delta.prev is first
    assert 0 < len(delta.blocks) <= 8  # 4 decoding sequences touch their last blocks, not the 4,096
    assert second.ref_counts == engine.block_manager.ref_counts  # built on read
    assert "_pool_delta" not in second.__dict__


def test_snapshot_equality_and_copies_see_the_lists(loaded_model):
    engine = LLMEngine(EngineConfig(device="cpu", block_size=16, num_blocks=64, max_model_len=256),
                       loaded=loaded_model)
    engine.add_request([7] * 20, None)
    engine.step()
    lazy = engine.step().snapshot
    eager = make_snapshot(**{**engine.block_manager.pool_fields(), "sequences": lazy.sequences,
                             "waiting": lazy.waiting, "running": lazy.running, "swapped": lazy.swapped})
    assert isinstance(lazy, Snapshot) and lazy == eager
    assert copy.deepcopy(engine.step().snapshot).fills == engine.block_manager.fills
    with pytest.raises(AttributeError):
        lazy.no_such_field  # noqa: B018


def test_tracked_list_marks_every_write():
    dirty: set[int] = set()
    xs = TrackedList([0] * 6, dirty)
    xs[2] = 1
    xs[-1] += 1
    xs[0:2] = [5, 5]
    assert dirty == {0, 1, 2, 5} and xs == [5, 5, 1, 0, 0, 1]
    clone = copy.deepcopy(xs)
    clone[3] = 9
    assert 3 in clone.dirty and 3 not in dirty


def test_reset_prefix_cache_makes_the_next_snapshot_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.snapshot_taken(object())
    bm.reset_prefix_cache()
    assert "pool_delta" not in bm.snapshot_fields()


def test_finished_requests_leave_the_per_step_loops(loaded_model):
    engine = LLMEngine(EngineConfig(device="cpu", semantics="v1", block_size=16, num_blocks=256, max_model_len=128),
                       loaded=loaded_model)
    from engine import SamplingParams
    for i in range(6):
        engine.add_request([9 + i] * 10, SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True))
    seen = []
    while engine.has_unfinished():
        rec = engine.step()
        seen.append({s.request_id for s in rec.snapshot.sequences})
        finished_now = {engine.requests[r].request_id for r in engine.requests
                        if engine.requests[r].finish_step == engine.step_count}
        assert finished_now <= seen[-1]  # a request finishing this step is still listed in its step
    engine.step()  # idle: everything finished in an earlier step
    assert engine.snapshot().sequences == [] and not engine._listed
    assert len(seen[0]) == 6 and len(seen[-1]) == 1
