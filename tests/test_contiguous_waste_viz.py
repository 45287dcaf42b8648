"""The contiguous strip draws its three kinds of waste live, each in its own colour, with a legend that is
always there and reads its counts from engine.metrics."""

from __future__ import annotations

from engine import SamplingParams
from engine.contiguous import ContiguousAllocator
from engine.metrics import contiguous_waste_now
from viz import contiguous_region_figure, region_cells
from viz.colors import EXTERNAL, FREE, INTERNAL, PALETTE, RESERVED, SHARED, SLACK

KINDS = {"reserved_not_yet_used": RESERVED, "internal": INTERNAL, "external": EXTERNAL}


def slots(n: int) -> str:
    return f"{n:,} slot{'s' * (n != 1)}"


def legend(fig) -> list[str]:
    return [t.name for t in fig.data if t.showlegend]


def test_the_waste_colours_differ_from_each_other_requests_and_the_paged_slack():
    wastes = set(KINDS.values())
    assert len(wastes) == 3
    assert not wastes & ({SLACK, FREE, SHARED} | set(PALETTE))


def test_cells_per_colour_equal_the_metrics_at_every_step(make_engine, text_ids):
    """n samples and a single request, with the final lengths known (a later run's, as the lab learns
    them): at every step each waste colour covers exactly the slots engine.metrics counts."""
    engine = make_engine(block_size=4, num_blocks=64, max_model_len=64, allocator="contiguous")
    engine.add_request(text_ids[:9], SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=3, ignore_eos=True))
    engine.add_request(text_ids[:5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    records = []
    while engine.has_unfinished():
        records.append(engine.step())
    finals = {"R1.0": 19, "R1.1": 19, "R1.2": 19, "R2": 11}
    seen = {k: 0 for k in KINDS}
    for rec in records:
        layout = rec.snapshot.contiguous
        for known in (None, finals):
            cells = region_cells(layout, ["R1", "R2"], known)
            waste = contiguous_waste_now(layout, known)
            for key, color in KINDS.items():
                assert cells.count(color) == waste[key], (rec.step, key)
                seen[key] = max(seen[key], waste[key])
            fig = contiguous_region_figure(layout, ["R1", "R2"], known)
            assert legend(fig) == [f"reserved, not yet used: {slots(waste['reserved_not_yet_used'])}",
                                   f"internal fragmentation: {slots(waste['internal'])}",
                                   f"external fragmentation: {slots(waste['external'])}"]
            assert fig.layout.showlegend is True
    assert seen["reserved_not_yet_used"] > 0 and seen["internal"] > 0  # both kinds were really drawn
    # after the prefill: 3 rows of 64 for samples ending at 19 tokens, 64 for R2 ending at 11
    assert contiguous_waste_now(records[0].snapshot.contiguous, finals)["internal"] == 3 * (64 - 19) + (64 - 11)


def test_internal_fragmentation_past_the_known_final_length():
    alloc = ContiguousAllocator(capacity_tokens=128, reservation=64)
    alloc.allocate("R1", 10)
    layout = alloc.layout()
    assert contiguous_waste_now(layout) == {"reserved_not_yet_used": 54, "internal": 0, "external": 0}
    assert contiguous_waste_now(layout, {"R1": 20}) == {"reserved_not_yet_used": 10, "internal": 44, "external": 0}
    cells = region_cells(layout, ["R1"], {"R1": 20})
    assert cells[10:20] == [RESERVED] * 10 and cells[20:64] == [INTERNAL] * 44 and cells[64:] == [FREE] * 64


def test_spare_rows_are_reserved_not_yet_used():
    alloc = ContiguousAllocator(capacity_tokens=256, reservation=64)
    alloc.allocate("R1.0", 7, reservation=(64, 64, 64))
    layout = alloc.layout()
    assert [r.get("spare", False) for r in layout["regions"]] == [False, True, True]
    assert contiguous_waste_now(layout, {"R1.0": 20})["reserved_not_yet_used"] == 13 + 128
    assert region_cells(layout, ["R1"])[64:192] == [RESERVED] * 128


def test_external_fragmentation_drawn_and_in_the_legend_and_zero_kinds_listed():
    alloc = ContiguousAllocator(capacity_tokens=3000, reservation=1000)
    for name, size in (("A", 1000), ("B", 600), ("C", 1000)):
        alloc.allocate(name, 10, reservation=size)
    empty = contiguous_region_figure(alloc.layout(), ["A", "B", "C"])
    assert legend(empty)[1:] == ["internal fragmentation: 0 slots", "external fragmentation: 0 slots"]
    alloc.free("B")
    layout = alloc.layout()
    assert region_cells(layout, ["A", "B", "C"]).count(EXTERNAL) == 1000 == layout["external_frag_slots"]
    assert legend(contiguous_region_figure(layout, ["A", "B", "C"]))[2] == "external fragmentation: 1,000 slots"
