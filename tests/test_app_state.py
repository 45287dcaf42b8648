"""The Playground's session state in named parts (issue 24, item 4): ``ui.lab.Lab`` composes a ``Run`` (the
engines and records), a ``Player`` (the step on screen, a beam step's phase, Play), a ``PressProtocol`` (the
browser's press counter and what presses said) and ``SessionLimits`` (a class server's trimming), each a small
class with its own docstring; the lab keeps only them and its lock. The parts' logic is tested here without
engines."""

from __future__ import annotations

import dataclasses

import pytest

from ui import lab as lab_module
from ui.lab import Player, PressProtocol, Run, SessionLimits

PARTS = {"run": Run, "player": Player, "protocol": PressProtocol, "session": SessionLimits}


def test_the_lab_is_its_four_parts_and_a_lock():
    settings = lab_module.RunSpec(model="m")
    made = lab_module.Lab(settings, None, None, notes=["a note"], semantics_note="why")
    assert set(vars(made)) == set(PARTS) | {"_lock"}
    for name, part in PARTS.items():
        assert isinstance(getattr(made, name), part) and part.__doc__ and len(part.__doc__) > 80
    assert made.run.settings is settings and made.run.notes == ["a note"] and made.run.semantics_note == "why"
    # a part's field is read and written on its part, never under an old name on the lab (issue 24's review:
    # 29 forwarded names hid which part a caller used)
    made.player.cursor, made.player.speed, made.protocol.handled, made.session.history_limit = 3, 4.0, 7, 9
    assert (made.player.cursor, made.player.speed, made.protocol.handled, made.session.history_limit) == (3, 4.0, 7, 9)
    old = ("settings", "paged", "contiguous", "pending", "history", "order", "notes", "semantics_note", "arrivals",
           "queued", "final_lens", "failure", "cursor", "phase", "playing", "play_speed", "play_clock", "play_shown",
           "play_base", "token", "presses", "ignored", "ignored_why", "notices", "notice", "next_said",
           "history_limit", "dropped_steps", "memory")
    assert [name for name in old if hasattr(made, name) or hasattr(lab_module.Lab, name)] == []
    # no field is in two parts
    names = [f.name for part in PARTS.values() for f in dataclasses.fields(part)]
    assert len(names) == len(set(names)), names


def test_player_keeps_plays_pace_and_the_rate_shown():
    p = Player()
    assert p.pace(now=10.0) is None and p.rate() is None  # paused
    p.playing = True
    p.start_clock(latest_step=5, now=100.0)
    p.clock = (100.0, 4)  # Play ran 4 steps
    assert p.pace(now=100.5) is None  # before its first second
    assert p.pace(now=102.0) == 2.0
    p.drawn(9, now=102.0)
    p.drawn(9, now=102.5)  # the same step drawn again: once
    assert p.shown == (1, 9, 102.0) and p.rate() == (9 - 5) / 2.0


def test_press_protocol_runs_each_press_once_and_only_for_its_lab():
    proto = PressProtocol()
    assert len(proto.token) == 12 and PressProtocol().token != proto.token
    assert proto.pending_kinds(proto.token, 3, "FFB") == "FFB"
    assert proto.pending_kinds("another lab", 3, "FFB") == "" and proto.pending_kinds(proto.token, True, "F") == ""
    proto.handled = 2
    assert proto.pending_kinds(proto.token, 3, "FFB") == "B" and not proto.is_new_total(proto.token, 2, "FF")
    assert proto.ignore("Back: already at the first step") == "ignored"
    assert (proto.ignored, proto.ignored_why, proto.notices) == (1, "Back: already at the first step", 0)
    proto.ignore("Next event: none after step 4", said_on=4, short="none after 4")  # an answer, not ignored
    assert (proto.ignored, proto.notices, proto.notice) == (1, 1, "Next event: none after step 4")
    assert proto.said_on(4) == "Next event: none after step 4" and proto.said_on(4, short=True) == "none after 4"
    assert proto.said_on(5) is None


def test_session_limits_trim_and_say_so():
    s = SessionLimits(history_limit=None)
    assert s.excess(10_000) == 0 and s.note(10_000) is None
    s = SessionLimits(history_limit=50)
    assert s.excess(49) == 0 and s.excess(53) == 3
    s.dropped_steps = 3
    assert s.note(53) == ("Steps 1-3 were dropped to save memory; the run continues (this class server keeps the "
                          "last 50 steps: 4-53).")


@pytest.mark.parametrize("part", list(PARTS.values()))
def test_each_part_is_small(part):
    """Each part holds what belongs together: at most a dozen fields."""
    assert len(dataclasses.fields(part)) <= 12
