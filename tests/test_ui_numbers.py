"""The numbers the pages show are the engine's: Compare's four contiguous policies and its first-admission hit
rate, a scenario's own settings kept on Compare, the Playground's prefix-cache reset and hit rate, its
contiguous policies, one internal-fragmentation definition shared with the CLI, and the lessons' way into
the Playground without importing ui."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL, SamplingParams, metrics
from engine.config import CONTIGUOUS_POLICIES
from engine.model_loader import load_shared

from test_app import button
from test_app import new_app as _new_app

ROOT = Path(__file__).resolve().parent.parent


def new_app() -> AppTest:
    return _new_app(timeout=300)  # Compare runs five whole workloads


def run_compare(at, name: str) -> None:
    at.switch_page("ui/compare.py").run()
    next(s for s in at.selectbox if s.label == "Workload").set_value(name)
    button(at, "Run all").click().run()
    assert not at.exception


def first_admission_rate(records) -> tuple[float, float, int]:
    """(hit rate of first admissions, hit rate of all admissions, re-admission hit tokens), recounted from the
    records' own events, independently of ``engine.metrics``."""
    hits = {False: 0, True: 0}
    asked = {False: 0, True: 0}
    for r in records:
        for e in r.events:
            again = bool(e.data.get("readmission"))
            if e.kind == "prefix_hit":
                hits[again] += e.data["num_tokens"]
            elif e.kind == "admit":
                asked[again] += e.data["num_tokens"]
    first = 100 * hits[False] / asked[False]
    both = 100 * (hits[False] + hits[True]) / (asked[False] + asked[True])
    return first, both, hits[True]


# --------------------------------------------------------------------------------------------------- Compare
def test_compare_runs_all_four_policies_and_counts_first_admissions_only():
    """batch: 6 requests in 12 blocks of 16; three preemptions by recompute, whose re-admissions hit their
    own freed blocks (32 tokens) while first admissions hit nothing."""
    at = new_app()
    run_compare(at, "batch")
    table = at.table[0].value
    assert list(table.columns) == ["paged", "Orca (Max)", "prompt + max_tokens", "Orca (Pow2)", "Orca (Oracle)"]
    result = at.session_state["compare"]
    assert set(result["policies"]) == set(CONTIGUOUS_POLICIES) and not result["skipped"]
    records, summary = result["paged"]
    first, both, readmission_hits = first_admission_rate(records)
    assert readmission_hits > 0 and f"{first:.1f}%" != f"{both:.1f}%"  # the two rates differ here
    assert table.loc["prefix-cache hit rate (first admissions)", "paged"] == f"{first:.1f}%"
    assert table.loc["re-admission hit tokens", "paged"] == f"{readmission_hits:,}"
    assert table.loc["preemptions", "paged"] == str(sum(e.kind == "preempt" for r in records for e in r.events))
    # the policies reserve differently: Max reserves R per request, Oracle exactly each final length
    finals = [e.data["final_len"] for r in records for e in r.events if e.kind == "finish"]
    assert table.loc["slots used", "Orca (Oracle)"] == f"{sum(finals):,}"
    assert table.loc["internal fragmentation (slots)", "Orca (Oracle)"] == "0"
    assert table.loc["slots allocated / reserved", "Orca (Max)"] == f"{len(finals) * result['settings'].reservation:,}"
    pow2 = sum(min(1 << (n - 1).bit_length(), max(result["settings"].reservation, n)) for n in finals)
    assert table.loc["slots allocated / reserved", "Orca (Pow2)"] == f"{pow2:,}"
    assert any("Orca (Max)" in c.value and "Orca (Oracle)" in c.value for c in at.caption)
    # the figures draw paged against one chosen policy
    at.selectbox(key="compare_policy").set_value("oracle").run()
    assert not at.exception


def test_compare_keeps_a_scenarios_prefix_caching_off():
    """life-of-a-request turns prefix caching off (lesson 3 counts every block); Compare used to drop that."""
    at = new_app()
    run_compare(at, "life-of-a-request")
    result = at.session_state["compare"]
    assert result["settings"].enable_prefix_caching is False
    records, summary = result["paged"]
    assert summary["prefix_cache"]["requests"] == 0  # the engine never looked anything up
    assert not any(e.kind == "prefix_hit" for r in records for e in r.events)
    assert at.table[0].value.loc["prefix-cache hit rate (first admissions)", "paged"] == "off"


def _final_tokens(records) -> dict[str, list[int]]:
    """Each sequence's tokens (prompt + generated) as the last snapshot that lists it holds them."""
    return {s.seq_id: list(s.token_ids) for r in records for s in r.snapshot.sequences}


def test_compare_runs_parallel_sampling_on_the_contiguous_baseline():
    """n=4 samples: the baseline keeps a row per sample, so it stores the prompt 4 times where paging stores it
    once; every policy whose rows fit runs and gives the paged engine's tokens, and Orca (Max) (4 rows of
    R = 256 slots in a 512-slot region) is refused with the engine's reason, not dropped silently."""
    at = new_app()
    run_compare(at, "parallel-sampling")
    assert not at.error
    result = at.session_state["compare"]
    assert set(result["policies"]) | set(result["skipped"]) == set(CONTIGUOUS_POLICIES)
    assert set(result["skipped"]) == {"max"}
    assert "n=4 samples reserve 4 x 256 slots but the region holds 512" in result["skipped"]["max"]
    assert any("Orca (Max) could not run this workload" in w.value and "4 x 256" in w.value for w in at.warning)
    table = at.table[0].value
    assert list(table.columns) == ["paged", "prompt + max_tokens", "Orca (Pow2)", "Orca (Oracle)"]
    paged = _final_tokens(result["paged"][0])
    samples = sorted(k for k in paged if k.startswith("R1."))
    assert len(samples) == 4
    finals = [len(paged[k]) for k in samples]  # each sample's final length (prompt + generated)
    prompt_len = next(s.prompt_len for r in result["paged"][0] for s in r.snapshot.sequences)
    generated = sum(f - prompt_len for f in finals)
    assert table.loc["slots used", "paged"] == f"{prompt_len + generated:,}"  # the prompt once, shared
    settings = result["settings"]
    longest_possible = min(prompt_len + 32, settings.max_model_len)  # the scenario's max_tokens=32
    reserves = {"max_tokens": 4 * longest_possible, "oracle": 4 * max(finals),
                "pow2": 4 * (1 << (max(finals) - 1).bit_length())}
    for policy, (records, _) in result["policies"].items():
        column = {"max_tokens": "prompt + max_tokens", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}[policy]
        assert _final_tokens(records) == paged, policy  # paging never changes what the model computes
        # a row per sample: the prompt stored 4 times
        assert table.loc["slots used", column] == f"{sum(finals):,}", policy
        assert table.loc["slots allocated / reserved", column] == f"{reserves[policy]:,}", policy
        internal = reserves[policy] - sum(finals)
        assert table.loc["internal fragmentation (slots)", column] == f"{internal:,}", policy
        assert table.loc["engine steps", column] == str(len(records)), policy
    assert sum(finals) - (prompt_len + generated) == 3 * prompt_len  # the 3 extra copies of the prompt
    at.selectbox(key="compare_policy").set_value("oracle").run()
    assert not at.exception


# ------------------------------------------------------------------------------------------------ Playground
def apply_preset(at, preset: str, **fields) -> None:
    at.sidebar.selectbox[0].set_value(preset)
    for label, value in fields.items():
        next(w for w in list(at.sidebar.selectbox) + list(at.sidebar.number_input) if w.label == label).set_value(value)
    button(at, "Apply and reset").click().run()
    assert not at.exception


def test_reset_prefix_cache_is_refused_while_requests_run_and_works_when_idle():
    at = new_app()
    apply_preset(at, "shared-prefix")
    lab = at.session_state["lab"]
    button(at, "Step").click().run()
    cached = sum(h is not None for h in lab.run.paged.block_manager.block_hashes)
    assert cached > 0
    button(at, "Reset prefix cache").click().run()
    assert not at.exception
    assert any("requests still hold blocks; reset when the pool is idle" in w.value for w in at.sidebar.warning)
    assert sum(h is not None for h in lab.run.paged.block_manager.block_hashes) == cached  # nothing changed
    while lab.has_work():
        lab.step()
    at.run()
    cached = sum(h is not None for h in lab.run.paged.block_manager.block_hashes)
    button(at, "Reset prefix cache").click().run()
    assert not at.sidebar.warning
    assert any(f"prefix cache reset: {cached} cached blocks forgotten" in s.value for s in at.sidebar.success)
    assert all(h is None for h in lab.run.paged.block_manager.block_hashes)
    lab.add_request("ROMEO. ", SamplingParams(max_tokens=2, temperature=0))
    record, _ = lab.step()
    assert [e.data["num_blocks"] for e in record.events if e.kind == "reset_prefix_cache"] == [cached]


def test_playground_hit_rate_is_first_admissions_with_readmissions_apart():
    at = new_app()  # the batch preset: preemptions by recompute whose re-admissions hit their own blocks
    lab = at.session_state["lab"]
    while lab.has_work():
        lab.step()
    at.run()
    records = [p for p, _ in lab.run.history]
    first, both, readmission_hits = first_admission_rate(records)
    assert readmission_hits > 0 and f"{first:.1f}%" != f"{both:.1f}%"
    shown = next(m for m in at.metric if m.label == "hit rate")
    assert shown.value == f"{first:.1f}%"
    assert "first admissions only" in shown.help and f"{readmission_hits:,} hit tokens" in shown.help


def test_playground_policy_and_watermark_reach_the_engines():
    at = new_app()
    apply_preset(at, "life-of-a-request", **{"Contiguous policy": "max_tokens",
                                             "Watermark (% of the pool kept free at admission)": 0.0})
    lab = at.session_state["lab"]
    assert lab.run.contiguous.config.contiguous_policy == "max_tokens"
    assert lab.run.paged.config.watermark == 0 and lab.run.paged.config.enable_prefix_caching is False


def test_the_form_shows_the_settings_in_effect_after_a_preset_overrides_them():
    """memory-pressure fixes its watermark at 0: a typed 30 does not apply, and the form must not keep
    showing it (a teacher would believe 30% is in effect)."""
    at = new_app()
    label = "Watermark (% of the pool kept free at admission)"
    apply_preset(at, "memory-pressure", **{label: 30.0})
    assert at.session_state["lab"].run.paged.config.watermark == 0
    assert next(w for w in at.sidebar.number_input if w.label == label).value == 0
    assert any("watermark 0.0%" in c.value and "memory-pressure" in c.value for c in at.sidebar.caption)


def test_applying_settings_pauses_play():
    at = new_app()
    button(at, "Play").click().run()
    assert at.session_state["playing"]
    apply_preset(at, "single")
    assert not at.session_state["playing"] and at.session_state["lab"].step_count == 0


def test_oracle_lab_learns_final_lengths_and_notes_hand_added_requests():
    from ui.lab import POLICY_LABELS, POLICY_RESERVES, Lab
    from ui.state import preset_settings

    assert set(POLICY_LABELS) == set(POLICY_RESERVES) == set(CONTIGUOUS_POLICIES)
    lab = Lab.create(preset_settings("batch", contiguous_policy="oracle"), load_shared(EMBEDDED_MODEL))
    assert all(final is not None for _, final in lab.run.pending)
    while lab.has_work():
        lab.step()
    layout = lab.run.history[-1][1].snapshot.contiguous
    assert layout["internal_frag_slots"] == 0  # each reservation was exactly its final length
    assert lab.run.contiguous.get_output("R6").output_token_ids == lab.run.paged.get_output("R6").output_token_ids
    rid = lab.add_request("ROMEO. ", SamplingParams(max_tokens=4, temperature=0.8))  # no final length known
    assert any(note.startswith(f"{rid} is not run on the contiguous baseline") and "final length" in note
               for note in lab.run.notes)


@pytest.mark.slow
def test_internal_fragmentation_is_the_clis_number(capsys):
    """chat-workload run to completion in the Playground's lab: its last contiguous record says the same
    internal fragmentation as ``python -m engine run --scenario chat-workload --json`` (contiguous_summary)."""
    from engine.cli import main as cli_main
    from ui.lab import Lab
    from ui.state import preset_settings

    lab = Lab.create(preset_settings("chat-workload"), load_shared(EMBEDDED_MODEL))
    while lab.has_work():
        lab.step()
    shown = lab.run.history[-1][1].snapshot.contiguous["internal_frag_slots"]
    capsys.readouterr()
    assert cli_main(["run", "--scenario", "chat-workload", "--allocator", "contiguous", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["contiguous"]
    assert shown == cli["internal_frag_slots"] > 0
    assert shown == metrics.contiguous_accounting(lab.run.contiguous.block_manager.finished)["internal_frag_slots"]


# -------------------------------------------------------------------------------------------- lessons, model
def test_lessons_do_not_import_ui():
    """Not at import time (a fresh interpreter importing every lesson) and nowhere in their source (an import
    inside a function, too)."""
    import ast

    for path in sorted((ROOT / "lessons").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n == "ui" or n.startswith("ui.")], f"{path.name} imports ui"
    code = ("import sys, lessons, lessons.render, lessons.widgets, lessons.common\n"
            "from lessons import catalog\n"
            "import importlib\n"
            "[importlib.import_module(l.module_name) for l in catalog()]\n"
            "bad = sorted(m for m in sys.modules if m == 'ui' or m.startswith('ui.'))\n"
            "assert not bad, bad")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_shared_model_is_one_copy_per_process():
    first = load_shared(EMBEDDED_MODEL)
    assert load_shared(EMBEDDED_MODEL, "auto", None) is first
    assert load_shared(EMBEDDED_MODEL, str(first[0].device.type)) is first  # "auto" resolves to the same device


def test_open_in_playground_goes_through_session_state():
    """The lesson leaves its preset for the Playground, which builds the lab from it on arrival."""
    at = new_app()
    at.switch_page("lessons/l3_block_tables.py").run()
    button(at, "Open this in the Playground").click().run()
    assert not at.exception
    assert "open_preset" not in at.session_state  # consumed
    lab = at.session_state["lab"]
    assert lab.run.settings.preset == "life-of-a-request" and lab.run.settings.enable_prefix_caching is False
    assert at.title[0].value == "Playground"
