"""On stage, what a press says it did (issue 23, item 20): "Next event" with no key event left stays on the step
shown and says so (``Lab.protocol.notice``), and Play's "measured" rate is the rate at which the page shows steps
(``Lab.play_rate``), tested with a fake clock.

Why stay: a presenter pressing N after the last copy-on-write / prefix hit / preemption / swap expects what a
slide deck does after its last slide: nothing moves, and it says why. The steps had to run to find out that no
event was left; they are recorded (the slider and Step reach them), the screen keeps the moment being talked
about, and the toast says how many steps ran and that none had an event."""

from __future__ import annotations

import pytest

from engine import EMBEDDED_MODEL, SamplingParams
from engine.model_loader import load_shared
from engine.scenarios.run_spec import RunSpec
from ui.lab import Lab


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


def one_request_lab(loaded, max_tokens: int = 6) -> Lab:
    """A custom lab with one short request: no copy-on-write, prefix hit, preemption or swap in its run."""
    lab = Lab.create(RunSpec(model=EMBEDDED_MODEL, preset="custom", num_blocks=16), loaded)
    lab.add_request("ROMEO. ", SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return lab


def test_next_event_with_none_left_stays_and_says_so(loaded):
    lab = one_request_lab(loaded)
    lab.step()
    lab.step()
    assert lab.press("next") == "none-left"
    assert not lab.has_work() and not any(lab.key_events(p) for p, _ in lab.run.history)
    steps = lab.step_count
    assert steps > 2  # the rest ran (recorded) ...
    history, index, _ = lab.frame()
    assert index == 1 and history[index][0].step == 2  # ... and step 2 is still on screen
    assert lab.protocol.notices == 1
    assert lab.protocol.notice == (f"Next event: no copy-on-write, prefix-cache hit, preemption or swap is left: the "
                          f"remaining {steps - 2} steps ran to the end (recorded up to step {steps}: the slider "
                          f"and Step show them); still showing step 2")
    # once more, looking back at step 2 with the run finished: nothing moves, the press is said ignored
    assert lab.press("next") == "ignored" and lab.player.cursor == 1 and lab.step_count == steps
    assert "no copy-on-write" in lab.protocol.ignored_why and "after step 2" in lab.protocol.ignored_why
    assert lab.press("forward") == "forward"  # the recorded steps are there to walk through


def test_next_event_from_nothing_run_shows_the_end(loaded):
    """Nothing on screen yet: nothing to stay on; it shows the last step and says the run had no event."""
    lab = one_request_lab(loaded, max_tokens=3)
    assert lab.press("next") == "none-left"
    assert lab.player.cursor == -1 and not lab.has_work()
    assert f"showing step {lab.step_count}" in lab.protocol.notice and "is left" in lab.protocol.notice


def test_next_event_with_none_in_max_run_steps_stays_and_says_how_far(loaded, monkeypatch):
    monkeypatch.setattr("ui.lab.MAX_RUN_STEPS", 2)
    lab = one_request_lab(loaded, max_tokens=8)
    lab.step()
    assert lab.press("next") == "none-left"
    assert lab.step_count == 3 and lab.has_work() and lab.player.cursor == 0
    assert lab.protocol.notice == ("Next event: none in the next 2 steps (run and recorded, up to step 3); still showing "
                          "step 1: press N again to look further")
    assert lab.press("next") == "none-left"  # looking back, no later recorded event: searches on from step 3
    assert lab.step_count == 5 and lab.player.cursor == 0 and lab.protocol.notices == 2


def test_next_event_still_stops_at_an_event_after_looking_back(loaded):
    """Looking back with no later recorded event but work left: the search runs on, and an event found is
    shown (here: a second request whose prompt is in the prefix cache)."""
    lab = one_request_lab(loaded, max_tokens=20)
    for _ in range(3):
        lab.step()
    lab.add_request("ROMEO. " * 12, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    lab.step()
    lab.add_request("ROMEO. " * 12, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    lab.seek(0)
    assert lab.press("next") == "next"
    assert lab.player.cursor == -1 and "prefix_hit" in lab.key_events(lab.run.history[-1][0]) and lab.protocol.notices == 0


def test_play_rate_is_the_rate_at_which_the_page_shows_steps(loaded):
    """At 8 steps per second, a page that takes 0.15 s per redraw: each tick runs the steps it owes and the
    page draws the last of them. The rate said is the steps the screen advanced (the step number last drawn
    less the one before Play) over the seconds to that drawing: what a viewer counts on the step counter. Not
    the drawings per second (6.7: issue 23's second trial saw "3.5 measured" while the counter advanced 8.5
    steps a second), and not the steps run up to now (the issue's first trial: "7.9 measured" while the page
    showed 6.8)."""
    lab = one_request_lab(loaded, max_tokens=40)
    lab.set_play_speed(8)
    assert lab.press("play") == "play"
    t0 = lab.player.clock[0]
    now, drawn = t0, []
    while now < t0 + 2.0:
        assert lab.play_tick(now=now) >= 1
        now += 0.15  # the redraw takes 0.15 s
        step = lab.frame()[0][-1][0].step
        lab.play_drawn(step, now=now)
        lab.play_drawn(step, now=now + 0.01)  # a redraw of the same step (a press that moved nothing): once
        drawn.append((now, step))
    assert lab.play_rate() == pytest.approx(drawn[-1][1] / (drawn[-1][0] - t0))
    assert lab.play_rate() > 7.5 > 1 / 0.15 == pytest.approx(len(drawn) / (drawn[-1][0] - t0))
    ran = lab.player.clock[1]
    assert ran > len(drawn)  # the pace was kept by running steps that were not drawn on their own
    assert lab.play_pace(now=now) == pytest.approx(ran / (now - t0))
    assert lab.play_pace(now=now) >= lab.play_rate()  # the screen lags the steps run by one drawing


def test_play_rate_waits_a_second_and_restarts_with_play(loaded):
    lab = one_request_lab(loaded, max_tokens=40)
    assert lab.press("play") == "play"
    t0 = lab.player.clock[0]
    lab.play_tick(now=t0)
    lab.play_drawn(1, now=t0 + 0.5)
    assert lab.play_rate() is None  # under a second: no rate yet
    lab.play_tick(now=t0 + 1.2)
    lab.play_drawn(2, now=t0 + 1.25)
    assert lab.play_rate() == pytest.approx(2 / 1.25)
    assert lab.press("play") == "pause" and lab.play_rate() is None
    lab.play_drawn(3, now=t0 + 2.0)  # drawn while paused: not Play's
    assert lab.press("play") == "play" and lab.player.shown[0] == 0


def test_the_page_counts_what_it_draws_while_playing(loaded):
    """The Playground tells the lab each step it drew while playing (``views`` -> ``Lab.play_drawn``), and
    says what a Next event that found none did, in a toast."""
    from streamlit.testing.v1 import AppTest

    from test_app import APP

    at = AppTest.from_file(APP, default_timeout=300)
    at.run()
    lab = at.session_state["lab"]
    lab.set_play_speed(2)
    at.button(key="stage_play").click().run()
    assert not at.exception and lab.player.playing
    shown, last, _ = lab.player.shown
    assert shown == 1 and last == lab.run.history[-1][0].step
    at.button(key="stage_play").click().run()
    assert not lab.player.playing
    # Next event with none left, clicked on the page: the toast says so, the caption stays on step 1
    quiet = one_request_lab(loaded)
    quiet.step()
    at.session_state["lab"] = quiet
    at.run()
    at.button(key="stage_next").click().run()
    assert not at.exception and not quiet.has_work()
    assert any("no copy-on-write" in t.value and "still showing step 1" in t.value for t in at.toast)
    assert at.caption[0].value.startswith(f"step 1 of {quiet.step_count}")
