"""engine/threads.py: torch's intra-op threads chosen from the cores actually free, 1 for the app."""

from __future__ import annotations

import pytest

from engine.threads import busy_cores, choose_num_threads


@pytest.mark.parametrize("cores, load, want", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 2.0, 1), (2, 7.5, 1),
                                               (16, 3.2, 13), (1, 0.0, 1)])
def test_the_cli_takes_the_cores_other_work_leaves(cores, load, want, monkeypatch):
    monkeypatch.delenv("PAL_NUM_THREADS", raising=False)
    n, why = choose_num_threads("cli", cores=cores, load=load)
    assert n == want and f"{cores} cores" in why


def test_the_app_takes_one_and_the_operator_overrides(monkeypatch):
    monkeypatch.delenv("PAL_NUM_THREADS", raising=False)
    assert choose_num_threads("app", cores=16, load=0.0)[0] == 1
    monkeypatch.setenv("PAL_NUM_THREADS", "3")
    assert choose_num_threads("app") == (3, "PAL_NUM_THREADS=3") and choose_num_threads("cli")[0] == 3
    monkeypatch.setenv("PAL_NUM_THREADS", "0")
    with pytest.raises(ValueError, match="PAL_NUM_THREADS must be a positive integer, got '0'"):
        choose_num_threads("cli")
    with pytest.raises(ValueError, match="role must be 'cli' or 'app'"):
        choose_num_threads("server")


def test_busy_cores_sees_a_spinning_process():
    import subprocess
    import sys
    import time

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert busy_cores(0.5) >= 0.6  # one core spinning (other work on the machine may add more)
    finally:
        spin.kill()


def test_configure_gc_raises_the_threshold_once(monkeypatch):
    import gc

    from engine import threads
    calls = []
    monkeypatch.setattr(threads, "_gc_configured", False)
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    before = gc.get_threshold()
    try:
        threads.configure_gc()
        threads.configure_gc()  # Streamlit reruns app.py on every interaction: the second call does nothing
        assert gc.get_threshold()[0] == threads.GC_THRESHOLD0
        assert calls == ["collect", "freeze"]
    finally:
        gc.set_threshold(*before)
