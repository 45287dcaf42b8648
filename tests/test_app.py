"""The Streamlit app under streamlit.testing.v1.AppTest."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL
APP = str(Path(__file__).resolve().parent.parent / "app.py")


def app_pages(app: str = APP) -> list[str]:
    """The page files ``app.py``'s navigation lists as literals (``st.Page("ui/....py", ...)``), read from its
    source: the one list of the app's pages (the lesson pages come from ``lessons.catalog()``, tested in
    tests/test_lessons.py)."""
    tree = ast.parse(Path(app).read_text(encoding="utf-8"))
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "Page" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)]


PAGES = app_pages()


def new_app(timeout: float = 180) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=timeout)
    at.run()
    assert not at.exception
    return at


def button(at, label):
    return next(b for b in at.button if b.label == label)


def metrics(at) -> dict:
    return {m.label: m.value for m in at.metric}


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs(page):
    at = new_app()
    at.switch_page(page).run()
    assert not at.exception
    assert at.title


def test_step_changes_state_and_numbers():
    at = new_app()
    lab = at.session_state["lab"]
    assert lab.step_count == 0
    for step in (1, 2):
        button(at, "Step").click().run()
        assert not at.exception
        assert lab.step_count == step
        snap = lab.run.history[-1][0].snapshot
        shown = metrics(at)
        assert shown["running"] == str(len(snap.running))
        assert shown["free blocks"] == f"{snap.num_free_blocks}/{snap.num_blocks}"
        assert at.caption[0].value.startswith(f"step {step} of {step}")
    first, second = lab.run.history[0][0].snapshot, lab.run.history[1][0].snapshot
    assert [s.token_ids for s in first.sequences] != [s.token_ids for s in second.sequences]


def test_back_then_forward_shows_the_identical_snapshot():
    at = new_app()
    for _ in range(3):
        button(at, "Step").click().run()
    lab = at.session_state["lab"]
    latest = copy.deepcopy(lab.run.history[-1][0].snapshot)  # a copy: the recorded one must not change
    shown_before = metrics(at)
    button(at, "Back").click().run()
    assert at.session_state["cursor"] == 1 and lab.step_count == 3  # nothing re-ran
    assert metrics(at) != shown_before  # the page shows step 2
    button(at, "Forward").click().run()  # replays the recorded step
    assert lab.step_count == 3 and len(lab.run.history) == 3
    assert metrics(at) == shown_before
    shown = lab.run.history[at.session_state["cursor"]][0].snapshot if at.session_state["cursor"] >= 0 \
        else lab.run.history[-1][0].snapshot
    assert shown == latest


def test_a_preset_runs_to_completion_by_repeated_step():
    at = new_app()
    at.sidebar.selectbox[0].set_value("parallel-sampling")
    [b for b in at.button if b.label == "Apply and reset"][0].click().run()
    lab = at.session_state["lab"]
    assert lab.run.settings.preset == "parallel-sampling" and lab.run.settings.num_blocks == 32
    for _ in range(200):
        if not lab.has_work():
            break
        button(at, "Step").click().run()
        assert not at.exception
    assert not lab.has_work()
    assert lab.run.paged.block_manager.num_free_blocks == lab.run.paged.num_blocks
    assert any("all requests finished" in c.value for c in at.caption)


def test_bad_settings_show_an_error_and_keep_the_lab():
    at = new_app()
    lab = at.session_state["lab"]
    at.sidebar.number_input[0].set_value(0)  # block size 0
    at.sidebar.checkbox[1].set_value(False)  # use the form's pool settings, not the preset's
    form_submit = [b for b in at.button if b.label == "Apply and reset"][0]
    form_submit.click().run()
    assert not at.exception
    assert any("block_size must be a positive integer, got 0" in e.value for e in at.error)
    assert at.session_state["lab"] is lab


def test_empty_prompt_shows_an_error():
    at = new_app()
    at.sidebar.text_area[0].set_value("")
    [b for b in at.button if b.label.startswith("Add request")][0].click().run()
    assert not at.exception
    assert any("prompt is empty" in e.value for e in at.error)


def test_two_sessions_are_independent():
    a, b = new_app(), new_app()
    button(a, "Step").click().run()
    button(a, "Step").click().run()
    assert a.session_state["lab"].step_count == 2
    assert b.session_state["lab"].step_count == 0
    assert a.session_state["lab"].run.paged is not b.session_state["lab"].run.paged
    # the weights are shared read-only
    assert a.session_state["lab"].run.paged.model is b.session_state["lab"].run.paged.model


def test_unknown_model_offline_is_an_error_in_the_page():
    at = new_app()
    lab = at.session_state["lab"]
    at.sidebar.text_input[0].set_value("HuggingFaceTB/SmolLM2-135M")
    [b for b in at.button if b.label == "Apply and reset"][0].click().run()
    assert not at.exception
    assert any("HuggingFaceTB/SmolLM2-135M" in e.value and "embedded default" in e.value for e in at.error)
    assert at.session_state["lab"] is lab


def test_kv_budget_sizes_the_pool():
    at = new_app()
    at.sidebar.number_input[2].set_value(3.0)  # MiB
    at.sidebar.checkbox[1].set_value(False)
    [b for b in at.button if b.label == "Apply and reset"][0].click().run()
    assert not at.exception
    lab = at.session_state["lab"]
    per_block = lab.run.paged.geometry.bytes_per_block(lab.run.paged.block_size)
    assert lab.run.paged.num_blocks == (3 * 2**20) // per_block != 64
    assert lab.run.contiguous.kv_cache.nbytes == lab.run.paged.kv_cache.nbytes


def test_an_emptied_model_field_means_the_embedded_model():
    """The field's label says "embedded default": clearing it applies that, not a load error for ''."""
    at = new_app()
    at.sidebar.text_input[0].set_value("  ")
    [b for b in at.button if b.label == "Apply and reset"][0].click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.session_state["lab"].run.settings.model == EMBEDDED_MODEL
