"""watch / replay / route after the operator trial (issue 27): Ctrl-C and SIGTERM end them cleanly with
their summary, and bad input is refused naming the value."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import pytest

from test_router import ROOT, SHIPPED, route_cli, stored


def test_ctrl_c_during_route_wait_answers_with_what_was_heard(capsys):
    from engine.kv_publisher import KVEventPublisher

    with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as lab:
        lab.publish([stored([1], None, [1, 2])])
        timer = threading.Timer(0.6, _thread.interrupt_main)
        timer.start()
        t0 = time.monotonic()
        rc, out, err = route_cli(["--server", f"lab={lab.endpoint}", "--replay", f"lab={lab.replay_endpoint}",
                                  "--prompt-ids", "1,2,3", "--wait", "30"], capsys)
        timer.cancel()
    assert rc == 0 and time.monotonic() - t0 < 10
    assert "interrupted after" in err and "Traceback" not in err + out
    assert "would send it to: lab" in out


def test_ctrl_c_during_replay_speed_prints_the_state_so_far(capsys):
    from engine.cli import main

    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    rc = main(["replay", str(SHIPPED), "--speed", "0.01"])  # 100x slower than recorded
    timer.cancel()
    got = capsys.readouterr()
    assert rc == 0 and "(interrupted: the state below is after" in got.out and "Traceback" not in got.err
    assert "cached blocks" in got.out  # the final state lines


def test_sigterm_ends_watch_with_its_summary(capsys):
    from engine.cli import main
    from engine.kv_publisher import KVEventPublisher

    def not_handled(*_):
        raise RuntimeError("SIGTERM reached the default handler: watch did not handle it")

    before = signal.signal(signal.SIGTERM, not_handled)
    try:
        with KVEventPublisher("tcp://127.0.0.1:0") as lab:
            timer = threading.Timer(0.6, os.kill, (os.getpid(), signal.SIGTERM))
            timer.start()
            t0 = time.monotonic()
            rc = main(["watch", "--server", f"lab={lab.endpoint}", "--duration", "30"])
            timer.cancel()
    finally:
        signal.signal(signal.SIGTERM, before)
    out = capsys.readouterr().out
    assert rc == 0 and time.monotonic() - t0 < 10 and "stream: " in out and "cached blocks" in out


@pytest.mark.parametrize("argv, said", [
    (["--server", "vllm=tcp://127.0.0.1:56101,,", "--prompt-ids", "1"],
     "--server vllm: 'tcp://127.0.0.1:56101,,': an empty endpoint"),
    (["--server", "a=tcp://127.0.0.1:56101", "--server", "b=tcp://127.0.0.1:56101", "--prompt-ids", "1"],
     "the endpoint 'tcp://127.0.0.1:56101' is given twice (also server 'a')"),
    (["--server", "a=tcp://127.0.0.1:56101", "--prompt-ids", "1", "--wait", "0"],
     "--wait must be seconds above 0, at most 600, got 0.0"),
])
def test_route_bad_input_is_named(argv, said, capsys):
    rc, _, err = route_cli(argv, capsys)
    assert rc == 2 and said in err, err


def test_the_page_hints_name_equals_endpoint():
    from engine.watch.servers import parse_page

    with pytest.raises(ValueError, match=r"write NAME=ENDPOINT \(vllm=tcp://127.0.0.1:5557\), not a space"):
        parse_page("vllm tcp://127.0.0.1:5557")


def test_watch_says_at_the_start_why_metrics_cannot_be_read(capsys):
    import socket

    from engine.cli import main
    from engine.kv_publisher import KVEventPublisher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with KVEventPublisher("tcp://127.0.0.1:0") as lab:
        rc = main(["watch", "--server", f"lab={lab.endpoint}", "--metrics", f"lab=http://127.0.0.1:{port}/metrics",
                   "--duration", "0.3"])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert rc == 0 and first.startswith(f"note: lab /metrics: cannot read metrics from http://127.0.0.1:{port}")
    assert "refused" in first.lower()
