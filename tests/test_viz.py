"""Figure builders are pure functions of snapshots: tested on hand-made snapshots, without torch."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace as NS

from viz import (block_pool_figure, block_table_rows, contiguous_region_figure, paged_slot_cells, pool_cells,
                 region_cells)
from viz.colors import CACHED_FREE, EXTERNAL, FREE, INTERNAL, RESERVED, SHARED, SLACK, request_color


def snapshot():
    """8 blocks of 4: A owns 0, 7 is shared by A and B (count 2), 3 is B's partly filled block, 5 is free
    but cached, the rest free."""
    seqs = [NS(seq_id="A", status="running", block_table=[0, 7], group_block_tables=[], token_ids=[1, 2, 3, 4, 5, 6], prompt_len=6,
               num_tokens=6),
            NS(seq_id="B", status="running", block_table=[7, 3], group_block_tables=[], token_ids=[5, 6, 7, 8, 9], prompt_len=5,
               num_tokens=5)]
    owners = [["A"], [], [], ["B"], [], [], [], ["A", "B"]]
    return NS(num_blocks=8, block_size=4, num_free_blocks=5, ref_counts=[1, 0, 0, 1, 0, 0, 0, 2],
              fills=[4, 0, 0, 1, 0, 3, 0, 2], owners=owners, sequences=seqs,
              block_hashes=[None, None, None, None, None, "abc123", None, None])


def test_cells_say_count_owners_fill_and_cache():
    cells = pool_cells(snapshot(), ["A", "B"], decode=lambda ids: "|".join(map(str, ids)))
    seven = cells[7]
    assert seven["ref_count"] == 2 and seven["owners"] == ["A", "B"]
    assert seven["color"] == SHARED and seven["label"] == "7: x2<br>2/4"
    assert cells[0]["label"] == "0: A<br>4/4" and cells[0]["color"] == request_color("A", ["A", "B"])
    assert cells[0]["text"] == "1|2|3|4"  # the tokens block 0 holds
    assert cells[5]["color"] == CACHED_FREE and cells[5]["hash"] == "abc123"
    assert cells[6]["color"] == FREE and cells[6]["label"] == "6"


def test_pool_figure_is_one_heatmap_with_outlined_highlights():
    fig = block_pool_figure(snapshot(), ["A", "B"], highlight=[3], selected="A")
    assert [t.type for t in fig.data] == ["heatmap"]
    frames = {}
    for shape in fig.layout.shapes:
        frames.setdefault(shape.line.color, []).append(shape)
    assert sorted(len(v) for v in frames.values()) == [1, 2]  # block 3 changed this step; A's blocks 0 and 7
    assert "#000000" in frames and len(frames["#000000"]) == 1


def test_slot_mode_has_one_cell_per_slot():
    fig = block_pool_figure(snapshot(), ["A", "B"], slot_mode=True, highlight=[3])
    z = fig.data[0].z
    assert len(z) == 8 and all(len(row) == 4 for row in z)
    assert z[3][0] != z[3][1]  # block 3 holds one token: its first slot is coloured, the rest are free
    labels = list(fig.layout.yaxis.ticktext)
    assert labels[7] == "block 7: A,B x2" and labels[3] == "block 3: B" and labels[5] == "block 5: cached"
    frames = [sh for sh in fig.layout.shapes if sh.type == "rect"]
    assert len(frames) == 1 and frames[0].y0 == 2.5  # the changed block's row is framed


def test_a_swapped_sequence_row_names_cpu_blocks():
    snap = snapshot()
    snap.sequences.append(NS(seq_id="C", status="swapped", block_table=[0, 1], group_block_tables=[], token_ids=[1] * 7, prompt_len=5,
                             num_tokens=7))
    row = block_table_rows(snap)[-1]
    assert row["block table (logical -> physical)"] == "0->cpu0 1->cpu1"
    assert row["tokens in pool"] == 0 and "CPU swap pool" in row["status"]


def test_paged_slots_show_last_block_slack():
    slots = paged_slot_cells(snapshot(), ["A", "B"])
    assert len(slots) == 32
    assert slots[12] == request_color("B", ["A", "B"]) and slots[13:16] == [SLACK] * 3
    assert slots[28:30] == [SHARED] * 2 and slots[30:32] == [SLACK] * 2


def test_contiguous_strip_shows_the_external_fragmentation_gap():
    layout = {"capacity_slots": 30, "reservation": 10,
              "regions": [{"seq_id": "R1", "start": 0, "length": 10, "used": 4},
                          {"seq_id": "R2", "start": 16, "length": 10, "used": 10}],
              "gaps": [{"start": 10, "length": 6}, {"start": 26, "length": 4}],
              "used_slots": 14, "reserved_unused_slots": 6, "internal_frag_slots": 0, "external_frag_slots": 10}
    slots = region_cells(layout, ["R1", "R2"])
    # R1's unused slots are reserved, not yet used: purple, not the paged side's slack grey
    assert slots[:4] == [request_color("R1", ["R1", "R2"])] * 4 and slots[4:10] == [RESERVED] * 6
    assert RESERVED != SLACK
    assert slots[10:16] == [EXTERNAL] * 6 and slots[26:30] == [EXTERNAL] * 4
    assert _legend(contiguous_region_figure(layout, ["R1", "R2"])) == [
        "reserved, not yet used: 6 slots", "internal fragmentation: 0 slots", "external fragmentation: 10 slots"]
    # with the final lengths known, R1's unused slots split into not-yet-used (up to 7) and internal
    split = region_cells(layout, ["R1", "R2"], final_lengths={"R1": 7})
    assert split[4:7] == [RESERVED] * 3 and split[7:10] == [INTERNAL] * 3
    assert _legend(contiguous_region_figure(layout, ["R1", "R2"], {"R1": 7})) == [
        "reserved, not yet used: 3 slots", "internal fragmentation: 3 slots", "external fragmentation: 10 slots"]


def _legend(fig) -> list[str]:
    """The names of a figure's legend entries, in order."""
    return [t.name for t in fig.data if t.showlegend]


def test_viz_does_not_import_torch():
    code = "import sys, viz; assert 'torch' not in sys.modules, 'viz imported torch'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_swap_strip_colours_the_swapped_request():
    from viz import swap_pool_figure

    seq = NS(seq_id="R2", status="swapped", block_table=[1, 2], token_ids=[1] * 5, prompt_len=5, num_tokens=5)
    snap = NS(num_swap_blocks=4, num_free_swap_blocks=2, sequences=[seq])
    fig = swap_pool_figure(snap, ["R1", "R2"])
    z = fig.data[0].z[0]
    assert z[1] == z[2] != z[0] == z[3]
    assert "2/4 blocks in use" in fig.layout.title.text


def test_a_full_region_shows_no_external_fragmentation():
    """32 free slots that could not hold a 64-slot reservation even together: the region is full, not
    fragmented, so nothing is drawn orange."""
    layout = {"capacity_slots": 160, "reservation": 64,
              "regions": [{"seq_id": "R1", "start": 0, "length": 64, "used": 5},
                          {"seq_id": "R2", "start": 64, "length": 64, "used": 6}],
              "gaps": [{"start": 128, "length": 32}],
              "used_slots": 11, "reserved_unused_slots": 117, "internal_frag_slots": 0, "external_frag_slots": 0}
    assert EXTERNAL not in region_cells(layout, ["R1", "R2"])
    assert region_cells(layout, ["R1", "R2"])[128:] == [FREE] * 32


def test_figures_read_engine_metrics_without_torch():
    """Drawing the strips and the timeline from real (hand-made) records reads engine.metrics, never torch;
    the titles show metrics' slack and the utilisation line is metrics.utilization_pct."""
    code = """
import sys
from engine import metrics
from engine.records import Snapshot, StepRecord
from viz import contiguous_region_figure, paged_slots_figure, timeline_figure

paged = Snapshot(num_blocks=4, block_size=4, num_free_blocks=2, ref_counts=[1, 1, 0, 0], fills=[4, 1, 0, 0],
                 owners=[["R1"], ["R1"], [], []], sequences=[], waiting=[], running=["R1"])
layout = {"capacity_slots": 16, "reservation": 8, "regions": [{"seq_id": "R1", "start": 0, "length": 8, "used": 5}],
          "gaps": [{"start": 8, "length": 8}], "used_slots": 5, "reserved_unused_slots": 3,
          "internal_frag_slots": 0, "external_frag_slots": 0}
contiguous = Snapshot(num_blocks=16, block_size=1, num_free_blocks=8, ref_counts=[], fills=[], owners=[],
                      sequences=[], waiting=[], running=["R1"], allocator="contiguous", contiguous=layout)
assert f"({metrics.slack_pct(paged):.1f}% last-block slack)" in paged_slots_figure(paged, ["R1"]).layout.title.text
assert "5 used / 8 reserved (37.5% unused)" in contiguous_region_figure(layout, ["R1"]).layout.title.text
records = [StepRecord(1, "decode", [], [], {}, {}, [], s) for s in (paged, contiguous)]
fig = timeline_figure({"paged": records[:1], "contiguous": records[1:]})
assert [t.y[0] for t in fig.data if t.xaxis == "x"] == [metrics.utilization_pct(paged), metrics.utilization_pct(contiguous)]
assert "torch" not in sys.modules, "a figure imported torch"
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def mixed_record():
    """A V1 mixed step: R1-R3 decode one token each, R4's prompt of 300 tokens gets a 64-token chunk at
    positions 128-191 (nothing sampled), R5 finishes its prompt (positions 32-39 of 40, after a prefix-cache
    hit of 32) and samples its first token."""
    seqs = [NS(seq_id=f"R{i}", prompt_len=10, token_ids=[0] * 14) for i in (1, 2, 3)]
    seqs += [NS(seq_id="R4", prompt_len=300, token_ids=[0] * 300), NS(seq_id="R5", prompt_len=40, token_ids=[0] * 41)]
    scheduled = [NS(seq_id=f"R{i}", request_id=f"R{i}", num_tokens=1, start_pos=13) for i in (1, 2, 3)]
    scheduled += [NS(seq_id="R4", request_id="R4", num_tokens=64, start_pos=128),
                  NS(seq_id="R5", request_id="R5", num_tokens=8, start_pos=32)]
    events = [NS(kind="allocate", request_id="R5", data={"num_tokens": 40, "cached_tokens": 32}),
              NS(kind="allocate", request_id="R4", data={"num_tokens": 192, "cached_tokens": 0})]
    return NS(step=7, kind="mixed", scheduled=scheduled, events=events, snapshot=NS(sequences=seqs),
              new_tokens={"R1": 5, "R2": 5, "R3": 5, "R5": 5}, semantics="v1")


def test_a_mixed_step_is_described_by_its_parts():
    from viz import describe_step, step_label

    text = describe_step(mixed_record(), budget=2048)
    assert text == ("mixed step: 3 decode tokens (R1-R3) + a 64-token prefill chunk of R4 (positions 128-191 of 300, "
                    "108 more in later steps) + an 8-token prefill of R5 (positions 32-39 of 40; positions 0-31 from "
                    "the prefix cache); 75 of the 2,048-token budget")
    assert step_label(mixed_record()) == "mixed: 3 decode tokens + 2 prefill chunks (72 tokens)"
    rec = mixed_record()
    rec.scheduled[3].start_pos, rec.events = 236, []  # R4's last chunk: positions 236-299
    assert "the last 64-token prefill chunk of R4 (positions 236-299 of 300)" in describe_step(rec)


def test_step_tokens_figure_stacks_decode_and_prefill_tokens_with_the_budget():
    from viz import step_tokens_figure

    decode_only = mixed_record()
    decode_only.step, decode_only.kind, decode_only.scheduled = 8, "decode", decode_only.scheduled[:3]
    fig = step_tokens_figure([mixed_record(), decode_only], budget=128, semantics="v1")
    bars = {t.name: list(t.y) for t in fig.data}
    assert bars == {"decode tokens": [3, 3], "prefill tokens (chunks too)": [72, 0]}
    assert fig.layout.barmode == "stack" and "vLLM V1" in fig.layout.title.text
    assert [s.y0 for s in fig.layout.shapes] == [128]  # the budget line
    assert "mixed: 3 decode tokens" in fig.data[0].customdata[0]
    # a budget far above every step (V1's default 2,048 against 75 tokens) would flatten the bars into the
    # axis: the title names it instead of a line
    far = step_tokens_figure([mixed_record(), decode_only], budget=2048, semantics="v1")
    assert not far.layout.shapes and "token budget 2,048 per step, far above every step" in far.layout.title.text


def test_colour_key_names_the_contiguous_wastes_apart_from_the_paged_slack():
    from viz.colors import colour_key

    snap = NS(ref_counts=[1, 0], block_hashes=None)
    layout = {"external_frag_slots": 0}
    with_strip = colour_key(snap, layout, strips=True)
    assert "light grey paged strip cells = last-block slack" in with_strip
    assert "contiguous strip: pale purple = reserved, not yet used" in with_strip
    assert "dark brown = internal fragmentation" in with_strip and "reserved but not used" not in with_strip
    assert "orange" not in with_strip  # no external fragmentation now
    assert "orange = external fragmentation" in colour_key(snap, {"external_frag_slots": 3}, strips=True)
    paged_only = colour_key(snap, None, strips=True)
    assert "last-block slack" in paged_only and "purple" not in paged_only and "brown" not in paged_only
