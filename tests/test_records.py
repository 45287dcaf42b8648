"""StepRecords are plain data: JSON round trip keeps every field."""

from __future__ import annotations

import json

from engine import SamplingParams, StepRecord, read_trace, write_trace
def test_records_round_trip_through_json_lines(make_engine, text_ids, tmp_path):
    engine = make_engine(block_size=4, num_blocks=16)
    records = []
    engine.generate([text_ids[:5], text_ids[:9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                    on_step=records.append)
    path = tmp_path / "trace.jsonl"
    assert write_trace(records, path) == len(records)
    back = list(read_trace(path))
    assert back == records
    first = json.loads(path.read_text().splitlines()[0])
    assert first["kind"] == "prefill"
    assert [e["kind"] for e in first["events"]].count("allocate") == 2
    assert StepRecord.from_dict(first).snapshot.block_size == 4


def test_snapshot_reports_owners_counts_and_fills(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=16)
    rid = engine.add_request(text_ids[:6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    rec = engine.step()
    snap = rec.snapshot
    [state] = snap.sequences
    assert state.block_table == [0, 1] and state.num_tokens == 6
    assert snap.owners[0] == [rid] and snap.owners[1] == [rid] and snap.owners[2] == []
    assert snap.ref_counts[:3] == [1, 1, 0] and snap.fills[:3] == [4, 2, 0]
    assert snap.slots_allocated == 8 and snap.slots_used == 6
    assert rec.new_tokens[rid] == state.token_ids[-1]


def test_bad_trace_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1}\n')
    try:
        list(read_trace(path))
    except ValueError as exc:
        assert f"{path}:1" in str(exc)
    else:
        raise AssertionError("a broken trace must not load")
