"""A class server on several cores (scripts/class_server.py): N Streamlit workers behind nginx, each browser kept
on one worker by the ``pal_worker`` cookie; students stepping through the proxy see only their own labs."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def _launcher():
    spec = importlib.util.spec_from_file_location("class_server", ROOT / "scripts" / "class_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_proxies_websockets_to_every_worker_by_a_sticky_cookie():
    text = _launcher().nginx_config("0.0.0.0", 8501, [9001, 9002, 9003], "/tmp/x")
    assert "listen 0.0.0.0:8501;" in text
    assert [line.strip() for line in text.splitlines() if line.strip().startswith("server 127.0.0.1:")] == [
        f"server 127.0.0.1:{p} max_fails=0;" for p in (9001, 9002, 9003)]
    assert "hash $pal_worker consistent;" in text and "$cookie_pal_worker" in text
    assert "proxy_set_header Upgrade $http_upgrade;" in text and "proxy_http_version 1.1;" in text
    assert "proxy_set_header Host $http_host;" in text  # with the port: Streamlit checks the Origin against it
    assert "pid /tmp/x/nginx.pid;" in text and "daemon off;" in text  # private folder, foreground


def test_a_too_long_address_gets_the_apps_own_page_in_the_config():
    launcher = _launcher()
    text = launcher.nginx_config("0.0.0.0", 8501, [9001], "/tmp/x")
    assert "large_client_header_buffers 4 16k;" in text
    assert "error_page 414 /pal-address-too-long.html;" in text and "return 414 '<!DOCTYPE html>" in text
    page = launcher.link_too_long_html()
    assert "16,384 bytes" in page and "8,000 characters" in page and "Save JSON" in page
    assert "Open a scenario file" in page and "'" not in page and "$" not in page


def _serve_upstream():
    """A stand-in worker on a free 127.0.0.1 port answering every GET with 200 and the path's length."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(f"worker saw {len(self.path)} characters".encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/test.sh installs it as root)")
def test_a_100000_character_link_gets_the_apps_page_not_a_bare_414(tmp_path):
    """Issue 23, item 15: nginx answered a 100,000-character link with its bare "414 Request-URI Too Large";
    now with the app's page saying the limit and to save a scenario file. A link of the longest a scenario
    link may be (8,000 characters) still reaches the worker."""
    import subprocess
    import urllib.error

    from bench.class_load import free_port

    launcher = _launcher()
    upstream, port = _serve_upstream(), free_port()
    (tmp_path / "nginx.conf").write_text(launcher.nginx_config("127.0.0.1", port, [upstream.server_port],
                                                               str(tmp_path)))
    nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-e", f"{tmp_path}/error.log", "-c",
                              f"{tmp_path}/nginx.conf"])
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=5)
                break
            except OSError:
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?scenario={'A' * 8000}&step=2000", timeout=30) as ok:
            assert ok.status == 200 and ok.read() == b"worker saw 8021 characters"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/?scenario={'A' * 100_000}&step=2000", timeout=30)
        body = refused.value.read().decode()
        assert refused.value.code == 414 and refused.value.headers["Content-Type"].startswith("text/html")
        assert "This link is too long for this class server" in body and "16,384 bytes" in body
        assert "Save JSON" in body and "Request-URI Too Large" not in body
    finally:
        nginx.terminate()
        nginx.wait(timeout=30)
        upstream.shutdown()


def test_no_workers_and_a_bad_count_are_refused_by_name():
    launcher = _launcher()
    with pytest.raises(ValueError, match="worker_ports is empty"):
        launcher.nginx_config("0.0.0.0", 8501, [], "/tmp/x")
    with pytest.raises(SystemExit):
        launcher.parse_args(["--workers", "0"])
    args, extra = launcher.parse_args(["--workers", "3", "--port", "9000", "--server.maxUploadSize", "1"])
    assert (args.workers, args.port, extra) == (3, 9000, ["--server.maxUploadSize", "1"])


def test_workers_by_default_fit_the_cores_the_quota_and_the_memory(tmp_path, monkeypatch):
    launcher = _launcher()
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert launcher.cgroup_cpus(str(quota)) == 1  # docker run --cpus 1.5: one whole CPU
    quota.write_text("max 100000\n")
    assert launcher.cgroup_cpus(str(quota)) is None and launcher.cgroup_cpus(str(tmp_path / "none")) is None
    import engine.memory

    monkeypatch.setattr(launcher, "cgroup_cpus", lambda: None)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(engine.memory, "available_host_memory_bytes", lambda: 3 * launcher.WORKER_BYTES + 1)
    assert launcher.default_workers() == 3  # 16 cores, memory for 3 workers
    monkeypatch.setattr(engine.memory, "available_host_memory_bytes", lambda: 1)
    assert launcher.default_workers() == 1


def test_an_option_that_would_give_every_worker_one_port_is_refused(capsys):
    with pytest.raises(SystemExit):
        _launcher().parse_args(["--workers", "2", "--server.port", "9000"])
    assert "--server.port: each worker gets its own port" in capsys.readouterr().err


def _handshake(port: int, host: str) -> bytes:
    """The status line of a websocket handshake for /_stcore/stream sent to 127.0.0.1:``port`` as a browser
    that reached the server as ``host`` (its Host and Origin)."""
    import base64
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall((f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                      f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: streamlit\r\n"
                      f"Origin: http://{host}\r\n\r\n").encode())
        return sock.recv(4096).split(b"\r\n", 1)[0]


def _get(url: str, cookie: str | None = None) -> tuple[str, str]:
    """(the worker that answered, the sticky cookie set) for a GET of ``url``."""
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        sticky = next(c.split(";", 1)[0] for c in response.headers.get_all("Set-Cookie")
                      if c.startswith("pal_worker="))
        return response.headers["X-PAL-Worker"], sticky


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/test.sh installs it as root)")
def test_browsers_spread_over_the_workers_and_each_stays_on_its_own():
    from bench.class_load import free_port, process_tree, run_class, start_server, stop_server

    port = free_port()
    proc = start_server(port, workers=2)
    try:
        url = f"http://127.0.0.1:{port}"
        first = [_get(url + "/_stcore/health") for _ in range(16)]  # 16 new browsers
        assert len({worker for worker, _ in first}) == 2  # both workers serve (all on one: 2 in 65,536)
        worker, cookie = first[0]
        assert {_get(url + "/_stcore/health", cookie)[0] for _ in range(5)} == {worker}  # a browser stays
        # students reach the machine by its name (or Docker's published port), not as 127.0.0.1
        assert b" 101 " in _handshake(port, f"classroom.example:{port}")
        result = asyncio.run(run_class(url, proc.pid, 4, 1))  # 4 students step through the proxy
        assert not result.errors and not result.leaks and result.own_seen == 4
        # a worker killed (say by the OOM killer) is started again on its port; the server goes on
        tree = process_tree(proc.pid)
        workers = [p for p in tree if b"streamlit" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.time() + 120
        while time.time() < deadline and len([p for p in process_tree(proc.pid) if p not in tree]) < 1:
            time.sleep(0.5)
        assert proc.poll() is None and [p for p in process_tree(proc.pid) if p not in tree]
        health = [url + "/_stcore/health"] * 8
        deadline = time.time() + 120
        while time.time() < deadline:  # until the new worker answers (through nginx: both workers)
            try:
                if len({_get(u)[0] for u in health}) == 2:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert len({_get(u)[0] for u in health * 2}) == 2
        tree = process_tree(proc.pid)
    finally:
        stop_server(proc)
    assert proc.returncode == 0  # SIGTERM stops nginx and the workers cleanly
    assert not [p for p in tree if Path(f"/proc/{p}").exists()]  # nothing of it is left


async def _next_run(student) -> None:
    """Read what the server sends ``student`` until the end of its next script run (one the server started)."""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    while True:
        raw = await asyncio.wait_for(student.ws.recv(), timeout=120)
        msg = ForwardMsg()
        msg.ParseFromString(raw)
        kind = msg.WhichOneof("type")
        if kind == "delta":
            student._read_delta(msg.delta, raw)
        elif kind == "script_finished":
            return


@pytest.mark.slow
def test_a_step_after_an_idle_release_starts_afresh_without_an_error(monkeypatch):
    """A Step re-runs only the stage (a fragment), where app.py's idle check does not run: on a lab released
    while idle it must bring the whole page back (the note, a fresh run), never a traceback."""
    from bench.class_load import Student, free_port, start_server, stop_server

    monkeypatch.setenv("PAL_IDLE_MINUTES", "0.1")  # 6 s (start_server hands the environment to the server)
    port = free_port()
    proc = start_server(port)
    url = f"http://127.0.0.1:{port}"
    a, b = Student(0, url), Student(1, url)

    async def scenario():
        await a.open_page()
        await a.step(record=False)
        await asyncio.sleep(7)
        await b.open_page()  # b's page sweeps the seats: a's step is seen (a fragment run: no full run saw it)
        for _ in range(8):  # b's later runs sweep again: a's lab, idle for over 6 s since, is released
            await asyncio.sleep(2.5)
            await b.rerun()
        await a.step(record=False)  # a fragment run of a's stage on the released lab...
        await _next_run(a)  # ...and the page's full run it asks for (a new rerun request could cut it short)
        await a.step(record=False)  # the fresh lab steps
        for s in (a, b):
            await s.close()

    try:
        asyncio.run(scenario())
    finally:
        stop_server(proc)
    assert not a.errors and not b.errors, a.errors + b.errors
    assert b"released after 0.1 idle minutes" in b"".join(a.text)
