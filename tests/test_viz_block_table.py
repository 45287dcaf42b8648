"""The block-table picture (``viz.block_table``) read back from the figure itself, on real engine runs of the
"parallel-sampling", "beam-search" and "shared-prefix" presets (paper semantics): one arrow per table entry,
as many arrows into a shared block as its reference count, a copy-on-write drawn as the arrow moving from
``src`` to ``dst``, the token pick landing on the engine's own slot, and heights that fit beside the pool."""

from __future__ import annotations

from collections import Counter

import pytest

from engine import EngineConfig, LLMEngine
from engine.records import Snapshot, SequenceState
from engine.scenarios.presets import SCENARIOS
from engine.scenarios.workloads import run_workload
from viz.block_table import block_table_figure

PRESETS = ("parallel-sampling", "beam-search", "shared-prefix")


@pytest.fixture(scope="module")
def runs(model_path):
    """preset -> (records, request order, {(step, seq_id, position): slot from the engine's block manager})."""
    import torch

    from engine.model_loader import load_model

    loaded = load_model(model_path, torch.device("cpu"), "float32")
    out = {}
    for name in PRESETS:
        sc = SCENARIOS[name]
        engine = LLMEngine(EngineConfig(device="cpu", semantics="paper", **sc.engine_defaults), loaded=loaded)
        tokenize = lambda t: engine.tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        records, slots = [], {}

        def keep(record):
            records.append(record)
            for s in record.snapshot.sequences:
                if s.status == "running" and s.block_table:
                    for pos in {0, s.num_tokens // 2, s.num_tokens - 1}:  # first, middle, last token
                        slots[(record.step, s.seq_id, pos)] = engine.block_manager.slot(s.seq_id, pos)

        run_workload(engine, sc.make(0, tokenize), on_step=keep)
        order = list(dict.fromkeys(s.request_id for r in records for s in r.snapshot.sequences))
        out[name] = (records, order, slots)
    return out


def arrows_of(fig, kind: str = "table") -> Counter:
    """(seq_id, logical, physical) -> how many arrows of ``kind`` the figure draws (a None splits arrows)."""
    found = Counter()
    for trace in fig.data:
        if (trace.meta or {}).get("role") != "arrows" or trace.meta["kind"] != kind:
            continue
        starts = [i for i, x in enumerate(trace.x) if x is not None and (i == 0 or trace.x[i - 1] is None)]
        found.update(tuple(trace.customdata[i][:3]) for i in starts)
    return found


def labels(fig, role: str) -> dict[tuple[float, float], str]:
    trace = next(t for t in fig.data if (t.meta or {}).get("role") == role)
    return {(x, y): text for x, y, text in zip(trace.x, trace.y, trace.text)}


def outlined(fig, role: str, kind: str) -> list[str]:
    """Labels of the ``role`` boxes whose centre is the centre of an outline of ``kind``."""
    trace = next((t for t in fig.data if (t.meta or {}).get("role") == f"outline_{kind}"), None)
    if trace is None:
        return []
    centres = []
    for i in range(0, len(trace.x), 6):  # a rectangle: 5 points and a None
        centres.append(((trace.x[i] + trace.x[i + 1]) / 2, (trace.y[i] + trace.y[i + 2]) / 2))
    boxes = labels(fig, role)
    return [text for c in centres for xy, text in boxes.items() if abs(xy[0] - c[0]) < 1e-6 and abs(xy[1] - c[1]) < 1e-6]


def block_id(label: str) -> int:
    """``"7 x1"`` / ``"<b>7 x3</b>"`` -> 7."""
    return int(label.removeprefix("<b>").split(" ")[0])


def live(snapshot):
    return [s for s in snapshot.sequences if s.status == "running" and s.block_table]


@pytest.mark.parametrize("name", PRESETS)
def test_every_table_entry_has_exactly_one_arrow(runs, name):
    records, order, _ = runs[name]
    for rec in records:
        fig = block_table_figure(rec, order)
        want = Counter((s.seq_id, i, b) for s in live(rec.snapshot) for i, b in enumerate(s.block_table))
        assert arrows_of(fig) == want, f"{name} step {rec.step}"
        assert "showing" not in fig.layout.title.text  # these presets fit whole


@pytest.mark.parametrize("name", PRESETS)
def test_a_shared_block_gets_one_arrow_per_reference(runs, name):
    records, order, _ = runs[name]
    shared_seen = 0
    for rec in records:
        snap = rec.snapshot
        fig = block_table_figure(rec, order)
        arriving = Counter(b for (_, _, b), n in arrows_of(fig).items() for _ in range(n))
        for b, n in arriving.items():
            assert n == snap.ref_counts[b], f"{name} step {rec.step}: block {b}"
            shared_seen += n > 1
        # every physical box is labelled with its id and its reference count
        assert sorted(labels(fig, "physical_labels").values()) == sorted(
            (f"<b>{b} x{snap.ref_counts[b]}</b>" if snap.ref_counts[b] > 1 else
             f"{b} x{snap.ref_counts[b]}" + (" free" if snap.ref_counts[b] == 0 else ""))
            for b in set(arriving) | {a[2] for a in arrows_of(fig, "cow_old")})
    assert shared_seen, f"{name}: no shared block drawn (the preset should share)"


@pytest.mark.parametrize("name", ("parallel-sampling", "beam-search"))
def test_copy_on_write_moves_the_arrow_from_src_to_dst(runs, name):
    records, order, _ = runs[name]
    drawn = 0
    for rec in records:
        fig = block_table_figure(rec, order)
        old, new = arrows_of(fig, "cow_old"), arrows_of(fig)
        captions = " ".join(a.text for a in fig.layout.annotations if a.name == "caption")
        live_ids = {s.seq_id for s in live(rec.snapshot)}
        for e in rec.events:
            if e.kind != "cow" or e.request_id not in live_ids:
                continue
            logical = e.data["position"] // rec.snapshot.block_size
            assert old[(e.request_id, logical, e.data["src"])] == 1, f"{name} step {rec.step}: {e.message}"
            assert new[(e.request_id, logical, e.data["dst"])] == 1
            assert f"{e.request_id} block {e.data['src']} -> {e.data['dst']}" in captions.replace("<br>", " ")
            assert e.data["dst"] in map(block_id, outlined(fig, "physical_labels", "changed"))  # the copy is new
            drawn += 1
        if not any(e.kind == "cow" for e in rec.events):
            assert not old and "copy-on-write" not in captions
    assert drawn >= 3


@pytest.mark.parametrize("name", PRESETS)
def test_token_pick_lands_on_the_engines_slot(runs, name):
    records, order, slots = runs[name]
    B = records[0].snapshot.block_size
    for (step, seq_id, pos), slot in list(slots.items())[:: max(1, len(slots) // 40)]:  # ~40 picks a preset
        fig = block_table_figure(records[step - 1], order, token=(seq_id, pos))
        physical, offset = divmod(slot, B)
        assert [block_id(t) for t in outlined(fig, "physical_labels", "token")] == [physical], \
            f"{name} step {step} {seq_id} token {pos}"
        assert outlined(fig, "logical_labels", "token") == [str(physical)]
        caption = " ".join(a.text for a in fig.layout.annotations if a.name == "caption")
        assert f"offset {pos} % {B} = {offset}" in caption and f"slot {physical} x {B} + {offset} = {slot}" in caption
        assert f"logical block {pos} // {B} = {pos // B}" in caption


def test_heights_fit_beside_the_pool(runs):
    for name in PRESETS:
        records, order, _ = runs[name]
        for rec in records:
            h = block_table_figure(rec, order).layout.height
            assert 290 <= h <= 420, f"{name} step {rec.step}: {h} px"
            assert block_table_figure(rec, order, compact=True).layout.height <= 360


def big_snapshot(num_seqs: int = 12, blocks_each: int = 40, B: int = 4) -> Snapshot:
    seqs = [SequenceState(f"R{i + 1}", f"R{i + 1}", "running", 8, blocks_each * B - 8, blocks_each * B,
                          list(range(i * blocks_each, (i + 1) * blocks_each)), list(range(blocks_each * B)))
            for i in range(num_seqs)]
    n = num_seqs * blocks_each
    return Snapshot(num_blocks=n, block_size=B, num_free_blocks=0, ref_counts=[1] * n, fills=[B] * n,
                    owners=[[f"R{b // blocks_each + 1}"] for b in range(n)], sequences=seqs, waiting=[],
                    running=[s.seq_id for s in seqs])


def test_a_big_batch_is_cut_and_says_so():
    snap = big_snapshot()
    order = [s.seq_id for s in snap.sequences]
    fig = block_table_figure(snap, order, events=[], token=("R12", 101))
    assert fig.layout.height <= 440
    assert "8 of 12 sequences" in fig.layout.title.text and "of 40 logical blocks" in fig.layout.title.text
    assert {k[0] for k in arrows_of(fig)} >= {"R12"}  # the picked sequence and block are drawn
    assert outlined(fig, "physical_labels", "token") == [f"{11 * 40 + 101 // 4} x1"]
    fig = block_table_figure(snap, order, events=[], selected="R7", compact=True)
    assert fig.layout.height <= 360 and {k[0] for k in arrows_of(fig)} >= {"R7"}
    assert fig.layout.yaxis.ticktext[0].endswith(" R7")  # the highlighted request's row comes first


def test_bad_input_is_named(runs):
    records, order, _ = runs["parallel-sampling"]
    rec = records[3]
    with pytest.raises(ValueError, match="'R9.0'"):
        block_table_figure(rec, order, token=("R9.0", 0))
    seq = live(rec.snapshot)[0]
    with pytest.raises(ValueError, match=f"position {seq.num_tokens} is not held by '{seq.seq_id}'"):
        block_table_figure(rec, order, token=(seq.seq_id, seq.num_tokens))
    with pytest.raises(ValueError, match="max_rows 0"):
        block_table_figure(rec, order, max_rows=0)


def test_the_playground_draws_the_picture_and_the_pick_drives_it():
    """In the app: the token pick's widgets (keyed) change the picture's highlight and caption; going back a
    step keeps the pick, clamped to what that step's sequence holds."""
    import json
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=240)
    at.run()
    at.sidebar.selectbox[0].set_value("parallel-sampling")
    next(b for b in at.button if b.label == "Apply and reset").click().run()
    for _ in range(2):
        next(b for b in at.button if b.label == "Step").click().run()
    next(s for s in at.selectbox if s.key == "loc_seq").set_value("R1.1").run()
    next(n for n in at.number_input if n.key == "loc_t").set_value(19).run()
    assert not at.exception

    def picture() -> dict:
        specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
        return next(s for s in specs if s["layout"]["title"]["text"].startswith("Block tables"))

    snap = at.session_state["lab"].run.history[-1][0].snapshot
    seq = next(s for s in snap.sequences if s.seq_id == "R1.1")
    slot = seq.block_table[19 // 16] * 16 + 19 % 16
    captions = " ".join(a["text"] for a in picture()["layout"]["annotations"])
    assert "token 19 of R1.1" in captions and f"= {slot}" in captions
    assert "copy-on-write: R1.0 block 1 -> 2" in captions  # step 2 of this preset copies the prompt's last block
    next(b for b in at.button if b.label == "Back").click().run()  # step 1: 19 tokens, so token 18 at most
    assert not at.exception and next(n for n in at.number_input if n.key == "loc_t").value == 18
    assert "token 18 of R1.1" in " ".join(a["text"] for a in picture()["layout"]["annotations"])
