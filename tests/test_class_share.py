"""Issue 23 (trial findings), the class server's memory guarantee: every session reserves its share of the
server's memory in one registry shared by all worker processes (``infra.class_limits.ShareRegistry``, a flock'd
file), before its lab runs; the reservations never add up to more than the total; a released session gives
its share back; a crashed worker's reservations are dropped (its process is gone) and any reservation not
renewed for ``LEASE_S`` expires. Before, each worker computed its share alone from the memory free at that
moment, and nothing was charged against a total."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from engine import EMBEDDED_MODEL
from infra import class_limits as limits
from infra.class_limits import MIB, NoShareFree, ShareRegistry


@pytest.fixture
def class_env(monkeypatch, tmp_path):
    """A class server of 3 seats and 300 MiB for sessions, its reservations in a file of its own."""
    monkeypatch.setenv(limits.CLASS_SERVER_ENV, "1")
    for name in (limits.ALLOWED_MODELS_ENV, limits.SESSION_MEMORY_ENV, limits.HISTORY_STEPS_ENV,
                 limits.IDLE_MINUTES_ENV, limits.CLOSED_SECONDS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(limits.SEATS_ENV, "3")
    monkeypatch.setenv(limits.CLASS_MEMORY_ENV, "300")
    monkeypatch.setenv(limits.MEMORY_STATE_ENV, str(tmp_path / "memory.json"))
    return limits.class_limits()


def test_two_workers_cannot_reserve_more_than_the_total_together(class_env, tmp_path):
    path = str(tmp_path / "memory.json")
    a, b = ShareRegistry(path), ShareRegistry(path)  # two workers' registries on one file
    assert a.reserve("a1", 100 * MIB, 10 * MIB, class_env) == 100 * MIB
    assert b.reserve("b1", 100 * MIB, 10 * MIB, class_env) == 100 * MIB
    assert a.reserve("a2", 100 * MIB, 10 * MIB, class_env) == 100 * MIB
    with pytest.raises(NoShareFree) as err:  # B sees what A holds
        b.reserve("b2", 100 * MIB, 10 * MIB, class_env)
    said = str(err.value)
    assert "0.0 MiB of the 300 MiB for sessions is free (3 seats held" in said
    assert "needs at least 10.0 MiB" in said and "PAL_CLASS_MEMORY_MB" in said
    assert a.held() == b.held() == 300 * MIB and b.seats_held() == 3


def test_less_than_a_share_is_granted_when_less_is_free_but_enough(class_env, tmp_path):
    path = str(tmp_path / "memory.json")
    a, b = ShareRegistry(path), ShareRegistry(path)
    a.reserve("a1", 250 * MIB, 10 * MIB, class_env)
    assert b.reserve("b1", 100 * MIB, 20 * MIB, class_env) == 50 * MIB  # what is free, above the need
    with pytest.raises(NoShareFree, match=r"needs at least 20\.0 MiB and 0\.0 MiB"):
        b.reserve("b2", 100 * MIB, 20 * MIB, class_env)
    assert b.reserve("b1", 100 * MIB, 20 * MIB, class_env) == 50 * MIB  # re-reserving keeps what it held


def test_release_frees_the_share(class_env, tmp_path):
    path = str(tmp_path / "memory.json")
    a, b = ShareRegistry(path), ShareRegistry(path)
    for sid in ("a1", "a2", "a3"):
        a.reserve(sid, 100 * MIB, 10 * MIB, class_env)
    with pytest.raises(NoShareFree):
        b.reserve("b1", 100 * MIB, 10 * MIB, class_env)
    assert a.release("a2") == 100 * MIB and a.release("a2") == 0
    assert b.reserve("b1", 100 * MIB, 10 * MIB, class_env) == 100 * MIB


def _reserve_in_child(path: str, prefix: str, count: int, limits_, go: float, write_fd: int, exit_fd: int) -> None:
    """In a forked child (another worker process): reserve ``count`` shares, write how many were granted, wait
    until the parent says so (a live worker: its reservations hold), then exit without releasing anything
    (``os._exit``: a crash)."""
    granted = 0
    try:
        registry = ShareRegistry(path)
        while time.time() < go:
            pass
        for i in range(count):
            try:
                registry.reserve(f"{prefix}{i}", 10 * MIB, 10 * MIB, limits_)
                granted += 1
            except NoShareFree:
                pass
        os.write(write_fd, str(granted).encode())
        os.read(exit_fd, 1)
    finally:
        os._exit(0)


def test_worker_processes_racing_never_exceed_the_total_and_a_crashed_ones_shares_free(class_env, tmp_path):
    """Two live worker processes reserve at the same moment, 25 sessions each, for 30 shares (10 MiB of 300):
    30 are granted in all. Both then die without releasing: their reservations are dropped as their processes
    are gone, and the whole total is free again."""
    path = str(tmp_path / "memory.json")
    go = time.time() + 0.3
    pids, reads, exits = [], [], []
    for prefix in ("w1-", "w2-"):
        r, w = os.pipe()
        exit_r, exit_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.close(exit_w)
            _reserve_in_child(path, prefix, 25, class_env, go, w, exit_r)
        os.close(w)
        os.close(exit_r)
        pids.append(pid)
        reads.append(r)
        exits.append(exit_w)
    try:
        granted = [int(os.read(r, 32).decode() or -1) for r in reads]  # both alive, done reserving
        assert sum(granted) == 30 and min(granted) > 0, granted
        with open(path) as f:
            on_file = json.load(f)["sessions"]
        assert len(on_file) == 30 and sum(r["bytes"] for r in on_file.values()) == 300 * MIB
        assert ShareRegistry(path).held() == 300 * MIB  # live workers' reservations hold
    finally:
        for fd in exits:
            os.write(fd, b"x")
            os.close(fd)
        for pid, r in zip(pids, reads):
            os.waitpid(pid, 0)
            os.close(r)
    parent = ShareRegistry(path)
    assert parent.held() == 0  # both workers are gone: their reservations with them
    assert parent.reserve("p1", 300 * MIB, 10 * MIB, class_env) == 300 * MIB


def test_a_reservation_not_renewed_expires_after_the_lease(class_env, tmp_path):
    """A worker this host cannot check (another host) keeps its reservations only while it renews them; a
    reused pid (a live process that started at another time) is not the worker that reserved."""
    path = str(tmp_path / "memory.json")
    now = time.time()
    other_host = {"bytes": 100 * MIB, "host": "elsewhere", "pid": 1, "start": "1", "renewed": now}
    reused_pid = {"bytes": 100 * MIB, "host": limits._this_worker()["host"], "pid": os.getppid(),
                  "start": "0", "renewed": now}
    with open(path, "w") as f:
        json.dump({"measured": None, "sessions": {"far": other_host, "reused": reused_pid}}, f)
    registry = ShareRegistry(path)
    assert registry.held(now=now) == 100 * MIB  # the reused pid's is dropped at once
    assert registry.held(now=now + limits.LEASE_S - 1) == 100 * MIB
    assert registry.held(now=now + limits.LEASE_S + 1) == 0
    mine = ShareRegistry(path)
    mine.reserve("s", 100 * MIB, 10 * MIB, class_env, now=now)
    assert mine.renew(["s"], now=now + limits.LEASE_S * 0.9) == 1  # a live worker's sweep renews it
    assert mine.held("s", now=now + limits.LEASE_S * 1.5) == 100 * MIB
    assert mine.held("s", now=now + limits.LEASE_S * 2) == 0  # not renewed since: expired


def test_threads_of_one_worker_and_another_worker_share_one_total(class_env, tmp_path):
    path = str(tmp_path / "memory.json")
    a, b = ShareRegistry(path), ShareRegistry(path)
    got = []

    def take(registry, prefix):
        for i in range(20):
            try:
                got.append(registry.reserve(f"{prefix}{i}", 10 * MIB, 10 * MIB, class_env))
            except NoShareFree:
                pass

    threads = [threading.Thread(target=take, args=(r, p)) for r, p in ((a, "a"), (a, "b"), (b, "c"), (b, "d"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 30 and a.held() == 300 * MIB


# ------------------------------------------------------------------------------ the app's side
@pytest.fixture(scope="module")
def loaded():
    from engine.model_loader import load_shared

    return load_shared(EMBEDDED_MODEL)


def test_each_session_reserves_before_its_lab_and_the_class_is_told_when_none_is_free(class_env, loaded,
                                                                                       monkeypatch):
    """check_sizes reserves the session's share (300 MiB over 3 seats) before anything is allocated; a
    fourth session is refused saying what is free and how many seats are held; when a session's lab is
    released (its tab closed), its share is free again."""
    import streamlit as st

    from ui import class_server
    from ui.lab import Lab
    from ui.state import preset_settings

    sid = {"now": "s1"}
    monkeypatch.setattr(class_server, "session_id", lambda: sid["now"])
    settings = preset_settings("batch")
    seats = {"lock": threading.Lock(), "seats": {}, "reaper": None}
    for name in ("s1", "s2", "s3"):
        sid["now"] = name
        class_server.check_sizes(settings, loaded)
        plan = st.session_state[class_server.PLAN_KEY]
        assert plan.budget == 100 * MIB and plan.total <= 100 * MIB
        lab = Lab.create(settings, loaded)
        seats["seats"][name] = class_server.Seat(time.monotonic(), lab)
    registry = limits.share_registry()
    assert registry.held() == 300 * MIB and registry.seats_held() == 3
    sid["now"] = "s4"
    with pytest.raises(ValueError, match=r"0\.0 MiB of the 300 MiB for sessions is free \(3 seats held"):
        class_server.check_sizes(settings, loaded)
    released = class_server.sweep(class_env, time.monotonic() + 60, registry=seats, gone={"s2"})
    assert released == []  # gone just now: kept closed_seconds
    released = class_server.sweep(class_env, time.monotonic() + 120, registry=seats, gone={"s2"})
    assert released == ["s2"] and registry.held("s2") == 0 and registry.held() == 200 * MIB
    class_server.check_sizes(settings, loaded)  # s4 gets the freed share
    assert registry.held("s4") == 100 * MIB


# ------------------------------------------------------------------------------ the workers' total
def _script():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "class_server_script", Path(__file__).resolve().parent.parent / "scripts" / "class_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_workers_total_is_measured_before_they_start(monkeypatch):
    """Each worker measuring the free memory itself, after starting, counted the other workers' PyTorch and
    model (not loaded yet) as free: the script measures once, before, and hands every worker one total."""
    from engine import memory
    script = _script()
    monkeypatch.delenv(limits.CLASS_MEMORY_ENV, raising=False)
    monkeypatch.setattr(memory, "available_host_memory_bytes", lambda: 4096 * MIB)
    assert script.class_memory_mb(2) == (4096 * MIB - 2 * script.WORKER_BASE_BYTES) / MIB
    with pytest.raises(SystemExit, match=r"4,096 MiB available leaves nothing for sessions beside 7 workers"):
        script.class_memory_mb(7)
    monkeypatch.setenv(limits.CLASS_MEMORY_ENV, "1500")
    assert script.class_memory_mb(7) == 1500
    monkeypatch.setenv(limits.CLASS_MEMORY_ENV, "lots")
    with pytest.raises(SystemExit, match=r"PAL_CLASS_MEMORY_MB='lots' must be a number"):
        script.class_memory_mb(2)


def test_the_total_is_at_most_seats_times_a_fixed_session_share(class_env, monkeypatch):
    monkeypatch.setenv(limits.SESSION_MEMORY_ENV, "64")
    got = limits.class_limits()
    assert limits.server_memory_bytes(got) == 3 * 64 * MIB  # 300 MiB given, 3 seats of 64
    assert limits.session_budget_bytes(got, available=10**12) == 64 * MIB


# ------------------------------------------------------------------------------ real workers behind nginx
@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("nginx") is None and not os.path.exists("/usr/sbin/nginx"),
                    reason="nginx is not installed (scripts/test.sh installs it as root)")
def test_real_workers_reserve_in_one_file_and_a_killed_workers_shares_come_back(monkeypatch):
    """scripts/class_server.py with 2 workers, 3 seats of 100 MiB: students, whichever worker serves them,
    reserve in one file; the fourth is told no share is free; a worker killed (the OOM killer) gives its
    shares back."""
    import asyncio
    import signal
    from pathlib import Path

    from bench.class_load import Student, free_port, process_tree, start_server, stop_server

    monkeypatch.setenv(limits.SEATS_ENV, "3")
    monkeypatch.setenv(limits.CLASS_MEMORY_ENV, "300")
    for name in (limits.SESSION_MEMORY_ENV, limits.MEMORY_STATE_ENV, limits.HISTORY_STEPS_ENV):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    proc = start_server(port, workers=2)
    try:
        workers = [p for p in process_tree(proc.pid) if b"streamlit" in Path(f"/proc/{p}/cmdline").read_bytes()]
        environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{workers[0]}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        path = environ[b"PAL_MEMORY_STATE"].decode()
        assert float(environ[b"PAL_CLASS_MEMORY_MB"]) == 300
        url = f"http://127.0.0.1:{port}"

        async def open_all(n):
            students = [Student(i, url) for i in range(n)]
            for s in students:  # one after another: the fourth finds the three seats held
                await s.open_page()
            return students

        students = asyncio.run(open_all(4))
        on_file = json.loads(Path(path).read_text())["sessions"]
        assert len(on_file) == 3 and sum(r["bytes"] for r in on_file.values()) == 300 * MIB
        refused = [s for s in students if any(b"this class server's memory is taken" in t for t in s.text)]
        assert len(refused) == 1 and refused[0] is students[3]
        assert any(b"0.0 MiB of the 300 MiB for sessions is free (3 seats held" in t for t in refused[0].text)
        holders = {r["pid"] for r in on_file.values()}
        assert holders <= set(workers)
        victim = next(iter(holders))
        os.kill(victim, signal.SIGKILL)
        time.sleep(1)
        left = sum(r["bytes"] for r in on_file.values() if r["pid"] != victim)
        assert ShareRegistry(path).held() == left < 300 * MIB  # the killed worker's shares are free again
    finally:
        stop_server(proc)
