"""Seeing the hybrid model (issue 25, item 4): the step records carry every KV cache group's block table
(``SequenceState.group_block_tables``, the null block -1 where a sliding window gave a block back) and the
groups themselves (``Snapshot.kv_cache_groups``); a trace with them round-trips and ``read_trace`` checks
them strictly; a model of one full-attention group records them empty."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TEXT

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.metrics import hybrid_blocks_saved
from engine.model_loader import load_model
from engine.records import StepRecord, read_trace, write_trace

HYBRID = str(Path(__file__).resolve().parent.parent / "assets" / "tiny_hybrid_model")
B = 16


@pytest.fixture(scope="module")
def loaded():
    return load_model(HYBRID, torch.device("cpu"), "float32")


@pytest.fixture(scope="module")
def hybrid_records(loaded) -> list[StepRecord]:
    """One request of 56 prompt tokens decoding 12 more greedily: past the 48-token window (a block leaves
    the sliding group at the step that computes position 63)."""
    ids = loaded[1](TEXT, add_special_tokens=False)["input_ids"][:56]
    engine = LLMEngine(EngineConfig(model=HYBRID, device="cpu", dtype="float32", semantics="v1", block_size=B,
                                    num_blocks=24), loaded=loaded)
    engine.add_request(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    records = []
    while engine.has_unfinished():
        records.append(engine.step())
    return records


def test_snapshot_names_the_groups(hybrid_records):
    groups = hybrid_records[0].snapshot.kv_cache_groups
    assert groups == [{"kind": "sliding_window", "sliding_window": 48, "layers": [0, 2]},
                      {"kind": "full_attention", "sliding_window": None, "layers": [1, 3]}]


def test_sliding_table_holds_the_null_block_after_the_window_passes(hybrid_records):
    leave = [r for r in hybrid_records if any(e.kind == "leave_window" for e in r.events)]
    assert leave, "a request decoding past the window never gave a block back"
    rec = leave[0]
    (event,) = [e for e in rec.events if e.kind == "leave_window"]
    seq = rec.snapshot.sequences[0]
    sliding, full = seq.group_block_tables
    assert full == seq.block_table and -1 not in full
    assert sliding[0] == -1 and event.blocks == [hybrid_records[0].snapshot.sequences[0].group_block_tables[0][0]]
    assert len(sliding) == len(full)
    # before that step no table held the null block
    for r in hybrid_records[:hybrid_records.index(rec)]:
        assert all(-1 not in t for s in r.snapshot.sequences for t in s.group_block_tables)
    # the nulls are the blocks the arithmetic says the window left at the step's computed tokens
    (sched,) = rec.scheduled
    assert sliding.count(-1) == hybrid_blocks_saved(sched.start_pos, B, [48, None]) == 1


def test_finished_sequence_keeps_its_group_tables(hybrid_records):
    last = hybrid_records[-1].snapshot.sequences[0]
    assert last.status == "finished" and last.num_tokens == 0
    assert len(last.group_block_tables) == 2 and last.group_block_tables[1] == last.block_table
    assert last.group_block_tables[0][0] == -1


def test_trace_with_groups_round_trips(hybrid_records, tmp_path):
    path = tmp_path / "hybrid.jsonl"
    write_trace(hybrid_records, path)
    back = list(read_trace(path))
    assert [r.to_dict() for r in back] == [r.to_dict() for r in hybrid_records]


def _broken(rec: StepRecord, change) -> dict:
    d = rec.to_dict()
    change(d["snapshot"])
    return d


@pytest.mark.parametrize("change, says", [
    (lambda s: s["kv_cache_groups"][0].update(kind="linear"), "kv_cache_groups.0.kind"),
    (lambda s: s["kv_cache_groups"][0].update(sliding_window=None), "kv_cache_groups.0.sliding_window"),
    (lambda s: s["kv_cache_groups"][1].update(sliding_window=48), "kv_cache_groups.1.sliding_window"),
    (lambda s: s["kv_cache_groups"][1].update(layers=[0, 3]), "kv_cache_groups.1.layers"),
    (lambda s: s["kv_cache_groups"][1].update(extra=1), "kv_cache_groups.1: keys"),
    (lambda s: s["sequences"][0]["group_block_tables"].pop(), "2 KV cache groups"),
    (lambda s: s["sequences"][0]["group_block_tables"][0].pop(), "group_block_tables.0"),
    (lambda s: s["sequences"][0]["group_block_tables"][1].__setitem__(0, -1), "group_block_tables.1"),
    (lambda s: s["sequences"][0]["group_block_tables"][0].__setitem__(1, 999), "block 999"),
    (lambda s: s["kv_cache_groups"].clear(), "0 KV cache groups"),
])
def test_from_dict_refuses_bad_groups(hybrid_records, change, says):
    rec = next(r for r in hybrid_records if any(e.kind == "leave_window" for e in r.events))
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        StepRecord.from_dict(_broken(rec, change))


def test_single_group_model_records_them_empty(make_engine, tmp_path):
    engine = make_engine(num_blocks=16)
    engine.add_request("Hello there", SamplingParams(max_tokens=2, temperature=0.0))
    rec = engine.step()
    assert rec.snapshot.kv_cache_groups == []
    assert [s.group_block_tables for s in rec.snapshot.sequences] == [[]]
    write_trace([rec], tmp_path / "t.jsonl")
    assert list(read_trace(tmp_path / "t.jsonl"))[0].to_dict() == rec.to_dict()
