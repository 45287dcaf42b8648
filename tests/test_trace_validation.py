"""Traces are checked field by field when read: wrong types, unknown event kinds, impossible counts and
absurdly deep JSON are refused with a ValueError naming the line and the field, while every record the
engine writes (every event kind it emits, with its typed data) reads back unchanged."""

from __future__ import annotations

import copy
import json

import pytest

from engine import SamplingParams, StepRecord, read_trace, write_trace
from engine.records import EVENT_DATA, EventKind


@pytest.fixture(scope="module")
def sample_record(model_path):
    from engine import EngineConfig, LLMEngine
    engine = LLMEngine(EngineConfig(model=model_path, device="cpu", block_size=4, num_blocks=16))
    engine.add_request("ROMEO. ", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    return engine.step().to_dict()


def _write(tmp_path, record: dict | str):
    path = tmp_path / "t.jsonl"
    path.write_text(record if isinstance(record, str) else json.dumps(record) + "\n")
    return path


@pytest.mark.parametrize("change, field", [
    (lambda d: d["snapshot"].update(num_free_blocks=1_000_000_000), "free blocks"),  # -999,999,984 used
    (lambda d: d["snapshot"].update(num_blocks=-5), "num_blocks"),
    (lambda d: d["snapshot"].update(num_blocks="16"), "snapshot.num_blocks"),
    (lambda d: d.update(step=True), "step"),
    (lambda d: d.update(kind="compute"), "kind"),
    (lambda d: d["events"][0].update(kind="teleport"), "events.0.kind"),
    (lambda d: d["events"][0]["data"].update(num_tokens="7"), "num_tokens"),
    (lambda d: d["events"][0]["data"].update(surprise=1), "surprise"),
    (lambda d: d["snapshot"]["ref_counts"].append(0), "ref_counts"),
    (lambda d: d["snapshot"]["sequences"][0].update(status="sleeping"), "status"),
])
def test_bad_fields_are_refused_by_name(sample_record, tmp_path, change, field):
    bad = copy.deepcopy(sample_record)
    change(bad)
    with pytest.raises(ValueError, match=field) as info:
        list(read_trace(_write(tmp_path, bad)))
    assert ":1:" in str(info.value)


def test_self_contradicting_records_are_refused(sample_record, tmp_path):
    """Free blocks that disagree with the reference counts, impossible durations, NaN, steps out of order."""
    for change, field in [(lambda d: d["snapshot"].update(num_free_blocks=0), "num_free_blocks"),
                          (lambda d: d.update(elapsed_s=-3.0), "elapsed_s")]:
        bad = copy.deepcopy(sample_record)
        change(bad)
        with pytest.raises(ValueError, match=field):
            list(read_trace(_write(tmp_path, bad)))
    with pytest.raises(ValueError, match=":1: not JSON"):
        list(read_trace(_write(tmp_path, json.dumps(sample_record).replace('"elapsed_s": ', '"elapsed_s": NaN, "x": ') + "\n")))
    line = json.dumps(sample_record)
    with pytest.raises(ValueError, match=":2: step 1 does not follow step 1"):
        list(read_trace(_write(tmp_path, line + "\n" + line + "\n")))


def test_deep_json_is_refused_not_a_recursion_error(tmp_path):
    path = _write(tmp_path, "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=":1: not JSON"):
        list(read_trace(path))


def test_every_event_kind_the_engine_emits_reads_back(make_engine, text_ids, tmp_path):
    """A swap run, parallel samples, beams, shared prefixes and a reset: their traces read back equal."""
    kinds = set()
    for cfg, prompts, params in [
        (dict(block_size=4, num_blocks=12, max_model_len=40, preemption_mode="swap"),
         [text_ids[:7 + i] for i in range(5)], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)),
        (dict(block_size=4, num_blocks=32), [text_ids[:6]], SamplingParams(n=3, max_tokens=6, seed=1)),
        (dict(block_size=4, num_blocks=48), [text_ids[:5]], SamplingParams(beam_width=3, max_tokens=5)),
        (dict(block_size=4, num_blocks=4, max_model_len=16), [text_ids[:9], text_ids[:9], text_ids[:12]],
         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
    ]:
        engine = make_engine(**cfg)
        records = []
        engine.generate(prompts, params, on_step=records.append)
        assert engine.reset_prefix_cache()
        engine.add_request(text_ids[:3], SamplingParams(max_tokens=1, temperature=0.0))
        records.append(engine.step())
        path = tmp_path / "trace.jsonl"
        write_trace(records, path)
        assert list(read_trace(path)) == records
        for r in records:
            for e in r.events:
                assert isinstance(e.kind, EventKind) and set(e.data) <= set(EVENT_DATA[e.kind])
                kinds.add(e.kind)
    assert {"admit", "allocate", "append", "new_block", "cow", "fork", "free", "prefix_hit", "evict", "preempt",
            "swap_out", "swap_in", "finish", "reset_prefix_cache"} <= kinds
