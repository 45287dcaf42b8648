"""The paged engine's allocation on the real model: on-demand blocks, exact block counts, nothing leaked."""

from __future__ import annotations

import pytest

from engine import SamplingParams
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_count_new_block_timing_and_release(block_size, make_engine, text_ids):
    engine = make_engine(block_size=block_size, num_blocks=512 // block_size + 8, enable_prefix_caching=False)
    lengths = (1, 5, 17, 31)
    for i, n in enumerate(lengths):
        engine.add_request(text_ids[:n], SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        rec = engine.step()
        steps += 1
        snap = rec.snapshot
        running = [r for r in snap.sequences if r.status == "running"]
        # every block in use belongs to a running request and each holds ceil(tokens / B) blocks
        assert snap.num_used_blocks == sum(-(-r.num_tokens // block_size) for r in running)
        for r in running:
            assert len(r.block_table) == -(-r.num_tokens // block_size)
        if rec.kind == "decode":
            new_block = {e.request_id: e.data["position"] for e in rec.events if e.kind == "new_block"}
            for s in rec.scheduled:
                # a decode step writes token index s.start_pos; it takes a block exactly when that is k*B
                assert (s.seq_id in new_block) == (s.start_pos % block_size == 0), (rec.step, s)
                if s.seq_id in new_block:
                    assert new_block[s.seq_id] == s.start_pos
        if rec.kind == "prefill":
            for e in rec.events:
                if e.kind == "allocate":
                    assert len(e.blocks) == -(-e.data["num_tokens"] // block_size)
    assert steps == 1 + 18  # one prefill (first token of each), then a decode step per token of the longest
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert all(c == 0 for c in engine.block_manager.ref_counts)
    outs = [engine.get_output(r) for r in engine.requests]
    assert [len(o.output_token_ids) for o in outs] == [10, 13, 16, 19]


def test_finished_request_frees_its_blocks_in_the_same_step(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=32)
    short = engine.add_request(text_ids[:6], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.add_request(text_ids[:6], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill both, first token each
    rec = engine.step()  # second token of `short`: it finishes
    assert short in rec.finished
    assert short not in [o for b in rec.snapshot.owners for o in b]
    assert any(e.kind == "free" and e.request_id == short for e in rec.events)


def test_new_request_joins_between_steps(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=32)
    first = engine.add_request(text_ids[:5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.step()
    second = engine.add_request(text_ids[:3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    rec = engine.step()
    assert rec.kind == "prefill" and [s.request_id for s in rec.scheduled] == [second]
    rec = engine.step()
    assert rec.kind == "decode" and {s.request_id for s in rec.scheduled} == {first, second}


def test_preemption_frees_the_newest_request_and_everything_finishes(make_engine, text_ids):
    engine = make_engine(block_size=4, num_blocks=6, max_model_len=24)
    ids = [engine.add_request(text_ids[:6], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
           for _ in range(3)]
    preempt_events = []
    admitted: list[str] = []  # the running requests, oldest admission first (replayed from the events)
    steps = 0
    while engine.has_unfinished():
        running_before = list(engine.scheduler.running)
        rec = engine.step()
        steps += 1
        assert steps < 500, "the scheduler must never deadlock"
        assert [r.request_id for r in running_before] == admitted
        for e in rec.events:
            if e.kind in ("admit", "swap_in"):
                admitted.append(e.request_id)
            elif e.kind == "preempt":
                preempt_events.append(e)
                assert e.data["mode"] == "recompute"
                # the victim is the most recently admitted running request, whoever needed the block
                assert e.request_id == admitted[-1], (rec.step, e.request_id, admitted)
                admitted.remove(e.request_id)
            elif e.kind == "finish":
                admitted.remove(e.request_id)
    assert preempt_events
    # R3, admitted last, goes, though R1 (the oldest) is the one that needs a block
    pairs = [(e.request_id, e.data["reason"].split()[0]) for e in preempt_events]
    assert (ids[2], ids[0]) in pairs, pairs
    assert all(engine.get_output(r).finish_reason == "length" for r in ids)
    assert all(len(engine.get_output(r).output_token_ids) == 14 for r in ids)
    assert engine.block_manager.num_free_blocks == 6
