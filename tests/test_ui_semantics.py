"""The Playground and Compare in either semantics: the paper's (vLLM V0) and vLLM V1.

The same preset runs in both and shows the difference (parallel sampling: copy-on-write in the paper's
semantics, child requests hitting the prefix cache in V1); the semantics on screen is always named; switching
semantics and back rebuilds consistent engines; what V1 lacks (beam search, swap) says why and runs in the
paper's semantics; a mixed step is told by its parts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine import SamplingParams
from test_app import button, metrics
from test_app import new_app as _new_app
from viz.steps import step_label

PAPER_LINE = "Semantics: the paper's (vLLM V0) — prefill or decode steps, fork + copy-on-write"
V1_LINE = "Semantics: vLLM V1 — token budget {budget:,} per step, chunked prefill, n as child requests"


def new_app():
    return _new_app(timeout=300)


def semantics_radio(at):
    return next(r for r in at.sidebar.radio if r.label == "Semantics")


def apply(at, preset: str | None = None, semantics: str | None = None, **fields) -> None:
    """Choose the semantics (outside the form), then the preset and fields by label, and apply."""
    if semantics is not None:
        semantics_radio(at).set_value(semantics).run()
        assert not at.exception
    if preset is not None:
        next(s for s in at.sidebar.selectbox if s.label == "Preset").set_value(preset)
    for label, value in fields.items():
        next(w for w in list(at.sidebar.selectbox) + list(at.sidebar.number_input) if w.label == label).set_value(value)
    button(at, "Apply and reset").click().run()
    assert not at.exception


def step(at, times: int = 1) -> None:
    for _ in range(times):
        button(at, "Step").click().run()
        assert not at.exception


def markdown(at) -> str:
    return "\n".join(m.value for m in at.markdown)


def in_words(at) -> str:
    """The bullet list under "This step, in words"."""
    return next(m.value for m in at.markdown if m.value.startswith("- ") and " step: " in m.value)


def captions(at) -> list[str]:
    return [c.value for c in at.caption]


def sharing_caption(at) -> str:
    return next(c for c in captions(at) if c.startswith("Sharing so far"))


# ------------------------------------------------------------------------------------- parallel sampling
def test_parallel_sampling_in_the_paper_semantics_copies_on_write():
    """n=4 forks off the first sample after the prefill; the first decode copies the shared, partly filled
    last block for every sample but the last: the step's words and the sharing line say so."""
    at = new_app()
    apply(at, "parallel-sampling", semantics="paper")
    lab = at.session_state["lab"]
    assert lab.run.paged.semantics == "paper" and not lab.run.paged.parents
    step(at, 2)
    records = [p for p, _ in lab.run.history]
    cows = [e for r in records for e in r.events if e.kind == "cow"]
    assert len(cows) == 3
    words = in_words(at)
    assert words.startswith("- decode step: 4 decode tokens (R1.0, R1.1, R1.2, R1.3)")
    for e in cows:
        assert f"copied to block {e.blocks[1]}" in words
    assert "3 forks, 3 copy-on-write copies" in sharing_caption(at)
    assert [s.seq_id for s in records[-1].snapshot.sequences] == ["R1.0", "R1.1", "R1.2", "R1.3"]
    assert records[-1].snapshot.running == ["R1"]  # one request holding four samples
    assert PAPER_LINE in markdown(at)


def test_parallel_sampling_in_v1_runs_child_requests_that_hit_the_prefix_cache():
    """The same preset in V1: four child requests R1.0 .. R1.3; the last three find the prompt's full block in
    the prefix cache in the very first step; no fork and no copy-on-write, ever."""
    at = new_app()
    apply(at, "parallel-sampling", semantics="v1")
    lab = at.session_state["lab"]
    assert lab.run.paged.semantics == "v1" and lab.run.semantics_note is None
    step(at)
    first = lab.run.history[0][0]
    words = in_words(at)
    for child in ("R1.1", "R1.2", "R1.3"):
        assert f"prefill of {child} (positions 16-18 of 19; positions 0-15 from the prefix cache)" in words
        assert f"{child} admitted: computes 3 of 19 tokens this step, 16 found in the prefix cache" in words
    assert first.snapshot.running == ["R1.0", "R1.1", "R1.2", "R1.3"]
    assert lab.run.paged.parents == {"R1": ["R1.0", "R1.1", "R1.2", "R1.3"]}
    shown = metrics(at)
    assert shown["running"] == "4"
    assert shown["hit rate"] == f"{100 * 48 / 76:.1f}%"  # 3 x 16 hit tokens of 4 x 19 looked up
    sharing = sharing_caption(at)
    assert "R1 runs as 4 child requests R1.0, R1.1, R1.2, R1.3" in sharing
    assert "48 prompt tokens found in the prefix cache (by R1.1, R1.2, R1.3)" in sharing
    assert "0 forks, 0 copy-on-write copies" in sharing
    step(at, 3)  # the paper's first decode copied on write three times; V1 writes into each child's own block
    records = [p for p, _ in lab.run.history]
    assert not [e for r in records for e in r.events if e.kind in ("cow", "fork")]
    assert "copied to block" not in in_words(at)
    assert V1_LINE.format(budget=2048) in markdown(at)
    # the preset's description tells the paper's story; the sidebar says what its samples become in V1
    assert any("In vLLM V1 the 4 samples run as 4 child requests (R1.0 .. R1.3)" in c.value
               for c in at.sidebar.caption)


# ------------------------------------------------------------------------------------ the semantics line
def test_the_semantics_line_is_on_both_pages_in_both_semantics():
    at = new_app()
    assert PAPER_LINE in markdown(at)
    apply(at, semantics="v1", **{"Token budget per step": 64})
    assert at.session_state["lab"].run.paged.max_num_batched_tokens == 64
    assert V1_LINE.format(budget=64) in markdown(at)
    assert "FCFS, at most 64 running sequences" in markdown(at)  # V1 needs max_num_seqs <= the budget
    assert PAPER_LINE not in markdown(at)
    step(at)
    assert captions(at)[0].startswith("step 1 of 1 (prefill; vLLM V1)")
    assert any("vLLM V1 (token budget 64, FCFS, at most 64 running)" in c.value for c in at.sidebar.caption)

    at.switch_page("ui/compare.py").run()
    assert not at.exception
    assert PAPER_LINE in markdown(at)  # Compare's own switch starts on the paper's semantics
    at.radio(key="compare_semantics").set_value("v1").run()
    assert V1_LINE.format(budget=2048) in markdown(at)
    at.number_input(key="compare_budget").set_value(8).run()
    assert V1_LINE.format(budget=8) in markdown(at)
    at.radio(key="compare_semantics").set_value("paper").run()  # the budget input is not drawn now...
    at.radio(key="compare_semantics").set_value("v1").run()
    assert V1_LINE.format(budget=8) in markdown(at)  # ...and comes back with the budget set, not 2,048
    next(s for s in at.selectbox if s.label == "Workload").set_value("single")
    button(at, "Run all").click().run()
    assert not at.exception
    result = at.session_state["compare"]
    assert result["semantics"] == "v1"
    records, _ = result["paged"]
    assert all(r.semantics == "v1" for r in records)
    assert any(r.kind == "prefill" and r.num_tokens == 8 for r in records)  # the prompt in chunks of 8
    assert all(r.semantics == "paper" for recs, _ in result["policies"].values() for r in recs)
    assert list(at.table[0].value.columns)[0] == "paged (vLLM V1)"
    assert any(c.startswith("Paged column, semantics: vLLM V1 — token budget 8 per step") for c in captions(at))
    at.radio(key="compare_semantics").set_value("paper").run()
    assert "compare" not in at.session_state  # the V1 table is not shown under the paper's line
    assert PAPER_LINE in markdown(at)


# ---------------------------------------------------------------------------------- switching and back
def test_switching_semantics_and_back_leaves_consistent_engines():
    at = new_app()  # batch, the paper's semantics
    step(at, 3)
    before = [[s.token_ids for s in p.snapshot.sequences] for p, _ in at.session_state["lab"].run.history]
    button(at, "Play").click().run()
    apply(at, semantics="v1")
    lab = at.session_state["lab"]
    assert not at.session_state["playing"] and lab.step_count == 0  # rebuilt, paused
    assert (lab.run.settings.semantics, lab.run.paged.semantics, lab.run.contiguous.semantics) == ("v1", "v1", "paper")
    assert lab.run.paged.config.watermark == 0 and lab.run.paged.config.preemption_mode == "recompute"
    assert lab.run.contiguous.max_num_batched_tokens >= lab.run.contiguous.max_model_len
    assert semantics_radio(at).value == "v1"
    step(at, 3)
    assert lab.run.paged.block_manager.invariant_violations() == []
    assert all(p.semantics == "v1" and c.semantics == "paper" for p, c in lab.run.history)
    snap = lab.run.history[-1][0].snapshot
    assert metrics(at)["free blocks"] == f"{snap.num_free_blocks}/{snap.num_blocks}"

    apply(at, semantics="paper")
    lab = at.session_state["lab"]
    assert (lab.run.settings.semantics, lab.run.paged.semantics) == ("paper", "paper")
    assert lab.run.paged.config.watermark == 0.01 and lab.run.paged.config.scheduling_policy == "fcfs"
    assert lab.run.paged.max_num_batched_tokens == max(lab.run.paged.max_model_len, 2048)
    step(at, 3)
    assert lab.run.paged.block_manager.invariant_violations() == []
    # the same run as before the switch: nothing of the V1 engine leaked into the paper's
    assert [[s.token_ids for s in p.snapshot.sequences] for p, _ in lab.run.history] == before
    assert PAPER_LINE in markdown(at)


# -------------------------------------------------------------------------------- what V1 does not have
@pytest.mark.parametrize("preset, why", [
    ("beam-search", "beam search (4 beams that fork and share blocks), and vLLM V1 runs beam search outside"),
    ("swap", "preempts by swap"),
])
def test_a_preset_v1_cannot_run_says_why_and_runs_in_the_paper(preset, why):
    at = new_app()
    apply(at, preset, semantics="v1")
    lab = at.session_state["lab"]
    assert lab.run.settings.preset == preset and lab.run.paged.semantics == "paper"
    warning = next(w.value for w in at.warning if "vLLM V1 was chosen" in w.value)
    assert f"the {preset} preset runs in the paper's semantics (vLLM V0)" in warning and why in warning
    assert PAPER_LINE in markdown(at) and "Semantics: vLLM V1" not in markdown(at)
    assert semantics_radio(at).value == "paper"  # the switch shows what runs
    step(at, 2)
    assert lab.step_count == 2


def test_a_beam_request_added_in_v1_is_refused_in_words():
    at = new_app()
    apply(at, "custom", semantics="v1")
    next(w for w in at.sidebar.number_input if w.label == "beams").set_value(4)
    button(at, "Add request (also mid-run)").click().run()
    assert not at.exception
    assert any("Request not added: beam_width 4: vLLM V1 runs beam search outside its scheduler" in e.value
               for e in at.error)
    assert not at.session_state["lab"].run.paged.requests


def test_v1_has_no_swap_option_and_says_so():
    at = new_app()
    assert any(r.label == "Preemption" for r in at.sidebar.radio)
    semantics_radio(at).set_value("v1").run()
    assert not any(r.label == "Preemption" for r in at.sidebar.radio)
    assert not any(w.label.startswith("Swap pool") for w in at.sidebar.number_input)
    assert any("recompute only" in c.value and "swap is the paper's" in c.value for c in at.sidebar.caption)
    assert any("not applied yet" in c.value for c in at.sidebar.caption)


# ------------------------------------------------------------------------------------------ mixed steps
def test_a_mixed_step_is_told_by_its_parts():
    """batch in V1 with a budget of 16 tokens: step 2 decodes R1 and prefills the rest of R2's prompt and
    the start of R3's in one step. The caption and the words name each part, read from the record."""
    at = new_app()
    apply(at, "batch", semantics="v1", **{"Token budget per step": 16})
    step(at, 2)
    record = at.session_state["lab"].run.history[-1][0]
    assert record.kind == "mixed"
    prompt = {s.seq_id: s.prompt_len for s in record.snapshot.sequences}
    decode = [s for s in record.scheduled if s.start_pos >= prompt[s.seq_id]]
    chunks = [s for s in record.scheduled if s.start_pos < prompt[s.seq_id]]
    assert decode and chunks
    assert captions(at)[0].startswith(f"step 2 of 2 (mixed: {len(decode)} decode token"
                                      f"{'s' * (len(decode) != 1)} + {len(chunks)} prefill chunk")
    words = in_words(at)
    assert words.startswith(f"- mixed step: {len(decode)} decode token")
    assert ", ".join(s.seq_id for s in decode) in words.splitlines()[0]
    for s in chunks:
        end = s.start_pos + s.num_tokens - 1
        assert f"{s.num_tokens}-token prefill chunk of {s.seq_id} (positions {s.start_pos}-{end} of " \
               f"{prompt[s.seq_id]}" in words
    assert f"{record.num_tokens} of the 16-token budget" in words.splitlines()[0]
    # the pool figure's title (what a downloaded image keeps) names the step's parts and the semantics
    pool = next(c for c in at.get("plotly_chart") if "blocks in use" in c.proto.spec)
    title = json.loads(pool.proto.spec)["layout"]["title"]["text"]
    assert title.startswith("step 2, vLLM V1: ") and step_label(record) in title


# ---------------------------------------------------------------------------------- settings, no Streamlit
def test_settings_in_v1_reach_the_paged_engine_only_and_match_the_cli():
    """Every preset in V1: the paged config is V1 with the budget (unless the preset needs the paper: a
    note says why; a budget below 256 caps max_num_seqs, which V1 requires), the contiguous one is the
    paper's without V1's budget, and the CLI's ``--semantics v1`` builds the same paged config."""
    from engine.cli import build_parser, engine_config
    from engine.scenarios.presets import SCENARIOS
    from ui.lab import fit_semantics
    from ui.state import preset_settings

    for name, scenario in SCENARIOS.items():
        settings, note = fit_semantics(preset_settings(name, semantics="v1", max_num_batched_tokens=32))
        paged, contiguous = settings.engine_config("paged"), settings.engine_config("contiguous")
        assert (contiguous.semantics, contiguous.max_num_batched_tokens, contiguous.scheduling_policy,
                contiguous.max_num_seqs) == ("paper", None, "fcfs", 256)
        if name in ("beam-search", "swap"):
            assert paged.semantics == "paper" and "vLLM V1 was chosen" in note
            assert paged.max_num_batched_tokens is None and paged.max_num_seqs == 256
            continue
        assert note is None
        assert (paged.semantics, paged.max_num_batched_tokens, paged.max_num_seqs) == ("v1", 32, 32)
        assert paged.watermark == scenario.engine_defaults.get("watermark", 0.0)  # V1's default 0
        assert paged.swap_space_blocks is None  # V1 has no swap pool (memory-pressure names one for lesson 5)
        default, _ = fit_semantics(preset_settings(name, semantics="v1"))
        args = build_parser().parse_args(["run", "--scenario", name, "--semantics", "v1"])
        cli = engine_config(args, scenario, "paged")
        cli = dataclasses.replace(cli, reservation_tokens=cli.reservation_tokens or cli.max_model_len)
        assert cli == default.engine_config("paged"), name


def test_lab_priority_reaches_the_v1_engine():
    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_shared
    from engine.scenarios.run_spec import RunSpec
    from ui.lab import Lab

    lab = Lab.create(RunSpec(model=EMBEDDED_MODEL, preset="custom", semantics="v1", scheduling_policy="priority"),
                     load_shared(EMBEDDED_MODEL))
    low = lab.add_request("ROMEO. ", SamplingParams(max_tokens=2, temperature=0), priority=5)
    high = lab.add_request("HAMLET. ", SamplingParams(max_tokens=2, temperature=0), priority=-1)
    assert lab.run.paged.requests[high].priority == -1 and lab.run.paged.requests[low].priority == 5
    assert lab.run.paged.config.scheduling_policy == "priority"


def test_a_chosen_but_unapplied_semantics_is_said_under_the_title():
    at = new_app()
    semantics_radio(at).set_value("v1").run()
    assert not at.exception
    main = [c.value for c in at.main.caption]
    assert any("vLLM V1 is chosen in the sidebar but not applied yet" in c for c in main)
    assert PAPER_LINE in markdown(at)  # the line names what runs, still the paper's
