"""The Playground's Lab (no Streamlit): steps are atomic even when two script runs step it at once."""

from __future__ import annotations

import dataclasses
import threading

from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from engine.scenarios.run_spec import RunSpec
from ui.lab import Lab


def test_concurrent_steps_stay_consistent():
    """Two threads press Step 12 times each (a double click, a key repeat, PageDown during Play): every press
    is one whole step of both engines, recorded in order, none lost or interleaved."""
    lab = Lab.create(RunSpec(model=EMBEDDED_MODEL, preset="batch", block_size=16, num_blocks=12,
                                 max_model_len=128), load_shared(EMBEDDED_MODEL))
    errors = []

    def press(times):
        try:
            for _ in range(times):
                lab.step()
        except Exception as exc:  # noqa: BLE001 - any failure in a thread must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=press, args=(12,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(lab.run.history) == 24
    assert [p.step for p, _ in lab.run.history] == list(range(1, 25))
    assert [c.step for _, c in lab.run.history] == list(range(1, 25))
    assert lab.run.paged.block_manager.invariant_violations() == []


def test_every_preset_is_the_same_run_in_the_cli_and_the_app():
    """A scenario's engine settings are the same whether the CLI, the Playground or Compare builds it (the
    app used to default max_model_len to 256 where the CLI derived it from the pool)."""
    from engine.cli import build_parser, engine_config
    from engine.scenarios.presets import SCENARIOS
    from ui.state import preset_settings

    for name, scenario in SCENARIOS.items():
        args = build_parser().parse_args(["run", "--scenario", name])
        for allocator in ("paged", "contiguous"):
            cli = engine_config(args, scenario, allocator)
            app = preset_settings(name).engine_config(allocator)
            # reservation_tokens None means max_model_len: the same reservation
            cli = dataclasses.replace(cli, reservation_tokens=cli.reservation_tokens or cli.max_model_len)
            assert app == cli, (name, allocator)
