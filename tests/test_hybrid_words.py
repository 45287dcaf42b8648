"""The hybrid model's steps in words (issue 25, item 4, teacher trial): the sentences written from the
allocator's events name every KV cache group's blocks (``group_blocks`` in the event's data), the step
summary's block count is what the pool took, and a single-group run's sentences read exactly as before."""

from __future__ import annotations

import pytest
from conftest import TEXT

from engine import EMBEDDED_HYBRID_MODEL, EngineConfig, LLMEngine, SamplingParams
from viz.block_table import group_label
from viz.steps import step_sentences

HYBRID = EMBEDDED_HYBRID_MODEL
B = 16


def _run(engine, lengths, tokenize, max_tokens=3):
    ids = tokenize(TEXT, add_special_tokens=False)["input_ids"]
    for i, n in enumerate(lengths):  # prompts from different parts of the text: no prefix-cache hit
        engine.add_request(ids[100 * i:100 * i + n], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    records = []
    while engine.has_unfinished():
        records.append(engine.step())
    return records


@pytest.fixture(scope="module")
def loaded(hybrid_loaded):
    return hybrid_loaded


@pytest.fixture(scope="module")
def hybrid(loaded):
    """Two prompts (62 and 20 tokens) on the hybrid model: the first step's allocations in both groups,
    then appends into a block with room."""
    engine = LLMEngine(EngineConfig(model=HYBRID, device="cpu", dtype="float32", semantics="v1", block_size=B,
                                    num_blocks=24), loaded=loaded)
    return engine.config.num_blocks, _run(engine, [62, 20], loaded[1])


def test_allocation_sentences_name_every_groups_blocks(hybrid):
    _, records = hybrid
    first = records[0]
    names = [group_label(g) for g in first.snapshot.kv_cache_groups]
    by_seq = {s.seq_id: s for s in first.snapshot.sequences}
    allocs = [e for e in first.events if e.kind == "allocate"]
    assert len(allocs) == 2
    for e in allocs:
        tables = [[b for b in t if b != -1] for t in by_seq[e.request_id].group_block_tables]
        assert e.data["group_blocks"] == tables  # nothing cached: every held block is new
        told = ", ".join(f"{name} {t}" for name, t in zip(names, tables))
        assert f"take {sum(map(len, tables))} new blocks: {told} (last block holds" in e.message


def test_step_summary_counts_what_the_pool_took(hybrid):
    num_blocks, records = hybrid
    first = records[0]
    taken = num_blocks - first.snapshot.num_free_blocks
    assert taken == 12  # 4 + 4 (62 tokens) and 2 + 2 (20 tokens) over the two groups
    lines = step_sentences(first, group_from=2)
    assert f"2 sequences took {taken} blocks for their prompts (R1, R2)" in lines


def test_append_names_each_groups_block(hybrid):
    _, records = hybrid
    rec = next(r for r in records if any(e.kind == "append" for e in r.events))
    names = [group_label(g) for g in rec.snapshot.kv_cache_groups]
    by_seq = {s.seq_id: s for s in rec.snapshot.sequences}
    last = {sid: [t[-1] for t in s.group_block_tables] for sid, s in by_seq.items()}
    for e in (e for e in rec.events if e.kind == "append"):
        told = ", ".join(f"{name} [{b}]" for name, b in zip(names, last[e.request_id]))
        assert f"written into blocks {told} (" in e.message
    summary = step_sentences(rec, group_from=2)[-1]
    assert summary.endswith("(" + ", ".join(f"{sid}->{last[sid]}" for sid in sorted(last)) + ")")


def test_single_group_sentences_read_as_before(make_engine):
    """A model of one full-attention group: no ``group_blocks``, the sentences in today's words."""
    engine = make_engine(block_size=B, num_blocks=24, semantics="v1")
    records = _run(engine, [20, 37], engine.tokenizer)
    first = records[0]
    assert all("group_blocks" not in e.data for r in records for e in r.events)
    tables = {s.seq_id: s.block_table for s in first.snapshot.sequences}
    msgs = [e.message for e in first.events if e.kind == "allocate"]
    assert msgs == [f"{sid}: {n} tokens take {len(tables[sid])} new blocks {tables[sid]} "
                    f"(last block holds {n - (len(tables[sid]) - 1) * B}/{B})" for sid, n in (("R1", 20), ("R2", 37))]
    assert f"2 sequences took {sum(map(len, tables.values()))} blocks for their prompts (R1, R2)" \
        in step_sentences(first, group_from=2)
    second = records[1]
    last = {s.seq_id: s.block_table[-1] for s in second.snapshot.sequences}
    appends = [e for e in second.events if e.kind == "append"]
    assert [e.message for e in appends] == [f"{e.request_id}: token {e.data['position']} written into block "
                                            f"{last[e.request_id]} ({e.data['position'] % B + 1}/{B})"
                                            for e in appends]
    assert step_sentences(second, group_from=2)[-1] == \
        f"2 sequences wrote their new token into a block with room (R1->{last['R1']}, R2->{last['R2']})"


@pytest.mark.parametrize("kw", [{}, {"compact": True}, {"width_px": 1200}, {"max_blocks": 4}])
def test_block_table_columns_cannot_be_read_as_layers(hybrid, make_engine, kw):
    """The logical blocks' ticks: "block 0" (or "logical 0") then plain numbers, in a hybrid run (whose group
    legend says "layers 0, 2") and a single-group one; never "L0 L1" (which a class read as layers)."""
    from viz.block_table import block_table_figure

    _, records = hybrid
    engine = make_engine(block_size=B, num_blocks=24, semantics="v1")
    single = _run(engine, [70], engine.tokenizer, max_tokens=2)
    for rec in (records[1], single[0]):  # 4 and 5 logical blocks held
        ticks = list(block_table_figure(rec, **kw).layout.xaxis.ticktext)
        assert ticks[0] in ("logical 0", "block 0"), ticks
        assert all(t == "..." or t.isdigit() for t in ticks[1:]) and len(ticks) >= 4, ticks


def _cli(args, loaded, monkeypatch, capsys) -> tuple[dict, str]:
    """The CLI's --json object and its text for the same run (the hybrid model loaded once)."""
    import json

    import engine.llm_engine as llm_engine
    from engine.cli import main

    real = llm_engine.LLMEngine
    hybrid_model = "--model" not in args
    monkeypatch.setattr(llm_engine, "LLMEngine",
                        lambda config, given=None: real(config, loaded=given or (loaded if hybrid_model else None)))
    assert main(["run", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(["run", *args]) == 0
    return out, capsys.readouterr().out


MIB = 1024 * 1024


def test_cli_header_adds_up_for_a_hybrid_model(loaded, monkeypatch, capsys):
    """A hybrid block holds one group's layers: the header's bytes per block times the blocks is the MiB it
    shows, and the saving line gives the bytes beside its counts in those blocks."""
    import re

    out, text = _cli(["--scenario", "hybrid-window"], loaded, monkeypatch, capsys)
    per_block, n, groups = out["hybrid"]["bytes_per_block"], out["num_blocks"], out["kv_cache_groups"]
    layers = sum(len(g["layers"]) for g in groups)
    m = re.search(r"paged pool: (\d+) blocks x (\d+) tokens = ([\d,]+) token slots; a block holds one KV cache "
                  r"group's layers \((\d+) of (\d+)\): (\d+) tokens x ([\d,]+) bytes = ([\d,]+) bytes, (\d+) x "
                  r"([\d,]+) bytes = ([\d.]+) MiB \(([\d,]+) bytes of KV per token over all (\d+) layers", text)
    assert m, text.splitlines()[2]
    num = [float(x.replace(",", "")) for x in m.groups()]
    assert num[0] == num[8] == n and num[1] == num[5] == B and num[2] == n * B
    assert num[3] == len(groups[0]["layers"]) and num[4] == num[12] == layers
    assert num[5] * num[6] == num[7] == num[9] == per_block
    assert num[11] == out["kv_bytes_per_token"] == num[6] * layers / num[3]  # every layer's: one slot per group
    assert f"{n * per_block / MIB:.2f}" == m.group(11) and n * per_block == out["kv_cache_bytes"]
    p = out["hybrid"]["peak"]
    assert (f"{p['held']} blocks held where the same model with every layer full would hold {p['twin']} (blocks of "
            f"{per_block:,} bytes, one group's layers each: {p['held'] * per_block:,} bytes held, "
            f"{p['twin'] * per_block:,} with every layer full)") in text


def test_cli_header_of_a_single_group_model_reads_as_before(loaded, monkeypatch, capsys, model_path):
    out, text = _cli(["--scenario", "single", "--model", model_path], loaded, monkeypatch, capsys)
    assert "hybrid" not in out
    n, b = out["num_blocks"], out["block_size"]
    assert (f"paged pool: {n} blocks x {b} tokens = {n * b:,} token slots, {out['kv_bytes_per_token']:,} bytes of "
            f"KV per token, {out['kv_cache_bytes'] / MIB:.2f} MiB\n") in text
    assert "one KV cache group's layers" not in text


def test_saving_lines_say_their_blocks_unit_and_bytes(hybrid):
    from engine.metrics import hybrid_saving
    from viz.stage import hybrid_line, hybrid_short

    _, records = hybrid
    snap = records[-2].snapshot
    saving = hybrid_saving(snap, 100)
    assert hybrid_line(snap, 100).endswith(
        f"would hold {saving['twin']} (blocks of 100 bytes, one KV cache group's layers each: "
        f"{saving['held'] * 100:,} bytes held, {saving['twin'] * 100:,} with every layer full).")
    assert hybrid_short(snap, 100).endswith(f"with every layer full (blocks of 100 bytes: one group's layers)")
    assert hybrid_line(snap).endswith(f"would hold {saving['twin']}.")  # no bytes known: no unit said


def test_a_hybrid_steps_outlines_cover_every_groups_new_blocks(hybrid):
    """The pool and block-table pictures outline what a step changed: on the hybrid model the sliding group's new
    blocks too (``records.changed_blocks`` / ``blocks_new_in_tables`` read ``group_blocks``)."""
    from engine.records import blocks_new_in_tables, changed_blocks

    _, records = hybrid
    first = records[0]
    taken = {b for s in first.snapshot.sequences for t in s.group_block_tables for b in t if b >= 0}
    assert taken and taken <= set(changed_blocks(first.events))
    assert taken <= blocks_new_in_tables(first.events)
