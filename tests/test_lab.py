"""The Playground's Lab (no Streamlit): steps are atomic even when two script runs step it at once."""

from __future__ import annotations

import threading

from engine import EMBEDDED_MODEL
from engine.model_loader import load_shared
from ui.lab import Lab, LabSettings


def test_concurrent_steps_stay_consistent():
    """Two threads press Step 12 times each (a double click, a key repeat, PageDown during Play): every press
    is one whole step of both engines, recorded in order, none lost or interleaved."""
    lab = Lab.create(LabSettings(model=EMBEDDED_MODEL, preset="batch", block_size=16, num_blocks=12,
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
    assert len(lab.history) == 24
    assert [p.step for p, _ in lab.history] == list(range(1, 25))
    assert [c.step for _, c in lab.history] == list(range(1, 25))
    assert lab.paged.block_manager.invariant_violations() == []
