"""The contiguous-allocation baseline: a real engine mode, same outputs, its own kinds of waste."""

from __future__ import annotations

import json

import pytest

from engine import EngineConfig, SamplingParams
from engine.cli import main
from engine.contiguous import ContiguousAllocator

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_contiguous_outputs_equal_paged_on_a_mixed_batch(make_engine, text_ids):
    prompts = [text_ids[:n] for n in (1, 7, 16, 23, 40)]
    paged = make_engine(block_size=4, num_blocks=64, max_model_len=64)
    contiguous = make_engine(block_size=4, num_blocks=64, max_model_len=64, allocator="contiguous")
    assert contiguous.kv_cache.nbytes == paged.kv_cache.nbytes  # same byte budget
    a = paged.generate(prompts, GREEDY)
    b = contiguous.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in b] == [o.output_token_ids for o in a]
    assert contiguous.block_manager.free_slots == 256


def test_lesson_lengths_reproduce_the_lesson(capsys):
    assert main(["run", "--scenario", "lesson-lengths", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c, p = out["contiguous"], out["paged"]
    assert (c["reserved_slots"], c["used_slots"], round(c["waste_pct"], 1)) == (16384, 5126, 68.7)
    assert (p["blocks_allocated"], p["slots_allocated"], round(p["waste_pct"], 1)) == (325, 5200, 1.4)
    lengths = sorted(len(r["prompt_token_ids"]) + len(r["output_token_ids"]) for r in out["requests"])
    assert lengths == sorted([853, 581, 631, 812, 541, 709, 758, 241])
    assert c["internal_frag_slots"] == 16384 - 5126


def test_chat_workload_contiguous_queues_while_paged_admits_more(capsys):
    assert main(["run", "--scenario", "chat-workload", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c, p = out["contiguous"], out["paged"]
    assert c["peak_concurrency"] == 2048 // 512  # four reservations fill the region
    assert p["peak_concurrency"] > 2 * c["peak_concurrency"]
    assert c["queued_at_door"] > 0
    assert p["kv_utilization"] > 90 > 40 > c["kv_utilization"]
    assert p["steps"] < c["steps"]


def test_external_fragmentation_is_named():
    """Reservations A (1,000 slots), B (600), C (1,000) fill a region; B finishes; a request needing 1,000
    slots waits although 1,000 slots are free in total: they sit in gaps too small for it."""
    alloc = ContiguousAllocator(capacity_tokens=3000, reservation=1000)
    alloc.allocate("A", 10)
    alloc.allocate("B", 10, reservation=600)
    alloc.allocate("C", 10)
    assert alloc.gaps() == [(2600, 400)]
    alloc.free("B")
    assert alloc.gaps() == [(1000, 600), (2600, 400)]
    assert alloc.free_slots == 1000
    assert alloc.admission_refusal([[0]]) == "refused: largest gap 600 < 1,000 needed, 1,000 free in total"
    assert alloc.external_frag_slots == 1000  # every free slot is external fragmentation
    with pytest.raises(RuntimeError, match="largest gap 600"):
        alloc.allocate("D", 10)
    assert alloc.gaps() == [(1000, 600), (2600, 400)]  # the refusal changed nothing
    assert alloc.internal_frag_slots == 600 - 10  # B used 10 of its 600


def test_request_waits_at_the_door_with_the_reason(make_engine, text_ids):
    # region of 160 slots, reservations of 64: two fit; the 32-slot tail is too small, and it is no external
    # fragmentation (32 free slots in total could not hold a reservation anyway)
    engine = make_engine(block_size=4, num_blocks=40, max_model_len=64, allocator="contiguous",
                         reservation_tokens=64)
    for n in (5, 6, 7):
        engine.add_request(text_ids[:n], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    rec = engine.step()
    waits = [e for e in rec.events if e.kind == "wait"]
    assert [e.request_id for e in waits] == ["R3"]
    assert waits[0].message == "R3 waits at the door: refused: largest gap 32 < 64 needed, 32 free in total"
    layout = rec.snapshot.contiguous
    assert [(r["start"], r["length"]) for r in layout["regions"]] == [(0, 64), (64, 64)]
    assert layout["external_frag_slots"] == 0
    assert layout["reserved_unused_slots"] == 128 - layout["used_slots"]
    while engine.has_unfinished():
        engine.step()
    # at final lengths (prompt + 6 generated): the one definition the CLI and the Playground share
    assert engine.block_manager.internal_frag_slots == 3 * 64 - sum(n + 6 for n in (5, 6, 7))


@pytest.mark.parametrize("kwargs, named", [
    ({"reservation_tokens": 0}, "reservation_tokens .*0"),
    ({"reservation_tokens": -5}, "reservation_tokens .*-5"),
    ({"allocator": "buddy"}, "allocator .*'buddy'"),
])
def test_bad_contiguous_config(kwargs, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(**kwargs)


def test_reservation_larger_than_the_region(make_engine):
    with pytest.raises(ValueError, match="reservation_tokens 100 is larger than the region of 64 slots"):
        make_engine(block_size=4, num_blocks=16, max_model_len=64, allocator="contiguous", reservation_tokens=100)


def test_contiguous_serves_parallel_sampling_with_a_row_per_sample(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=64, allocator="contiguous", max_model_len=64)
    engine.add_request(text_ids[:5], SamplingParams(n=2, max_tokens=3))
    rec = engine.step()
    assert [(r["seq_id"], r["start"]) for r in rec.snapshot.contiguous["regions"]] == [("R1.0", 0), ("R1.1", 64)]


def test_free_slots_too_few_for_a_reservation_are_not_external_fragmentation():
    alloc = ContiguousAllocator(capacity_tokens=160, reservation=64)
    alloc.allocate("A", 5)
    alloc.allocate("B", 5)
    assert alloc.gaps() == [(128, 32)] and alloc.external_frag_slots == 0  # simply full
    alloc.free("A")
    assert alloc.external_frag(need=96) == 64 + 32  # 96 free in two gaps of 64 and 32: fragmented
