"""Scenario links and files in the Playground under AppTest: a URL's ``?scenario=...&step=N`` opens that run at
that step in a fresh session, the URL follows the run, and a file chosen in the sidebar replaces the run."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from engine.scenarios import scenario_file as sf
from ui.lab import fit_semantics
from ui.scenario_io import lab_scenario
from ui.state import preset_settings

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def open_app(**query) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    for name, value in query.items():
        at.query_params[name] = value
    at.run()
    assert not at.exception, at.exception
    return at


def param(at, name):
    value = at.query_params.get(name)
    return value[0] if isinstance(value, list) else value


def button(at, label):
    return next(b for b in at.button if b.label == label)


def test_a_preset_link_opens_that_preset_at_that_step_and_the_url_follows_the_run():
    at = open_app(scenario="swap", step="7", other="kept")
    lab = at.session_state["lab"]
    assert lab.run.settings == fit_semantics(preset_settings("swap"))[0]
    assert lab.steps_run == 7 and not at.error
    assert at.caption[0].value.startswith("step 7 of 7")
    assert (param(at, "scenario"), param(at, "step"), param(at, "other")) == ("swap", "7", "kept")
    button(at, "Back").click().run()
    assert param(at, "step") == "6" and lab.steps_run == 7  # the step on screen; nothing re-ran
    button(at, "Forward").click().run()
    button(at, "Step").click().run()
    assert param(at, "step") == "8"
    assert any("?scenario=swap&step=8" in c.value for c in at.sidebar.code)


def test_a_custom_request_in_a_link_opens_the_same_run_in_a_fresh_session():
    at = open_app(scenario="batch", step="2")
    at.sidebar.text_area[0].set_value("HAMLET. Who is there?")
    next(b for b in at.button if b.label.startswith("Add request")).click().run()
    assert not at.error, [e.value for e in at.error]
    for _ in range(3):
        button(at, "Step").click().run()
    lab = at.session_state["lab"]
    code, step = param(at, "scenario"), param(at, "step")
    assert code != "batch" and step == "5"  # a request added by hand: the whole scenario is in the link
    assert [r.arrival_step for r in lab_scenario(lab).requests] == [0] * 6 + [2]

    fresh = open_app(scenario=code, step=step)
    again = fresh.session_state["lab"]
    assert again is not lab and again.run.settings.preset == "custom"
    assert lab_scenario(again) == lab_scenario(lab)
    assert again.steps_run == 5
    assert again.run.history[-1][0].snapshot == lab.run.history[-1][0].snapshot
    assert again.run.history[-1][1].snapshot == lab.run.history[-1][1].snapshot
    assert fresh.caption[0].value == at.caption[0].value  # "step 5 of 5 (...)"
    assert param(fresh, "scenario") == code and param(fresh, "step") == "5"


@pytest.mark.parametrize("query, said, steps", [
    ({"scenario": "eJzLSM3JyQcABiwCFQ"},
     "This link's scenario 'eJzLSM3JyQcABiwCFQ' cannot be opened: the scenario link is damaged", 0),
    ({"scenario": sf.encode_link(sf.parse_scenario({"name": "x", "requests": [{"prompt": "a"}]}))[:-6]},
     "cannot be opened", 0),
    ({"scenario": "batch", "step": "5000"}, "step 5,000 is more than the 2,000 steps a link may run", 0),
    ({"scenario": "single", "step": "400"}, "This link asks for step 400, but the run ends at step", None),
])
def test_a_bad_link_says_why_and_the_page_still_runs(query, said, steps):
    at = open_app(**query)
    assert any(said in e.value for e in at.error), [e.value for e in at.error]
    lab = at.session_state["lab"]
    if steps is not None:
        assert lab.steps_run == steps
    else:  # ran to the end of the preset's run, and says which step that is
        assert not lab.has_work() and f"ends at step {lab.steps_run}" in at.error[0].value


def test_a_link_with_a_bad_field_names_it():
    data = {"name": "x", "requests": [{"prompt": "a", "max_tokens": 0}]}
    code = base64.urlsafe_b64encode(zlib.compress(json.dumps(data).encode())).decode().rstrip("=")
    at = open_app(scenario=code)
    assert any("requests.0.max_tokens: must be >= 1, got 0" in e.value for e in at.error)
    assert at.session_state["lab"].run.settings.preset == "batch"  # the default lab


def test_a_scenario_file_chosen_in_the_sidebar_replaces_the_run():
    at = open_app()
    before = at.session_state["lab"]
    bad = "name: mine\nrequests:\n  - prompt: 'HAMLET. '\n    max_tokens: 0\n"
    at.file_uploader[0].upload("mine.yaml", bad.encode(), "application/yaml").run()
    assert any("mine.yaml cannot be opened: requests.0.max_tokens: must be >= 1, got 0" in e.value for e in at.error)
    assert at.session_state["lab"] is before

    good = sf.parse_scenario({"name": "mine", "settings": {"num_blocks": 20, "block_size": 8, "max_model_len": 96},
                              "requests": [{"prompt": "HAMLET. ", "max_tokens": 5, "temperature": 0.0},
                                           {"arrival_step": 2, "prompt": "ROMEO. ", "max_tokens": 3, "seed": 4}]})
    at.file_uploader[0].upload("mine.yaml", sf.dump_scenario(good, "yaml").encode(), "application/yaml").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    lab = at.session_state["lab"]
    assert lab is not before and lab.run.settings.preset == "custom" and lab.run.settings.scenario == good
    assert lab.run.paged.num_blocks == 20 and lab.run.paged.block_size == 8
    assert lab_scenario(lab) == good
    for _ in range(3):
        button(at, "Step").click().run()
    assert lab.run.order == ["R1", "R2"] and [r.arrival_step for _, r in lab.run.arrivals] == [0, 2]
    assert sf.decode_link(param(at, "scenario")) == good and param(at, "step") == "3"


def test_the_slider_drags_to_any_recorded_step_even_one_just_shown():
    """A drag is honoured whatever the position (only a stale echo that comes with a press is not: the browser
    test presses Back and PageUp fast); here to a step the page showed a moment ago."""
    at = open_app(scenario="batch", step="4")
    button(at, "Back").click().run()
    assert at.caption[0].value.startswith("step 3 of 4")
    at.slider(key="scrub").set_value(4).run()  # back to the step shown before the Back, at once
    assert at.caption[0].value.startswith("step 4 of 4") and param(at, "step") == "4"
    at.slider(key="scrub").set_value(1).run()
    assert at.caption[0].value.startswith("step 1 of 4") and not at.exception


def test_a_pool_size_the_preset_overrides_is_named_with_its_value():
    at = open_app()
    next(n for n in at.sidebar.number_input if n.label == "Pool (blocks)").set_value(300000)
    button(at.sidebar, "Apply and reset").click().run()
    assert any("num_blocks 300000 not applied" in w.value for w in at.warning), [w.value for w in at.warning]
