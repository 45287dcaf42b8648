"""The Playground on stage: steps run one at a time and never half way, every press is one step (or is
ignored and said so), and a preset always means the same run whatever was applied before.

Unit tests drive the ``Lab`` from several threads at once, as Streamlit does when a second event (a double
click, a key, a Play tick) starts a new script run while the last one is still stepping; AppTest tests drive
the page. The real browser (keys whatever has the focus, double clicks, presses during Play) is in
``tests/test_browser_stage.py``."""

from __future__ import annotations

import dataclasses
import random
import sys
import threading

import pytest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from engine.scenarios.presets import SCENARIOS
from ui.lab import Lab, fit_semantics
from ui.state import applied_settings, form_values, preset_settings

PRESETS = list(SCENARIOS)


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


def batch_lab(loaded) -> Lab:
    """The default preset: six requests in 12 blocks of 16, with preemptions (many steps of work)."""
    return Lab.create(preset_settings("batch"), loaded)


def steps_of_work(loaded, preset: str = "batch") -> int:
    """How many steps the preset runs to completion (a headless lab of the same settings)."""
    lab = Lab.create(preset_settings(preset), loaded)
    while lab.has_work():
        lab.step()
    return lab.step_count


def assert_in_step(lab: Lab, steps: int) -> None:
    """``steps`` steps recorded, each one whole: both engines at the same step as the records, in order, and
    the paged pool's blocks add up (free + in use == all) in every record and in the engine."""
    assert lab.step_count == steps
    assert lab.run.paged.step_count == steps
    assert lab.run.contiguous is not None and lab.run.contiguous.step_count == steps  # the baseline in step
    assert [p.step for p, _ in lab.run.history] == list(range(1, steps + 1))
    assert [c.step for _, c in lab.run.history] == list(range(1, steps + 1))
    for paged, _ in lab.run.history:
        snap = paged.snapshot
        used = sum(1 for r in snap.ref_counts if r > 0)
        assert snap.num_free_blocks + used == snap.num_blocks, paged.step
    bm = lab.run.paged.block_manager
    assert bm.num_free_blocks + sum(1 for r in bm.ref_counts if r > 0) == bm.num_blocks
    assert bm.invariant_violations() == []


def run_threads(target, args_list) -> list[BaseException]:
    """Start one thread per argument tuple at the same moment (a barrier); the exceptions they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(args_list))

    def run(*args):
        try:
            barrier.wait()
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - any failure in a thread must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=args) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return errors


# ------------------------------------------------------------------------------------------- the lock
def test_two_threads_pressing_step_at_once_run_every_press_once(loaded):
    """Two script runs pressing Step at once (a double click, PageDown during Play): every press is one whole
    step of both engines, recorded; none lost, none interleaved, the baseline in step."""
    assert steps_of_work(loaded) > 24
    lab = batch_lab(loaded)
    outcomes: list[str] = []

    def press(times):
        for _ in range(times):
            outcomes.append(lab.press("forward"))

    assert run_threads(press, [(12,), (12,)]) == []
    assert outcomes == ["stepped"] * 24 and lab.protocol.ignored == 0
    assert_in_step(lab, 24)


def test_step_and_play_ticks_from_threads_at_once(loaded):
    """``step`` (the lessons' and tests' API), Play ticks and presses from four threads at once."""
    lab = batch_lab(loaded)
    assert lab.press("play") == "play"
    errors = run_threads(lambda f, n: [f() for _ in range(n)],
                         [(lab.step, 5), (lab.play_tick, 5), (lambda: lab.press("forward"), 5), (lab.step, 5)])
    assert errors == []
    assert_in_step(lab, 20)


def test_presses_counted_in_the_browser_run_exactly_once_however_many_runs_see_them(loaded):
    """The browser hands each script run the running total of presses; runs that start while others are
    still stepping see older, equal or newer totals, in any order. Each press runs exactly once."""
    lab = batch_lab(loaded)
    totals = [n for n in range(1, 21) for _ in range(3)]  # every total seen by three runs
    random.Random(0).shuffle(totals)
    log = "F" * 20
    errors = run_threads(lambda chunk: [lab.take_presses(lab.protocol.token, n, log[:n]) for n in chunk],
                         [(totals[i::6],) for i in range(6)])
    assert errors == []
    assert lab.protocol.handled == 20 and lab.protocol.ignored == 0
    assert_in_step(lab, 20)


def test_a_total_for_another_lab_or_not_a_count_runs_nothing(loaded):
    lab = batch_lab(loaded)
    assert lab.take_presses("another lab", 3, "FFF") == 0
    assert lab.take_presses(lab.protocol.token, "3", "FFF") == 0
    assert lab.take_presses(lab.protocol.token, True, "F") == 0
    assert lab.take_presses(lab.protocol.token, 3, None) == 0
    assert lab.step_count == 0 and lab.protocol.handled == 0
    assert lab.take_presses(lab.protocol.token, 2, "FF") == 2 and lab.step_count == 2
    assert lab.take_presses(lab.protocol.token, 2, "FF") == 0 and lab.step_count == 2  # the same total again
    assert lab.take_presses(lab.protocol.token, 1, "F") == 0 and lab.step_count == 2  # an older one


def test_presses_in_order_forward_back_and_what_is_ignored(loaded):
    """F F F B B F: three steps, back to step 1, forward to step 2 (replayed, nothing re-runs). Presses the
    log no longer holds are counted as ignored, with the reason."""
    lab = batch_lab(loaded)
    assert lab.take_presses(lab.protocol.token, 6, "FFFBBF") == 6
    assert lab.step_count == 3 and lab.player.cursor == 1
    assert lab.take_presses(lab.protocol.token, 7, "F") == 1
    assert lab.step_count == 3 and lab.player.cursor == -1  # back at the latest step: follows it again
    assert lab.take_presses(lab.protocol.token, 10, "F") == 3  # two presses the log does not hold, then one step
    assert lab.step_count == 4 and lab.protocol.ignored == 2 and "more presses at once" in lab.protocol.ignored_why


def test_back_at_the_first_step_and_step_after_the_end_are_ignored_and_said(loaded):
    lab = Lab.create(preset_settings("single"), loaded)
    assert lab.press("back") == "ignored" and "nothing has run yet" in lab.protocol.ignored_why
    while lab.has_work():
        assert lab.press("forward") == "stepped"
    steps = lab.step_count
    assert lab.press("forward") == "ignored" and "all requests have finished" in lab.protocol.ignored_why
    assert lab.step_count == steps and lab.protocol.ignored == 2
    lab.seek(0)
    assert lab.press("back") == "ignored" and "already at the first step" in lab.protocol.ignored_why
    assert lab.press("forward") == "forward" and lab.player.cursor == 1 and lab.step_count == steps


def test_play_is_a_press_and_stops_when_nothing_is_left(loaded):
    """Play / Pause toggle ``playing`` in order with the other presses (P P: still paused); a tick steps
    only while playing; when the work is done the tick stops Play, and Play on a finished run is ignored."""
    lab = Lab.create(preset_settings("single"), loaded)
    assert lab.take_presses(lab.protocol.token, 2, "PP") == 2 and not lab.player.playing
    assert lab.play_tick() == 0 and lab.step_count == 0  # paused: a late tick runs nothing
    assert lab.press("play") == "play" and lab.player.playing
    while lab.play_tick():
        pass
    assert not lab.player.playing and not lab.has_work()
    assert lab.press("play") == "ignored" and "all requests have finished" in lab.protocol.ignored_why
    assert_in_step(lab, lab.step_count)


def test_the_step_unit_makes_no_streamlit_call(loaded):
    """Streamlit stops a script run only inside a Streamlit call (a yield point: ``st.*``, session state).
    The unit of a press, a Play tick and a browser total (paged step, baseline step, record) makes none, so a
    stopped run never leaves half a step behind: it finishes the unit, then stops at its next drawing."""
    lab = batch_lab(loaded)
    lab.step()  # the first step builds what it builds once (kernels, caches): measured below too
    called: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module == "streamlit" or module.startswith("streamlit."):
                called.add(f"{module}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        lab.press("forward")
        lab.press("play")
        lab.play_tick()
        lab.take_presses(lab.protocol.token, 2, "FB")
        lab.frame()
    finally:
        sys.setprofile(None)
    assert called == set()
    assert lab.step_count == 4 and lab.player.cursor == 2


def test_a_failed_step_stops_the_lab_and_says_so(loaded, monkeypatch):
    """The baseline raises after the paged engine stepped: nothing is recorded as if in step, no exception
    reaches the stage, every later press is ignored with the reason, and Play stops."""
    lab = batch_lab(loaded)
    lab.press("forward")

    def broken():
        raise IndexError("list index out of range")

    monkeypatch.setattr(lab.run.contiguous, "step", broken)
    assert lab.press("forward") == "ignored"
    assert lab.run.failure == "step 2 raised IndexError: list index out of range"
    assert lab.step_count == 1  # the half step is not recorded
    assert lab.press("forward") == "ignored" and "stopped after an error" in lab.protocol.ignored_why
    assert lab.play_tick() == 0
    with pytest.raises(RuntimeError, match="stopped after an error"):
        lab.step()


# ------------------------------------------------------------------------------------ presets are pure
def apply_untouched(current, preset: str):
    """"Apply and reset" for ``preset`` with the tick and the form as it opened (nothing changed), fitted to
    its semantics as ``Lab.create`` does: what the lab then runs."""
    return fit_semantics(applied_settings(current, preset, form_values(current), use_preset=True))[0]


def configs(settings) -> tuple:
    return settings, settings.engine_config("paged"), settings.engine_config("contiguous")


def test_every_preset_after_every_other_preset_is_the_same_run():
    """Applying preset X gives X's own settings and engine configs whatever was applied before (after "swap",
    "batch" used to run by swap; after "life-of-a-request", caching stayed off)."""
    start = preset_settings("batch")
    for before in PRESETS:
        current = apply_untouched(start, before)
        assert configs(current) == configs(fit_semantics(preset_settings(before))[0]), before
        for preset in PRESETS:
            expected = configs(fit_semantics(preset_settings(preset))[0])
            assert configs(apply_untouched(current, preset)) == expected, (before, preset)


def test_a_preset_after_changed_settings_is_still_the_preset():
    """Whatever was changed for the run before (another semantics, caching, preemption, watermark, seed,
    policy, a hand-made pool without the tick), a different preset applied untouched is that preset."""
    start = preset_settings("batch")
    changes = [dict(semantics="v1"), dict(enable_prefix_caching=False), dict(preemption_mode="swap"),
               dict(watermark_pct=7.5), dict(seed=3), dict(contiguous_policy="oracle"),
               dict(semantics="v1", scheduling_policy="priority", max_num_batched_tokens=32)]
    for change in changes:
        for use_preset in (True, False):
            chosen = {**form_values(start, change.get("semantics")), **change}
            current = fit_semantics(applied_settings(start, "swap", chosen, use_preset=use_preset))[0]
            for preset in ("batch", "shared-prefix", "memory-pressure"):
                expected = configs(fit_semantics(preset_settings(preset))[0])
                assert configs(apply_untouched(current, preset)) == expected, (change, use_preset, preset)


def test_what_is_changed_in_the_form_applies_unless_the_preset_fixes_it():
    start = preset_settings("swap")
    shown = form_values(start)
    # changed: applies on top of the preset
    batch = applied_settings(start, "batch", {**shown, "enable_prefix_caching": False, "seed": 2})
    assert batch == dataclasses.replace(preset_settings("batch"), enable_prefix_caching=False, seed=2)
    # the preset fixes its watermark and prefix caching: they win, as the tick says
    pressure = applied_settings(start, "memory-pressure", {**shown, "watermark_pct": 30.0,
                                                           "enable_prefix_caching": True})
    assert pressure == preset_settings("memory-pressure")
    # the pool comes from the preset with the tick, from the form without it
    pool = {**shown, "block_size": 32, "num_blocks": 7}
    assert applied_settings(start, "batch", pool) == preset_settings("batch")
    assert (applied_settings(start, "batch", pool, use_preset=False).block_size,
            applied_settings(start, "batch", pool, use_preset=False).num_blocks) == (32, 7)
    # the semantics switch above the form is a change too
    v1 = applied_settings(start, "batch", {**form_values(start, "v1"), "semantics": "v1"})
    assert v1 == dataclasses.replace(preset_settings("batch"), semantics="v1")
    # re-applying the preset in effect keeps what was changed for it (the form shows it)
    again = applied_settings(batch, "batch", form_values(batch))
    assert again == batch


# ---------------------------------------------------------------------------------------------- AppTest
def new_app():
    from streamlit.testing.v1 import AppTest

    from test_app import APP

    at = AppTest.from_file(APP, default_timeout=300)
    at.run()
    assert not at.exception
    return at


def test_step_and_back_are_presses_with_keys_the_browser_counter_finds():
    """The buttons carry the keys the browser's press counter takes over (``st-key-stage_step`` etc.);
    each click is one press; the lab's cursor and its mirror agree."""
    at = new_app()
    lab = at.session_state["lab"]
    for _ in range(3):
        at.button(key="stage_step").click().run()
    assert not at.exception and lab.step_count == 3
    at.button(key="stage_back").click().run()
    assert at.session_state["cursor"] == lab.player.cursor == 1
    assert at.button(key="stage_step").label == "Forward"
    at.button(key="stage_step").click().run()
    assert lab.step_count == 3 and lab.player.cursor == -1 and at.button(key="stage_step").label == "Step"
    assert at.button(key="stage_play").label == "Play"
    assert_in_step(lab, 3)


def test_presses_handed_over_by_the_browser_counter_run_in_the_page():
    """What the browser's counter leaves in the session (the component's state) runs at the top of the next
    script run, before anything is drawn: the caption shows the last step."""
    at = new_app()
    lab = at.session_state["lab"]
    at.session_state["stage_keys"] = {"presses": {"token": lab.protocol.token, "n": 4, "log": "FFFF"}}
    at.run()
    assert not at.exception
    assert lab.protocol.handled == 4 and lab.step_count == 4
    assert at.caption[0].value.startswith("step 4 of 4")
    at.run()  # the same total in a later run: nothing more
    assert lab.step_count == 4
    assert_in_step(lab, 4)


def test_an_ignored_press_is_said():
    at = new_app()
    at.sidebar.selectbox[0].set_value("single")
    next(b for b in at.button if b.label == "Apply and reset").click().run()
    lab = at.session_state["lab"]
    while lab.has_work():
        lab.step()
    at.button(key="stage_step").click().run()
    assert not at.exception
    assert any("1 press ignored: Step: all requests have finished" in t.value for t in at.toast)


def test_applying_swap_then_batch_in_the_form_runs_batch_as_described():
    """The trial's case: after "swap", "batch" (described as recompute) ran by swap; after a preset with
    prefix caching off, "shared-prefix" ran without it, unlike its lesson."""
    at = new_app()
    for before, preset in (("swap", "batch"), ("life-of-a-request", "shared-prefix")):
        for name in (before, preset):
            at.sidebar.selectbox[0].set_value(name)
            next(b for b in at.button if b.label == "Apply and reset").click().run()
            assert not at.exception
        lab = at.session_state["lab"]
        expected = fit_semantics(preset_settings(preset))[0]
        assert lab.run.settings == expected
        assert (lab.run.paged.config, lab.run.contiguous.config) == (expected.engine_config("paged"), expected.engine_config("contiguous"))
    assert lab.run.paged.config.enable_prefix_caching is True  # as lessons.common.scenario_run runs it
    assert SCENARIOS["batch"].engine_defaults.get("preemption_mode", "recompute") == "recompute"
