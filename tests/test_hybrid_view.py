"""Seeing the hybrid model (issue 25, item 4): the step records carry every KV cache group's block table
(``SequenceState.group_block_tables``, the null block -1 where a sliding window gave a block back) and the
groups themselves (``Snapshot.kv_cache_groups``); a trace with them round-trips and ``read_trace`` checks
them strictly; a model of one full-attention group records them empty."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TEXT

from engine import EMBEDDED_HYBRID_MODEL, EngineConfig, LLMEngine, SamplingParams
from engine.metrics import hybrid_blocks_saved
from engine.records import StepRecord, read_trace, write_trace

HYBRID = EMBEDDED_HYBRID_MODEL
B = 16


@pytest.fixture(scope="module")
def loaded(hybrid_loaded):
    return hybrid_loaded


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


# ------------------------------------------------------------------------------------------- the figures
ORDER = ["R1"]


@pytest.fixture(scope="module")
def left(hybrid_records) -> StepRecord:
    """The step at which block 0 left R1's window."""
    return next(r for r in hybrid_records if any(e.kind == "leave_window" for e in r.events))


def test_block_tables_draw_a_row_per_group_with_the_null_block(left):
    from viz.block_table import block_table_figure, block_table_picture

    pic = block_table_picture(left.snapshot, left.events, ORDER)
    assert [(r["label"], r["group"]) for r in pic["rows"]] == [("R1 window 48", 0), ("R1 full", 1)]
    seq = left.snapshot.sequences[0]
    assert [r["table"] for r in pic["rows"]] == seq.group_block_tables
    assert all(a["physical"] != -1 for a in pic["arrows"])  # no arrow from a null entry
    assert pic["left_window"] == [{"key": "R1 window 48", "seq_id": "R1", "group": 0, "blocks": [0], "logical": [0]}]
    fig = block_table_figure(left, ORDER).to_dict()
    ticks = fig["layout"]["yaxis"]["ticktext"]
    assert [t.split("</span> ")[1] for t in ticks] == ["R1 window 48", "R1 full"]
    labels = next(t for t in fig["data"] if t.get("meta", {}).get("role") == "logical_labels")
    assert labels["text"].count("null") == 1
    caption = " ".join(a["text"] for a in fig["layout"]["annotations"] if a.get("name") == "caption")
    assert "left the window: R1 window 48 block 0" in caption
    # the null entry is outlined as what the step changed
    outline = next(t for t in fig["data"] if t.get("meta", {}).get("role") == "outline_changed")
    x0 = labels["x"][labels["text"].index("null")]
    assert any(abs(x - x0) < 0.5 for x in outline["x"] if x is not None)


def test_pool_marks_the_group_of_each_block(left):
    from viz.pool import pool_cells

    seq = left.snapshot.sequences[0]
    cells = {c["block"]: c for c in pool_cells(left.snapshot, ORDER)}
    for g, tag in ((0, "win"), (1, "full")):
        for b in seq.group_block_tables[g]:
            if b >= 0:
                assert cells[b]["group"] == g and cells[b]["label"].endswith(f" {tag}")
    freed = [e for e in left.events if e.kind == "leave_window"][0].blocks[0]
    assert cells[freed]["group"] is None and cells[freed]["ref_count"] == 0


def test_the_saving_line_is_the_metric(left, hybrid_records):
    from engine.metrics import hybrid_saving
    from viz.stage import hybrid_line, hybrid_short, stage_step

    (sched,) = left.scheduled
    want = hybrid_blocks_saved(sched.start_pos, B, [48, None])
    saving = hybrid_saving(left.snapshot, 100)
    assert saving["blocks"] == want == 1 and saving["bytes"] == 100
    seq = left.snapshot.sequences[0]
    assert saving["held"] == sum(b >= 0 for t in seq.group_block_tables for b in t)
    assert saving["twin"] == saving["held"] + want
    line = stage_step(left, order=ORDER).hybrid_line(100)
    assert "window 48 (layers 0, 2), full (layers 1, 3)" in line
    assert f"gave back {want} block (100 bytes): {saving['held']} blocks held where every layer full would hold " \
           f"{saving['twin']}" in line
    assert hybrid_short(left.snapshot, 100).startswith(f"windows gave back {want} block (100 bytes)")
    before = hybrid_records[hybrid_records.index(left) - 1]
    assert hybrid_saving(before.snapshot)["blocks"] == 0


def test_a_single_group_run_looks_as_before(make_engine):
    from viz.block_table import block_table_picture
    from viz.pool import pool_cells
    from viz.stage import hybrid_line

    engine = make_engine(num_blocks=16)
    engine.add_request("Hello there", SamplingParams(max_tokens=2, temperature=0.0))
    rec = engine.step()
    pic = block_table_picture(rec.snapshot, rec.events, ["R1"])
    assert [(r["label"], r["group"]) for r in pic["rows"]] == [("R1", None)] and pic["left_window"] == []
    assert all(c["group"] is None and " full" not in c["label"] for c in pool_cells(rec.snapshot, ["R1"]))
    assert hybrid_line(rec.snapshot) is None


# ------------------------------------------------------------------------------------ preset, Next, CLI
def test_the_preset_names_the_hybrid_model_and_v1():
    from engine.scenarios.presets import get_scenario
    from engine.scenarios.run_spec import RunSpec

    spec = RunSpec.from_preset("hybrid-window")
    assert Path(spec.model).resolve() == Path(HYBRID).resolve() and spec.semantics == "v1"
    assert get_scenario("hybrid-window").model == spec.model
    assert RunSpec.from_preset("batch").model != spec.model  # other presets keep the embedded model


def test_next_event_stops_where_a_block_leaves_the_window(loaded):
    from ui.lab import Lab
    from ui.state import preset_settings

    lab = Lab.create(preset_settings("hybrid-window"), loaded)
    assert lab.press("next") == "next"
    history, index, _ = lab.frame()
    shown = history[index][0]
    assert shown.step == 3 and lab.key_events(shown) == ["leave_window"]
    assert -1 in shown.snapshot.sequences[0].group_block_tables[0]
    lab.press("next")
    history, index, _ = lab.frame()
    assert history[index][0].step == 19 and lab.key_events(history[index][0]) == ["leave_window"]
    assert "block leaving a window" in lab.key_events_said()


def test_cli_json_carries_the_groups_and_the_same_saving(loaded, monkeypatch, capsys, tmp_path):
    import json

    import engine.llm_engine as llm_engine
    from engine.cli import main
    from engine.metrics import hybrid_saving
    from engine.records import read_trace

    real = llm_engine.LLMEngine
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config, given=None: real(config, loaded=given or loaded))
    trace = tmp_path / "hybrid.jsonl"
    assert main(["run", "--scenario", "hybrid-window", "--json", "--trace", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    records = list(read_trace(trace))
    assert out["kv_cache_groups"] == records[0].snapshot.kv_cache_groups
    hybrid = out["hybrid"]
    peak = max(records, key=lambda r: hybrid_saving(r.snapshot)["blocks"])
    (r1,) = [s for s in peak.scheduled if s.seq_id == "R1"]
    assert hybrid["peak"]["blocks"] == hybrid_saving(peak.snapshot)["blocks"] == \
        hybrid_blocks_saved(r1.start_pos, B, [48, None]) == 2
    assert hybrid["peak"]["bytes"] == 2 * hybrid["bytes_per_block"]
    r1_out = next(r for r in out["requests"] if r["id"] == "R1")
    assert r1_out["group_block_tables"][1] == r1_out["block_table"] and r1_out["group_block_tables"][0][:2] == [-1, -1]
    assert main(["run", "--scenario", "hybrid-window"]) == 0
    text = capsys.readouterr().out
    assert "sliding windows gave back up to 2 blocks" in text and "left the 48-token sliding window" in text


@pytest.mark.slow
def test_playground_on_the_hybrid_preset_shows_the_groups_and_the_saving():
    """The Playground opened on the preset at the step a block left the window (AppTest, a scenario link): the
    saving in the metrics row and its line read ``engine.metrics.hybrid_saving`` of that step."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=180)
    at.query_params["scenario"] = "hybrid-window"
    at.query_params["step"] = "3"
    at.run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["blocks saved"] == "1" and metrics["held / all full"] == "11 / 12"
    captions = " ".join(c.value for c in at.caption)
    assert "**Hybrid model.** KV cache groups: window 48 (layers 0, 2), full (layers 1, 3), one pool. The sliding " \
           "windows gave back 1 block (16,384 bytes)" in captions
    assert "bytes saved" in captions and "No contiguous baseline" in " ".join(i.value for i in at.info)
    # the counts' unit and bytes (a block holds one group's layers), and the saving as the pool counts it
    helps = {m.label: m.help for m in at.metric}
    assert "in this pool's blocks of 16,384 bytes (a block holds one KV cache group's layers): 180,224 bytes " \
           "held, 196,608 with every layer full" in helps["held / all full"]
    assert "a pool count, all-full blocks minus blocks held, a block two requests share counted once" \
           in helps["blocks saved"] and "add up to more than the pool count" in helps["blocks saved"]
    assert "(blocks of 16,384 bytes, one KV cache group's layers each: 180,224 bytes held, 196,608 with every " \
           "layer full)." in captions


def test_an_empty_block_stored_is_a_sliding_groups_only(hybrid_records, make_engine):
    """A sliding group's BlockStored may cache none of its range (vLLM's block mask): read back in a hybrid
    trace, refused in a model of one full-attention group; token ids of part of a block refused in both."""
    empty = {"type": "BlockStored", "block_hashes": [], "parent_block_hash": None, "token_ids": list(range(B)),
             "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None}
    hybrid = hybrid_records[0].to_dict()
    hybrid["kv_events"] = [empty]
    assert StepRecord.from_dict(hybrid).kv_events == [empty]
    with pytest.raises(ValueError, match="kv_events.0"):
        StepRecord.from_dict({**hybrid, "kv_events": [{**empty, "token_ids": list(range(B - 1))}]})
    engine = make_engine(num_blocks=16)
    engine.add_request("Hello there", SamplingParams(max_tokens=2, temperature=0.0))
    single = engine.step().to_dict()
    single["kv_events"] = [empty]
    with pytest.raises(ValueError, match=r"kv_events\.0\.block_hashes"):
        StepRecord.from_dict(single)


# ------------------------------------------------------------------ the saving of a shared prefix (pool)
@pytest.fixture(scope="module")
def shared_prefix_records(loaded) -> list[StepRecord]:
    """Prefix caching on: R1 (70 prompt tokens) runs alone for a step, then R2 (R1's first 64 tokens and 6
    of its own) hits R1's 4 full blocks. The full group shares them; R2's sliding table needs only the last
    3 before the hit (vLLM's rule), so its block 0 is the null block, as R1's is once R1 passes the window."""
    ids = loaded[1](TEXT, add_special_tokens=False)["input_ids"]
    engine = LLMEngine(EngineConfig(model=HYBRID, device="cpu", dtype="float32", semantics="v1", block_size=B,
                                    num_blocks=40, enable_prefix_caching=True), loaded=loaded)
    engine.add_request(ids[:70], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    records = [engine.step()]
    engine.add_request(ids[:64] + ids[100:106], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        records.append(engine.step())
    return records


def test_a_shared_prefix_past_the_window_is_saved_once(shared_prefix_records):
    """The pool-level saving equals an independent count: the twin holds, in each of the 2 groups, the
    distinct blocks of the full-attention tables (the shared prefix once); the hybrid run holds the pool's
    blocks with a reference. The per-request sum counts the shared block 0 twice."""
    from engine.metrics import hybrid_saving

    shared_and_left = 0
    for rec in shared_prefix_records:
        snap = rec.snapshot
        live = [s for s in snap.sequences if s.status == "running"]
        twin = 2 * len({b for s in live for b in s.group_block_tables[1]})
        held = sum(c > 0 for c in snap.ref_counts)
        saving = hybrid_saving(snap)
        assert (saving["twin"], saving["held"], saving["blocks"]) == (twin, held, twin - held), rec.step
        if len(live) == 2 and all(s.group_block_tables[0][0] == -1 for s in live):
            r1, r2 = live
            assert r1.group_block_tables[1][:4] == r2.group_block_tables[1][:4]  # the prefix is shared
            assert sum(saving["by_sequence"].values()) > saving["blocks"]
            shared_and_left += 1
    assert shared_and_left, "no step where both requests ran with the shared block 0 out of their windows"


def test_the_twin_of_a_uniform_sliding_model_is_read_from_the_shared_blocks():
    """No full-attention group: two sequences sharing physical block 7 at logical block 2 share logical blocks
    0-2 in the twin (a block's hash chains from its prefix); a third shares nothing."""
    from types import SimpleNamespace as NS

    from engine.metrics import hybrid_saving

    seqs = [NS(seq_id="A", status="running", group_block_tables=[[-1, -1, 7, 8]]),
            NS(seq_id="B", status="running", group_block_tables=[[-1, -1, 7, 9]]),
            NS(seq_id="C", status="running", group_block_tables=[[-1, 3, 4]]),
            NS(seq_id="D", status="finished", group_block_tables=[[-1, 5]])]
    snap = NS(kv_cache_groups=[{"kind": "sliding_window", "sliding_window": 32, "layers": [0]}], sequences=seqs)
    saving = hybrid_saving(snap)
    # twin: blocks 0-2 once for A+B, 3 for A, 3 for B, 0-2 for C -> 3 + 2 + 3 = 8; held: 7, 8, 9, 3, 4
    assert (saving["twin"], saving["held"], saving["blocks"]) == (8, 5, 3)
    assert saving["by_sequence"] == {"A": 2, "B": 2, "C": 1}


def test_cli_paged_line_accounts_for_every_group(loaded, monkeypatch, capsys):
    """The CLI's paged accounting on hybrid-window: each group's blocks at the final lengths (R1 62 + 20 = 82
    tokens, R2 20 + 8 = 28), the sliding group fewer by the blocks its window gave back (the arithmetic at
    each request's last scheduled step), and the line names them all."""
    import json

    import engine.llm_engine as llm_engine
    from engine.cli import main
    from engine.metrics import blocks_for

    real = llm_engine.LLMEngine
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda config, given=None: real(config, loaded=given or loaded))
    assert main(["run", "--scenario", "hybrid-window", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["paged"]
    window, full = p["groups"]
    lengths = {"R1": 82, "R2": 28}
    assert full["kind"] == "full_attention" and full["blocks_allocated"] == p["blocks_allocated"] == \
        sum(blocks_for(n, B) for n in lengths.values()) == 8
    assert full["slots_used"] == p["slots_used"] == 110
    # R1's last step computed from position 80: (80 - 48 + 1) // 16 = 2 blocks left its window; R2 never passed it
    given = hybrid_blocks_saved(80, B, [48]) + hybrid_blocks_saved(26, B, [48])
    assert window["given_back"] == given == 2 and window["blocks_allocated"] == 8 - given
    assert window["slots_used"] == 110 - 2 * B
    assert p["all_groups"]["blocks_allocated"] == 14 and p["all_groups"]["slots_used"] == 110 + 78
    assert main(["run", "--scenario", "hybrid-window"]) == 0
    text = capsys.readouterr().out
    assert "paged, every KV cache group's tables at the final lengths: 14 blocks = 224 slots for 188 token slots" in text
    assert "window 48 (layers 0, 2): 6 blocks = 96 slots for 78 tokens, 2 given back by the window" in text
    assert "full (layers 1, 3): 8 blocks = 128 slots for 110 tokens" in text


def test_group_accounting_counts_a_shared_prefix_once(shared_prefix_records):
    """R1 and R2 (76 tokens each) share R1's first 4 full blocks: the full group holds 5 + 5 - 4 blocks."""
    from engine.cli import group_accounting
    from engine.metrics import blocks_for

    window, full = group_accounting(shared_prefix_records)
    assert full["blocks_allocated"] == 2 * blocks_for(76, B) - 4 == 6
    assert window["blocks_allocated"] + window["given_back"] == full["blocks_allocated"]  # R2's nulls are hit blocks


def test_pool_hatches_the_sliding_groups_blocks_with_a_key(left):
    """Without hover: the sliding group's cells carry a hatch pattern (one filled outline per block), the
    full group's stay plain, and the legend names both; a single-group pool has neither."""
    from viz.pool import block_pool_figure

    fig = block_pool_figure(left.snapshot, ORDER).to_dict()
    keys = [t for t in fig["data"] if t.get("meta", {}).get("role") == "kv_group"]
    assert [k["name"] for k in keys] == ["\u25a8 hatched: window 48 (layers 0, 2)",
                                         "\u25a0 plain: full attention (layers 1, 3)"]
    assert fig["layout"]["showlegend"] is True and keys[0]["fillpattern"]["shape"] == "/"
    held = [b for b in left.snapshot.sequences[0].group_block_tables[0] if b >= 0]
    assert keys[0]["x"].count(None) == len(held) == 3 and keys[1]["x"] == [None]


def test_presenter_gives_a_hybrid_run_the_lower_row_for_its_numbers():
    """With no contiguous strip the pool row takes what the numbers leave: room for the hybrid preset's four
    table rows at 1280x720 (the strip-sized row showed one request of two); the default is unchanged."""
    from viz.presenter import presenter_sizes

    words = ["decode step: 2 decode tokens (R1, R2)", "R1: 1 block [0] left the 48-token sliding window " * 3]
    nums = ["step 3 of 3", "**Paged**: 11/24 blocks in use", "**Hybrid**: windows gave back 1 block", "a note " * 25]
    before = presenter_sizes(720, 1280, words, nums)
    wide = presenter_sizes(720, 1280, words, nums, numbers_full_width=True)
    assert wide["pool"] >= 250 > before["pool"] and wide["strip"] < before["strip"]
    assert wide["chrome"] + wide["pool"] + wide["strip"] <= 720


def test_the_hybrid_line_says_a_shared_block_is_given_back_once(shared_prefix_records):
    from engine.metrics import hybrid_saving
    from viz.stage import hybrid_line

    rec = next(r for r in shared_prefix_records
               if sum(hybrid_saving(r.snapshot)["by_sequence"].values()) > hybrid_saving(r.snapshot)["blocks"])
    saving = hybrid_saving(rec.snapshot)
    line = hybrid_line(rec.snapshot)
    n = saving["blocks"]
    assert f"gave back {n} block{'s' * (n != 1)} (per request R1: " in line
    assert "a block they share is given back once in the pool" in line
    assert f"{saving['held']} blocks held where every layer full would hold {saving['twin']}" in line


def test_a_single_group_pool_has_no_group_key(make_engine):
    from viz.pool import block_pool_figure

    engine = make_engine(num_blocks=16)
    engine.add_request("Hello there", SamplingParams(max_tokens=2, temperature=0.0))
    fig = block_pool_figure(engine.step().snapshot, ["R1"]).to_dict()
    assert [t["type"] for t in fig["data"]] == ["heatmap"] and "showlegend" not in fig["layout"]
    assert fig["layout"]["margin"]["b"] == 10
