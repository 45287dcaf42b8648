"""A class server on several cores (scripts/class_server.py): N Streamlit workers behind nginx, each browser kept
on one worker by the ``pal_worker`` cookie; students stepping through the proxy see only their own labs."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
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
    assert "pid /tmp/x/nginx.pid;" in text and "daemon off;" in text  # private folder, foreground


def test_no_workers_and_a_bad_count_are_refused_by_name():
    launcher = _launcher()
    with pytest.raises(ValueError, match="worker_ports is empty"):
        launcher.nginx_config("0.0.0.0", 8501, [], "/tmp/x")
    with pytest.raises(SystemExit):
        launcher.parse_args(["--workers", "0"])
    args, extra = launcher.parse_args(["--workers", "3", "--port", "9000", "--server.maxUploadSize", "1"])
    assert (args.workers, args.port, extra) == (3, 9000, ["--server.maxUploadSize", "1"])


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
    from bench.class_load import free_port, run_class, start_server, stop_server

    port = free_port()
    proc = start_server(port, workers=2)
    try:
        url = f"http://127.0.0.1:{port}"
        first = [_get(url + "/_stcore/health") for _ in range(16)]  # 16 new browsers
        assert len({worker for worker, _ in first}) == 2  # both workers serve (all on one: 2 in 65,536)
        worker, cookie = first[0]
        assert {_get(url + "/_stcore/health", cookie)[0] for _ in range(5)} == {worker}  # a browser stays
        result = asyncio.run(run_class(url, proc.pid, 4, 1))  # 4 students step through the proxy
        assert not result.errors and not result.leaks and result.own_seen == 4
    finally:
        stop_server(proc)
    assert proc.returncode == 0  # SIGTERM stops nginx and the workers cleanly
