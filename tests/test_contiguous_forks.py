"""The contiguous baseline runs n samples and beam search: a row per sequence, a fork copies.

Paging never changes what the model computes, and neither does its absence: the contiguous engine gives the
paged engine's tokens for seeded samples and for beams, while its region holds n separate copies of the
prompt (the fork copied the parent's K/V slot by slot) and beams that reorder copy whole rows.
"""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.contiguous import ContiguousAllocator
from engine.scenarios.workloads import Workload, WorkloadRequest, learn_final_lengths, run_workload
from tests.conftest import capture_logits

SAMPLES = SamplingParams(n=3, max_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
BEAMS = SamplingParams(beam_width=3, max_tokens=8, temperature=0.0)


def engines(make_engine, **kw):
    paged = make_engine(block_size=4, num_blocks=64, max_model_len=64, **kw)
    contiguous = make_engine(block_size=4, num_blocks=64, max_model_len=64, allocator="contiguous", **kw)
    return paged, contiguous


def test_parallel_sampling_equals_paged_and_holds_n_prompt_copies(make_engine, text_ids):
    paged, contiguous = engines(make_engine)
    prompt = text_ids[:9]
    want = paged.generate(prompt, SAMPLES)[0]
    rid = contiguous.add_request(prompt, SAMPLES)
    records = [contiguous.step()]  # the prefill: R1.0 computes the prompt, R1.1 and R1.2 are forked
    forks = [e for e in records[0].events if e.kind == "fork"]
    assert [(e.request_id, e.data["parent"]) for e in forks] == [("R1.1", "R1.0"), ("R1.2", "R1.0")]
    assert "copied R1.0's 9 written slots (0..8) into its own reservation at 64..127" in forks[0].message
    layout = records[0].snapshot.contiguous
    rows = {r["seq_id"]: r for r in layout["regions"]}
    assert [(rows[s]["start"], rows[s]["length"]) for s in ("R1.0", "R1.1", "R1.2")] == [(0, 64), (64, 64), (128, 64)]
    # the copy is queued for the next step, which applies it before computing anything
    ops = contiguous.block_manager.pending_ops
    assert [op for _, op in ops][:2] == [("copy", 0, 64), ("copy", 1, 65)] and len(ops) == 2 * 9
    records.append(contiguous.step())
    # n copies of the prompt: every row's first prompt_len slots hold the prompt's K/V, equal to the parent's
    kc = contiguous.kv_cache.key_cache[0].view(-1, *contiguous.kv_cache.key_cache[0].shape[2:])
    vc = contiguous.kv_cache.value_cache[-1].view(-1, *contiguous.kv_cache.value_cache[-1].shape[2:])
    for start in (64, 128):
        assert torch.equal(kc[start:start + 9], kc[0:9]) and torch.equal(vc[start:start + 9], vc[0:9])
    assert kc[0:9].abs().sum() > 0
    seqs = {s.seq_id: s for s in records[-1].snapshot.sequences}
    assert all(seqs[s].token_ids[:9] == prompt for s in ("R1.0", "R1.1", "R1.2"))
    while contiguous.has_unfinished():
        contiguous.step()
    got = contiguous.get_output(rid)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert len({tuple(c.token_ids) for c in got.outputs}) > 1  # the samples really differ
    alloc = contiguous.block_manager
    assert alloc.regions == {} and alloc.spares == {} and alloc.free_slots == 256
    assert alloc.internal_frag_slots == 3 * 64 - 3 * (9 + 10)


def test_the_fork_copy_is_what_the_child_reads(make_engine, text_ids):
    """Without the copy, a child's attention would read an empty row: its logits are the parent's only
    because the fork moved the K/V."""
    _, contiguous = engines(make_engine)
    seen = capture_logits(contiguous)
    contiguous.add_request(text_ids[:9], SamplingParams(n=2, max_tokens=3, temperature=0.0, ignore_eos=True))
    while contiguous.has_unfinished():
        contiguous.step()
    # greedy: both samples take the same tokens, so every step the child's logits equal the parent's
    assert len(seen["R1.1"]) == 2
    for a, b in zip(seen["R1.0"][1:], seen["R1.1"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_beam_search_equals_paged_and_reorders_by_whole_row_copies(make_engine, text_ids):
    paged, contiguous = engines(make_engine)
    prompt = text_ids[:11]
    want = paged.generate(prompt, BEAMS)[0]
    records = []
    got = contiguous.generate(prompt, BEAMS, on_step=records.append)[0]
    assert [(c.token_ids, c.finish_reason) for c in got.outputs] == [(c.token_ids, c.finish_reason)
                                                                      for c in want.outputs]
    assert [c.score for c in got.outputs] == pytest.approx([c.score for c in want.outputs])
    first = records[0].snapshot.contiguous  # admission reserved the 3 rows at once
    assert sorted((r["start"], r["length"]) for r in first["regions"]) == [(0, 64), (64, 64), (128, 64)]
    handovers = [e for r in records for e in r.events if e.kind == "free" and "passes to" in e.message]
    assert handovers, "a pruned beam's row passes to a new fork"
    forks = [e for r in records for e in r.events if e.kind == "fork"]
    later = [e for e in forks if "(0..10)" not in e.message]  # forks after the first step copy whole rows
    assert later and all("written slots" in e.message for e in later)
    for r in records:  # the request keeps its 3 rows, never more, until it ends
        rows = r.snapshot.contiguous["regions"]
        assert len(rows) in (0, 3) and {x["start"] for x in rows} <= {0, 64, 128}
    assert contiguous.block_manager.free_slots == 256


def test_admission_reserves_every_row_or_waits(make_engine, text_ids):
    """Region of 160 slots, reservations of 64: a request with 2 samples needs 2 rows; while R1 holds one,
    96 slots are free: it waits at the door with the reason, then is admitted whole."""
    engine = make_engine(block_size=4, num_blocks=40, max_model_len=64, allocator="contiguous",
                         reservation_tokens=64)
    engine.add_request(text_ids[:5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.add_request(text_ids[:6], SamplingParams(n=2, max_tokens=4, temperature=0.0, ignore_eos=True))
    rec = engine.step()
    waits = [e.message for e in rec.events if e.kind == "wait"]
    assert waits == ["R2 waits at the door: refused: 2 rows of 64 slots (one per sample or beam, 128 in all) "
                     "do not all fit: largest gap 96, 96 free in total"]
    assert rec.snapshot.contiguous["external_frag_slots"] == 0  # 96 < 128: simply full, not fragmented
    records = []
    while engine.has_unfinished():
        records.append(engine.step())
    admitted = next(r for r in records if any(e.kind == "admit" for e in r.events))
    assert sorted((x["start"], x["length"], x.get("spare", False)) for x in
                  admitted.snapshot.contiguous["regions"]) == [(0, 64, False), (64, 64, False)]


def test_rows_are_all_or_nothing():
    alloc = ContiguousAllocator(capacity_tokens=200, reservation=64)
    alloc.allocate("A", 5)
    assert alloc.admission_refusal([[0]], (64, 64)) is None  # 136 free in one gap: two rows fit
    refusal = alloc.admission_refusal([[0]], (64, 64, 64))
    assert refusal == ("refused: 3 rows of 64 slots (one per sample or beam, 192 in all) do not all fit: "
                       "largest gap 136, 136 free in total")
    with pytest.raises(RuntimeError, match="3 rows of 64"):
        alloc.allocate("B.0", 5, reservation=(64, 64, 64))
    assert alloc.gaps() == [(64, 136)]  # the refusal changed nothing
    alloc.allocate("B.0", 5, reservation=(64, 64))
    assert alloc.spares == {"B.0": [(128, 64)]} and alloc.reserved_slots == 192
    assert alloc.layout()["reserved_unused_slots"] == 192 - 10  # the spare row is reserved, not yet used
    alloc.fork("B.0", "B.1")
    assert alloc.regions["B.1"] == (128, 64) and alloc.drain_ops() == [("copy", 64 + i, 128 + i) for i in range(5)]


def test_pruned_row_passes_to_the_waiting_fork():
    alloc = ContiguousAllocator(capacity_tokens=256, reservation=64)
    alloc.allocate("R1.b0", 4, reservation=(64, 64))
    alloc.fork("R1.b0", "R1.b1")
    alloc.drain_ops()
    alloc.append_slot("R1.b0")
    alloc.append_slot("R1.b1")
    alloc.fork("R1.b0", "R1.b2")  # b0 continues twice, b1 nobody: no spare row left, b2 waits for b1's
    assert alloc.pending == {"R1.b2": "R1.b0"}
    alloc.free("R1.b1", final_len=5)
    assert alloc.regions["R1.b2"] == (64, 64) and alloc.num_tokens["R1.b2"] == 5
    assert alloc.drain_ops() == [("copy", i, 64 + i) for i in range(5)]  # b0's whole row
    assert alloc.finished == []  # the row was never released: no internal fragmentation counted
    alloc.free("R1.b0", final_len=5)
    alloc.free("R1.b2", final_len=5)
    assert alloc.finished == [(64, 5), (64, 5)] and alloc.free_slots == 256


def test_a_fork_freed_before_its_copy_runs_drops_the_copy():
    alloc = ContiguousAllocator(capacity_tokens=256, reservation=64)
    alloc.allocate("R1.0", 4, reservation=(64, 64))
    alloc.fork("R1.0", "R1.1")
    alloc.free("R1.1", final_len=5)
    assert alloc.drain_ops() == []


def test_unused_spare_rows_are_internal_fragmentation():
    alloc = ContiguousAllocator(capacity_tokens=256, reservation=64)
    alloc.allocate("R1.b0", 4, reservation=(64, 64, 64))
    alloc.free("R1.b0", final_len=5)  # the search ended before any fork
    assert alloc.finished == [(64, 5), (64, 0), (64, 0)] and alloc.internal_frag_slots == 59 + 128
    assert alloc.free_slots == 256


def test_n_rows_larger_than_the_region_are_refused(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=40, max_model_len=64, allocator="contiguous")
    with pytest.raises(ValueError, match=r"n=3 samples reserve 3 x 64 slots but the region holds 160"):
        engine.add_request(text_ids[:5], SamplingParams(n=3))


def test_contiguous_fork_events_carry_the_row_and_the_copy_and_read_back(make_engine, text_ids, tmp_path):
    """A fork on the baseline says where the child's row is and how many of the parent's slots it copied
    (``EVENT_DATA``), and traces of n samples and beams on the baseline read back equal."""
    from engine.records import EVENT_DATA, read_trace, write_trace

    _, contiguous = engines(make_engine)
    for prompt, params in ((text_ids[:9], SAMPLES), (text_ids[:11], BEAMS)):
        records = []
        contiguous.generate(prompt, params, on_step=records.append)
        forks = [e for r in records for e in r.events if e.kind == "fork"]
        assert forks
        for record in records:
            rows = {r["seq_id"]: r for r in record.snapshot.contiguous["regions"] if not r.get("spare")}
            for e in (e for e in record.events if e.kind == "fork"):
                assert set(e.data) == set(EVENT_DATA["fork"]) == {"parent", "start", "length", "copied"}
                # the parent's written slots at the fork: the prompt, plus one slot per beam step before it
                assert e.data["copied"] >= len(prompt) and f"{e.data['copied']:,} written slots" in e.message
                end = e.data["start"] + e.data["length"] - 1
                assert f"into its own reservation at {e.data['start']:,}..{end:,}" in e.message
                if e.request_id in rows:  # a child that lives to the snapshot holds that row
                    assert (rows[e.request_id]["start"], rows[e.request_id]["length"]) == (
                        e.data["start"], e.data["length"])
        path = tmp_path / f"{params.num_seqs}.jsonl"
        write_trace(records, path)
        assert list(read_trace(path)) == records


def _oracle_run(make_engine, workload, finals):
    engine = make_engine(block_size=4, num_blocks=64, max_model_len=64, allocator="contiguous",
                         contiguous_policy="oracle")
    return run_workload(engine, workload, final_lens=finals)


def test_oracle_rows_hold_the_longest_sample(make_engine, text_ids):
    """n=4 samples stopping at "," after 9, 7, 18 and 11 tokens: the oracle learns the longest (18), so every
    row holds it and the baseline gives the paged engine's tokens; a row sized for the first sample (9)
    would cut the longer ones off at "length"."""
    params = SamplingParams(n=4, max_tokens=30, temperature=1.0, seed=0, stop_token_ids=[12])
    workload = Workload("samples", 0, [WorkloadRequest(0, text_ids[:9], params)])
    paged = make_engine(block_size=4, num_blocks=64, max_model_len=64)
    want = run_workload(paged, workload)[0]
    lengths = [len(c.token_ids) for c in want.outputs]
    assert lengths[0] < max(lengths) and {c.finish_reason for c in want.outputs} == {"stop"}  # the case to learn
    assert learn_final_lengths([want]) == [9 + max(lengths)]
    got = _oracle_run(make_engine, workload, learn_final_lengths([want]))[0]
    assert [(c.token_ids, c.finish_reason) for c in got.outputs] == [(c.token_ids, c.finish_reason)
                                                                      for c in want.outputs]
    first_only = _oracle_run(make_engine, workload, [9 + lengths[0]])[0]  # the old rule: outputs[0]
    assert [c.token_ids for c in first_only.outputs] != [c.token_ids for c in want.outputs]


def test_oracle_rows_hold_the_beam_searchs_depth_learnt_from_the_records(make_engine, text_ids):
    """Beam search stopping at ".": the best hypotheses are at most 6 tokens long, but the search ran on to
    14 tokens before no live beam could win. Only the records show that depth; with it the baseline repeats
    the paged run, with the outputs alone its rows are too short and the search ends early."""
    params = SamplingParams(beam_width=3, max_tokens=20, temperature=0.0, stop_token_ids=[14])
    workload = Workload("beams", 0, [WorkloadRequest(0, text_ids[:5], params)])
    paged = make_engine(block_size=4, num_blocks=64, max_model_len=64)
    records = []
    want = run_workload(paged, workload, on_step=records.append)[0]
    assert max(len(c.token_ids) for c in want.outputs) == 6
    assert learn_final_lengths([want]) == [5 + 6]
    assert learn_final_lengths([want], records) == [5 + 14]
    got = _oracle_run(make_engine, workload, learn_final_lengths([want], records))[0]
    assert [(c.token_ids, c.finish_reason) for c in got.outputs] == [(c.token_ids, c.finish_reason)
                                                                      for c in want.outputs]
    early = _oracle_run(make_engine, workload, learn_final_lengths([want]))[0]
    assert [c.token_ids for c in early.outputs] != [c.token_ids for c in want.outputs]


def test_learnt_lengths_from_records_equal_the_outputs_for_single_sequences_and_samples(make_engine, text_ids):
    """The records' depth adds nothing where the outputs already hold the longest sequence."""
    workload = Workload("mixed", 0, [WorkloadRequest(0, text_ids[:7], SamplingParams(max_tokens=5, temperature=0.0)),
                                     WorkloadRequest(1, text_ids[:9], SamplingParams(n=3, max_tokens=6, seed=3))])
    records = []
    outputs = run_workload(make_engine(block_size=4, num_blocks=64, max_model_len=64), workload,
                           on_step=records.append)
    assert learn_final_lengths(outputs, records) == learn_final_lengths(outputs) == [7 + 5, 9 + 6]
