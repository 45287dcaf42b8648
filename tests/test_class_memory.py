"""Issue 23, item 14: one student cannot take a class server's memory. Everything a session keeps is charged
to its share before its lab runs (``infra.class_limits.plan_session``: pools, engines' state, Streamlit's session,
recorded steps at a calibrated bound), refused or capped by name; dropped steps are really freed; a closed
tab's lab is released without waiting for Streamlit, and the freed memory goes back to the OS."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import tracemalloc
import weakref
from pathlib import Path

import pytest

from engine import EMBEDDED_MODEL, SamplingParams
from infra import class_limits as limits
from engine.model_loader import load_shared
from engine.scenarios.scenario_file import parse_scenario

MIB = 2**20


@pytest.fixture
def class_mode(monkeypatch):
    monkeypatch.setenv(limits.CLASS_SERVER_ENV, "1")
    for name in (limits.ALLOWED_MODELS_ENV, limits.SESSION_MEMORY_ENV, limits.HISTORY_STEPS_ENV,
                 limits.IDLE_MINUTES_ENV, limits.SEATS_ENV, limits.CLOSED_SECONDS_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def loaded():
    return load_shared(EMBEDDED_MODEL)


def scenario(requests: int, n: int, max_tokens: int, num_blocks: int, max_model_len: int = 1024):
    return parse_scenario({
        "name": "heavy", "settings": {"num_blocks": num_blocks, "block_size": 16, "max_model_len": max_model_len},
        "requests": [{"prompt": f"ROMEO. Request {i} speaks", "max_tokens": max_tokens, "n": n,
                      "temperature": 1.0, "seed": i, "ignore_eos": True} for i in range(requests)]})


def budget_for(lab, kv: dict, steps: int) -> int:
    """A share that holds ``lab``'s pools, engines' state, page and exactly ``steps`` recorded steps."""
    sizes = lab.run_sizes()
    return (sum(kv.values()) + limits.SESSION_PAGE_BYTES + limits.engine_state_bytes(sizes)
            + steps * limits.recorded_step_bytes(sizes))


def settings_of(scen):
    from ui.state import scenario_settings

    return scenario_settings(scen, EMBEDDED_MODEL)


# ------------------------------------------------------------------------------------ freed when dropped
def test_dropped_steps_are_freed(class_mode, loaded):
    """A step's snapshot records only what changed since the step before, so it kept every earlier step alive:
    the history bound freed nothing (the issue's worker grew past its 500 steps)."""
    from ui.lab import Lab
    from ui.state import preset_settings

    lab = Lab.create(preset_settings("batch"), loaded)
    lab.session.history_limit = 5
    lab.step()
    first = weakref.ref(lab.run.history[0][0].snapshot)
    for _ in range(11):
        lab.step()
    gc.collect()
    assert lab.session.dropped_steps == 7 and first() is None
    kept = [r.snapshot for r, _ in lab.run.history]
    assert all("_pool_delta" not in kept[0].__dict__ for _ in [0])  # the oldest kept holds its own lists
    assert [s.num_free_blocks for s in kept] == [s.ref_counts.count(0) for s in kept]  # and reads right


def test_the_final_length_run_keeps_no_step_records(class_mode, loaded, monkeypatch):
    """Under "oracle", the headless run that learns final lengths kept every record of its run (each with its
    snapshot) until the lab was built; only the scheduled sequences are read."""
    import ui.lab
    from engine.scenarios import run_spec  # where the lab's baseline_final_lengths learns them
    from ui.state import preset_settings

    seen = []
    real = run_spec.learn_final_lengths
    monkeypatch.setattr(run_spec, "learn_final_lengths", lambda outputs, records: seen.extend(records) or
                        real(outputs, records))
    settings = dataclasses.replace(preset_settings("batch"), contiguous_policy="oracle")
    ui.lab.Lab.create(settings, loaded)
    assert seen and all(not hasattr(r, "snapshot") and r.scheduled is not None for r in seen)


# ------------------------------------------------------------------------------------ charged before running
def test_the_issues_link_is_refused_before_allocation_naming_every_part(class_mode, loaded, monkeypatch):
    """64 requests x n = 16, max_tokens 400, a 4,096 x 16 pool: its pools (256 MiB) fit a 300 MiB share, which
    is all the check counted; what its steps keep does not. Refused before any pool exists, naming the parts,
    the bytes a recorded step keeps and the share."""
    from engine import llm_engine
    from ui.class_server import check_sizes

    monkeypatch.setattr(llm_engine, "KVCache", lambda *a, **k: pytest.fail("allocated"))
    class_mode.setenv(limits.SESSION_MEMORY_ENV, "300")
    with pytest.raises(ValueError) as err:
        check_sizes(settings_of(scenario(64, 16, 400, 4096)), loaded)
    said = str(err.value)
    assert "paged pool 128.0 MiB, contiguous region 128.0 MiB" in said
    assert "10 recorded steps of 9.47 MiB each: 1,024 sequences of up to 4" in said
    assert "may use 300.0 MiB" in said


def test_a_run_that_fits_keeps_only_the_steps_its_share_holds(class_mode, loaded):
    from ui.class_server import session_plan

    settings = settings_of(scenario(16, 4, 100, 256))
    plan = session_plan(settings, loaded, budget=40 * MIB)
    fixed = sum(v for k, v in plan.parts.items() if not k.startswith("recorded steps"))
    assert plan.history_steps == (40 * MIB - fixed) // plan.step_bytes < 500 and plan.capped
    assert plan.total <= 40 * MIB
    tokens = [len(f"ROMEO. Request {i} speaks".encode()) + 1 + 100 for i in range(16) for _ in range(4)]
    assert plan.step_bytes == limits.recorded_step_bytes(limits.RunSizes(tuple(tokens), 16, 256))
    roomy = session_plan(settings, loaded, budget=4096 * MIB)
    assert roomy.history_steps == 500 and not roomy.capped  # the server's own bound when memory is plenty


def test_the_lab_keeps_its_charge_and_the_page_says_why(class_mode, loaded):
    from ui.class_server import session_bytes
    from ui.lab import Lab

    settings = settings_of(scenario(8, 2, 60, 128))
    lab = Lab.create(settings, loaded)
    fixed = session_bytes(lab.run.settings, loaded)
    plan = lab.plan_memory(fixed, budget=budget_for(lab, fixed, 25))
    assert lab.session.history_limit == plan.history_steps == 25
    for _ in range(plan.history_steps + 2):
        lab.step()
    note = lab.history_note()
    assert f"keeps the last {plan.history_steps} steps" in note and "MiB of records" in note


def test_a_request_added_by_hand_is_charged_first(class_mode, loaded):
    """A request typed into the sidebar is charged before it is added: refused (nothing added) when the run
    would no longer fit, else the steps kept shrink to what still fits."""
    from ui.class_server import session_bytes
    from ui.lab import Lab

    lab = Lab.create(settings_of(scenario(2, 1, 20, 128)), loaded)
    fixed = session_bytes(lab.run.settings, loaded)
    plan = lab.plan_memory(fixed, budget=budget_for(lab, fixed, 12))
    before = (len(lab.run.arrivals), len(lab.run.paged.requests), lab.session.history_limit)
    with pytest.raises(ValueError, match=r"this run needs [\d.,]+ MiB .* 10 sequences of up to 208 tokens.* "
                                         r"may use [\d.,]+ MiB"):
        lab.add_request("ROMEO. ", SamplingParams(max_tokens=200, n=8))  # the engine itself would take it
    assert (len(lab.run.arrivals), len(lab.run.paged.requests), lab.session.history_limit) == before == (0, 0, 12)
    lab.add_request("ROMEO. ", SamplingParams(max_tokens=20))
    assert 10 <= lab.session.history_limit < plan.history_steps and lab.session.memory.budget == plan.budget
    assert len(lab.run.paged.requests) == 1


@pytest.mark.slow
def test_recorded_steps_stay_within_their_charge(class_mode, loaded):
    """Measured (tracemalloc): what the lab keeps after 160 steps (a link's replay: drawn now and then) is within
    the recorded steps and engines' state it was charged."""
    from ui.class_server import session_bytes
    from ui.lab import Lab

    lab = Lab.create(settings_of(scenario(8, 4, 200, 256)), loaded)
    fixed = session_bytes(lab.run.settings, loaded)
    plan = lab.plan_memory(fixed, budget=budget_for(lab, fixed, 12))
    assert plan.history_steps == 12
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(160):
            lab.step()
            for record in lab.run.history[-1] if i % 25 == 0 else ():  # a progress redraw: the latest step drawn
                record.snapshot.ref_counts  # noqa: B018 - drawn
            if i == 39:
                gc.collect()
                kept_at_40 = tracemalloc.get_traced_memory()[0]
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    charged = plan.history_steps * plan.step_bytes + limits.engine_state_bytes(lab.run_sizes())
    assert lab.step_count == 12 and kept <= charged, (kept, charged)
    # past the cap only the engines' tokens grow; a dropped step that stayed alive added a whole record each
    # (before: 1.06 MB at step 40, 2.40 MB at step 160; now 0.98 and 1.35)
    assert kept - kept_at_40 < 0.7 * kept_at_40, (kept_at_40, kept)


# ------------------------------------------------------------------------------------ closed tabs
def _seat_of(registry, lab):
    return next(sid for sid, seat in registry["seats"].items() if seat.lab is lab)


def test_a_closed_tabs_lab_is_released_and_a_return_finds_a_note(class_mode, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from ui import class_server

    trims = []
    monkeypatch.setattr(class_server, "free_memory", lambda: trims.append(1))
    registry = class_server.seat_registry()
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=180)
    at.run()
    lab = at.session_state["lab"]
    sid = _seat_of(registry, lab)
    got = limits.class_limits()
    now = time.monotonic()
    assert class_server.sweep(got, now, gone={sid}) == []  # just gone: a network blip may bring it back
    assert class_server.sweep(got, now + 5, gone=set()) == []  # it came back: the clock restarts
    class_server.sweep(got, now + 6, gone={sid})
    assert class_server.sweep(got, now + 6 + got.closed_seconds - 1, gone={sid}) == []
    assert class_server.sweep(got, now + 6 + got.closed_seconds, gone={sid}) == [sid]
    assert lab.run.paged is None and lab.run.history == [] and sid not in registry["seats"] and trims
    at.run()
    assert not at.exception
    assert at.session_state["lab"] is not lab and at.session_state["lab"].run.paged is not None
    assert any("released 10 s after its tab closed" in i.value for i in at.info)


def test_the_reaper_releases_without_any_script_run(class_mode, monkeypatch, loaded):
    """Nothing else has to happen on the server: the reaper thread sweeps on its own."""
    from ui import class_server
    from ui.lab import Lab
    from ui.state import preset_settings

    class_mode.setenv(limits.CLOSED_SECONDS_ENV, "0")
    monkeypatch.setattr(class_server, "REAP_INTERVAL_S", 0.05)
    monkeypatch.setattr(class_server, "_gone_sessions", lambda ids: set(ids))
    lab = Lab.create(preset_settings("batch"), loaded)
    registry = {"lock": threading.Lock(), "seats": {"gone-tab": class_server.Seat(time.monotonic(), lab)},
                "reaper": None}
    class_server.start_reaper(registry)
    deadline = time.monotonic() + 10
    while lab.run.paged is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lab.run.paged is None and not registry["seats"]


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_freed_memory_goes_back_to_the_os():
    """glibc keeps freed mid-sized blocks (a recorded step's token lists: kilobytes each) in its heap; the
    release's ``malloc_trim(0)`` hands them back, so a closed session's memory leaves the process's RSS."""
    from ui.class_server import free_memory

    gc.collect()
    free_memory()
    base = _rss_mib()
    held = [[i & 0xFF] * 600 for i in range(30_000)]  # 30,000 lists of 4.7 KiB arrays: ~140 MiB of heap
    grown = _rss_mib()
    survivors = held[::64]  # a few stay (the rest of the process), so the heap's top cannot shrink by itself
    del held
    gc.collect()
    kept = _rss_mib()
    free_memory()
    after = _rss_mib()
    assert grown - base > 100, (base, grown)
    assert kept - base > 0.75 * (grown - base), (base, grown, kept)  # freed, but still the process's
    assert after - base < 0.25 * (grown - base), (base, grown, kept, after)
    assert len(survivors) == 469


def test_a_links_replay_returns_to_streamlit_often_and_stops_on_a_released_lab(class_mode, monkeypatch, loaded):
    """A replay redraws its bar at least every PROGRESS_EVERY_S (each redraw is where Streamlit stops a closed
    tab's script run; every 25 steps took over a minute in a full class), and stops when its lab is released."""
    import streamlit as st

    from ui import scenario_io
    from ui.lab import Lab
    from ui.state import preset_settings

    class Bar:
        def __init__(self):
            self.drawn = 0

        def progress(self, *args, **kwargs):
            self.drawn += 1

        def empty(self):
            pass

    bar = Bar()
    monkeypatch.setattr(st, "progress", lambda *a, **k: bar)
    monkeypatch.setattr(scenario_io, "PROGRESS_EVERY_S", 0.0)
    lab = Lab.create(preset_settings("batch"), loaded)
    assert scenario_io.run_steps(lab, 60) == 60 and bar.drawn == 60
    lab.release("released 10 s after its tab closed")
    assert scenario_io.run_steps(lab, 60) == 0  # its records are gone, nothing more runs, and no error
