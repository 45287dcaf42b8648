"""Running long presets on stage: Play keeps to the speed it says, "Next event" stops at the next
copy-on-write / prefix hit / preemption / swap, "Run to the end" runs everything, all as presses of the
``Lab`` (atomic, in order with the others, each once)."""

from __future__ import annotations

import pytest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from ui.lab import KEY_EVENT_KINDS, MAX_PLAY_CATCH_UP, Lab
from ui.state import preset_settings


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


def full_run(loaded, preset: str) -> Lab:
    lab = Lab.create(preset_settings(preset), loaded)
    while lab.has_work():
        lab.step()
    return lab


def key_steps(lab: Lab) -> list[int]:
    """0-based indices of the recorded steps whose paged record holds a key event, found by reading every
    event (independently of ``Lab.key_events``)."""
    return [i for i, (p, _) in enumerate(lab.run.history)
            if any(e.kind in KEY_EVENT_KINDS and not (e.kind == "prefix_hit" and e.data.get("readmission"))
                   for e in p.events)]


@pytest.mark.parametrize("preset", ["parallel-sampling", "shared-prefix", "batch", "swap"])
def test_next_event_stops_at_each_key_step_in_turn(loaded, preset):
    """From a fresh lab, each "next" press runs up to and including the next step with a key event: the
    steps it stops at are exactly those of a plain run; after the last one it runs the rest to the end (when
    there is a rest) but stays on the last event's step and says none is left."""
    plain = full_run(loaded, preset)
    expected = key_steps(plain)
    assert expected, f"{preset} has no key event to stop at"
    lab = Lab.create(preset_settings(preset), loaded)
    stops = []
    while lab.has_work():
        did = lab.press("next")
        if did == "none-left":
            break
        assert did == "next" and lab.player.cursor == -1
        stops.append(lab.step_count - 1)
    assert stops == expected
    assert not lab.has_work() and lab.step_count == plain.step_count
    if expected[-1] < plain.step_count - 1:  # steps after the last event: run, the screen stays on the event
        assert lab.player.cursor == expected[-1] and lab.protocol.notices == 1 and "is left" in lab.protocol.notice
    assert lab.press("next") == "ignored" and "finished" in lab.protocol.ignored_why


def test_next_event_while_looking_back_moves_the_cursor_only(loaded):
    lab = full_run(loaded, "batch")
    steps = lab.step_count
    expected = key_steps(lab)
    lab.seek(0)
    seen = []
    while lab.player.cursor != -1:
        did = lab.press("next")
        if did == "ignored":  # past the last event of a finished run: it stays there and says why
            assert "no copy-on-write" in lab.protocol.ignored_why, lab.protocol.ignored_why
            break
        assert did == "next"
        seen.append(lab.player.cursor if lab.player.cursor >= 0 else steps - 1)
    assert lab.step_count == steps  # nothing re-ran
    assert seen == [i for i in expected if i > 0]


def test_run_to_the_end_runs_every_step_once(loaded):
    plain = full_run(loaded, "batch")
    lab = Lab.create(preset_settings("batch"), loaded)
    lab.step()
    assert lab.take_presses(lab.protocol.token, 1, "E") == 1
    assert not lab.has_work() and lab.step_count == plain.step_count and lab.player.cursor == -1
    assert [p.new_tokens for p, _ in lab.run.history] == [p.new_tokens for p, _ in plain.run.history]
    assert lab.press("end") == "ignored"


def test_play_keeps_its_speed_when_ticks_come_late(loaded):
    """At 8 steps per second, ticks 1 s apart run 8 steps each (the first tick 1); a tick long overdue runs
    at most ``MAX_PLAY_CATCH_UP``; the pace is steps run over seconds since Play started."""
    lab = Lab.create(preset_settings("batch"), loaded)
    lab.set_play_speed(8)
    assert lab.press("play") == "play"
    t0 = lab.player.clock[0]
    assert lab.play_tick(now=t0) == 1
    assert lab.play_tick(now=t0 + 1.0) == 8  # due: int(1.0 * 8) + 1 = 9 steps by now, 1 done
    assert lab.play_tick(now=t0 + 2.0) == 8
    assert lab.play_pace(now=t0 + 2.0) == pytest.approx(17 / 2.0)
    assert lab.play_tick(now=t0 + 100.0) == MAX_PLAY_CATCH_UP
    assert lab.step_count == 17 + MAX_PLAY_CATCH_UP
    with pytest.raises(ValueError, match="play speed"):
        lab.set_play_speed(0)


def test_finished_requests_keep_their_text_on_screen(loaded):
    """batch: the paged side finishes long before the baseline; at the last step every request's final
    text is still listed (``latest_sequences``), equal to the engine's output."""
    from viz.steps import latest_sequences

    lab = full_run(loaded, "batch")
    paged_records = [p for p, _ in lab.run.history]
    assert not paged_records[-1].snapshot.sequences  # the last snapshot alone has nothing left to show
    shown = {s.seq_id: s for s in latest_sequences(paged_records)}
    assert set(shown) == {f"R{i}" for i in range(1, 7)}
    assert all(s.status == "finished" for s in shown.values())
    finished = {}
    for p in paged_records:
        for seq in p.snapshot.sequences:
            if seq.status == "finished":
                finished[seq.seq_id] = seq.token_ids
    assert {k: v.token_ids for k, v in shown.items()} == finished


def test_next_event_and_run_to_end_stop_play(loaded):
    """A speaker who jumps to the next moment wants it to stay on screen: Next event and Run to the end
    stop Play."""
    lab = Lab.create(preset_settings("batch"), loaded)
    for kind in ("next", "end"):
        assert lab.press("play") == "play" and lab.player.playing
        assert lab.press(kind) == kind and not lab.player.playing


def test_a_pool_field_the_preset_overrides_is_named(loaded):
    """With "Use the preset's pool settings" ticked, a pool size typed in the form is the preset's after
    Apply: ``overridden_fields`` names it (the page says so); unticked, nothing is overridden."""
    from ui.state import applied_settings, form_values, overridden_fields

    current = preset_settings("batch")
    chosen = {**form_values(current), "num_blocks": 300_000, "seed": 7}
    assert overridden_fields(current, "batch", chosen) == ["num_blocks"]
    assert applied_settings(current, "batch", chosen).num_blocks == current.num_blocks
    assert overridden_fields(current, "batch", chosen, use_preset=False) == []
    assert overridden_fields(current, "custom", chosen) == []
