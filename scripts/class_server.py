"""A class server on several cores: N Streamlit processes of the app behind one nginx, each browser kept on one.

    python scripts/class_server.py --workers 2 --port 8501          (bash scripts/run.sh --class --workers 2)

Why: one Streamlit process runs Python on one core at a time (the GIL), however many students step at once; a
second process on a second core doubles what a class gets (issue 16's load goals; ``bench/class_load.py
--workers 2`` measures it). A browser session lives in one process (its labs, its uploads, its download links),
so the proxy must send all of a browser's requests to the same worker: nginx gives a browser without one a
cookie ``pal_worker`` (its request id) and routes by a consistent hash of it. Streamlit's own XSRF cookie cannot
serve: its masked value changes with every response.

Every worker runs in class-server mode (``PAL_CLASS_SERVER=1``, ``infra.class_limits``), listens on 127.0.0.1 only,
and shares one random cookie secret (so any worker accepts the cookies another set). nginx runs in the
foreground from a private folder (its config, pid and logs) and a folder for its buffers (an upload over
16 KiB), needing no root and touching nothing in /etc; run as root, its worker drops to ``nobody``, who owns
the buffers' folder and nothing else (``nginx_folders``). The Class page's classes live in a file of that folder the workers share (``PAL_CLASS_STATE``,
``ui.class_room_state.ClassRegistry``): a presenter and their students may be on different workers. So do the
sessions' memory reservations (``PAL_MEMORY_STATE``, ``infra.class_limits.ShareRegistry``), against one total
measured before the workers start (``PAL_CLASS_MEMORY_MB``, ``class_memory_mb``): every session of every
worker reserves its share there before its lab runs, so all of them together stay within it. A worker
that dies (say the kernel's OOM killer) is started again on its port; its students get fresh sessions, the
others go on. Stopping this script (Ctrl+C, SIGTERM) stops nginx and every worker. With ``--workers 1`` it runs one
Streamlit on the public port without nginx.

Raises SystemExit with a message naming the problem when nginx is missing, a port is not free, or an option
would give every worker the same port (``--server.port`` / ``--server.address``: use ``--port`` / ``--address``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STICKY_COOKIE = "pal_worker"
MAX_WORKERS = 64


MAX_URL_BYTES = 16 * 1024  # the longest request line (the page's address) nginx reads; a link is <= 8,000 chars
LINK_TOO_LONG_PAGE = "pal-address-too-long.html"  # what a longer address gets instead of nginx's bare 414


def link_too_long_html(max_url_bytes: int = MAX_URL_BYTES) -> str:
    """The page nginx answers (status 414) to an address longer than ``max_url_bytes``: what the limit is, and
    to save the scenario as a file instead of a link. Plain HTML, no script (nothing of the app has loaded);
    no ' nor $ (it sits in a quoted nginx string, where $ starts a variable)."""
    sys.path.insert(0, str(ROOT))
    from engine.scenarios.scenario_file import MAX_FILE_BYTES, MAX_LINK_CHARS

    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>This link is too long - Paged Attention Lab</title>
<style>body {{ font-family: sans-serif; max-width: 44rem; margin: 3rem auto; padding: 0 1rem; line-height: 1.5 }}</style>
</head><body>
<h1>This link is too long for this class server</h1>
<p>The address you opened is longer than the {max_url_bytes:,} bytes this server reads (status 414). A scenario
link holds at most {MAX_LINK_CHARS:,} characters, so this one was not made by the Playground, or was joined
with something else.</p>
<p><strong>Share the run as a scenario file instead:</strong> in the sidebar of the Playground open
<em>Scenario file and link</em>, press <em>Save JSON</em> (or <em>Save YAML</em>), send the file, and open it there
with <em>Open a scenario file</em> (at most {MAX_FILE_BYTES // 1024:,} KiB).</p>
<p><a href="/">Open the Playground</a></p>
</body></html>
"""
    if "'" in page or "$" in page:
        raise ValueError("link_too_long_html: the page may hold neither ' nor $ (an nginx quoted string)")
    return page


NGINX_WORKER_USER = "nobody"  # who nginx's worker runs as when the class server runs as root (nginx's default)


def nginx_worker_user() -> tuple[str, int, str, int] | None:
    """``(user, uid, group, gid)`` nginx's worker process drops to when this process is root (nginx switches
    to an unprivileged user then: ``NGINX_WORKER_USER`` and its primary group), or None when not root (nginx
    then runs all of itself as this user and ignores a ``user`` directive). Raises SystemExit when root and
    that user does not exist."""
    if os.geteuid() != 0:
        return None
    import grp
    import pwd

    try:
        entry = pwd.getpwnam(NGINX_WORKER_USER)
    except KeyError:
        raise SystemExit(f"class server: running as root, nginx's worker would run as the user "
                         f"{NGINX_WORKER_USER!r}, which does not exist here; run as an ordinary user") from None
    try:
        group = grp.getgrgid(entry.pw_gid).gr_name
    except KeyError:
        group = str(entry.pw_gid)
    return NGINX_WORKER_USER, entry.pw_uid, group, entry.pw_gid


def nginx_folders(base: str | None = None) -> tuple[str, str]:
    """``(folder, temp_folder)``: nginx's private folder (config, pid, logs, the workers' shared class and
    memory files; mode 0700, this user's) and the folder of nginx's temporary buffers (a request body over
    16 KiB, such as a scenario file of up to 256 KiB uploaded by PUT, is written there by nginx's *worker*).
    As root the worker runs as ``NGINX_WORKER_USER``, who may not enter the private folder (the trial's
    "open() .../client_body/0000000001 failed (13: Permission denied)", the upload lost), so the buffers get
    their own folder, mode 0700, owned by that user: only it (and root) can read a student's upload there.
    The safe option: the worker keeps running unprivileged (no ``user root``), and the private folder is not
    opened to anyone. Not root: both are this user's. ``base``: where to create them (default: the temp dir)."""
    folder = tempfile.mkdtemp(prefix="pal-class-nginx-", dir=base)
    temp = tempfile.mkdtemp(prefix="pal-class-nginx-buffers-", dir=base)
    if (worker := nginx_worker_user()) is not None:
        os.chown(temp, worker[1], worker[3])
    return folder, temp


def nginx_config(listen: str, port: int, worker_ports: list[int], folder: str,
                 max_url_bytes: int = MAX_URL_BYTES, temp_folder: str | None = None) -> str:
    """nginx.conf text: listen on ``listen:port``, proxy HTTP and websockets to ``127.0.0.1:<worker_ports>``,
    one worker per browser (the ``pal_worker`` cookie, set on a browser's first response, hashed consistently).
    ``folder``: nginx's private folder (pid, error log); ``temp_folder`` (default ``folder``): its temporary
    buffers (request bodies over 16 KiB), which nginx's worker must be able to write (``nginx_folders``);
    as root the worker's user is named (``user``) so that it is the one that owns ``temp_folder``. An address
    longer than ``max_url_bytes`` gets ``link_too_long_html`` with status 414 (inline: nginx's workers may not
    read the private folder), not nginx's bare "414 Request-URI Too Large". Raises ValueError for no worker
    ports."""
    if not worker_ports:
        raise ValueError("worker_ports is empty: at least one Streamlit worker is needed")
    servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=0;" for p in worker_ports)
    temp = "\n".join(f"    {kind}_temp_path {temp_folder or folder}/{kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    worker = nginx_worker_user()
    user = f"user {worker[0]} {worker[2]};  # as root: the worker drops to this user, who owns the buffers\n" \
        if worker else ""
    return f"""# written by scripts/class_server.py: {len(worker_ports)} Streamlit workers behind one port
{user}worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
{temp}
    client_max_body_size 2m;  # a scenario file is at most 256 KiB
    # the longest address (request line) read; a longer one is answered 414 with the page below
    large_client_header_buffers 4 {max_url_bytes // 1024}k;
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
    # a browser's worker: its cookie, or for its first request a fresh id (then sent to it as the cookie)
    map $cookie_{STICKY_COOKIE} $pal_worker {{ "" $request_id; default $cookie_{STICKY_COOKIE}; }}
    upstream streamlit_workers {{
        hash $pal_worker consistent;
{servers}
    }}
    server {{
        listen {listen}:{port};
        error_page 414 /{LINK_TOO_LONG_PAGE};
        location = /{LINK_TOO_LONG_PAGE} {{
            internal;
            default_type "text/html; charset=utf-8";
            return 414 '{link_too_long_html(max_url_bytes)}';
        }}
        location / {{
            add_header Set-Cookie "{STICKY_COOKIE}=$pal_worker; Path=/; SameSite=Lax; HttpOnly" always;
            add_header X-PAL-Worker $upstream_addr always;  # which worker answered (tests, debugging)
            proxy_pass http://streamlit_workers;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $http_host;  # with its port: Streamlit checks the websocket's Origin against it
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_read_timeout 1d;  # a student's websocket stays open for the whole class
            proxy_send_timeout 1d;
            proxy_buffering off;
        }}
    }}
}}
"""


def port_free(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def worker_command(port: int, extra: list[str]) -> list[str]:
    """The ``streamlit run app.py`` command line of one worker on ``127.0.0.1:port``."""
    return [sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.address", "127.0.0.1",
            "--server.port", str(port), "--server.headless", "true", *extra]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    """Wait until the worker on ``port`` answers /_stcore/health. Raises SystemExit if it exits or times out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"class server: the worker on port {port} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"class server: the worker on port {port} did not answer within {timeout:.0f} s")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


WORKER_BYTES = 800 * 2**20  # one worker's PyTorch, model and a class's labs (the load test: ~0.6-0.9 GB)
WORKER_BASE_BYTES = 640 * 2**20  # one worker before any session: PyTorch and the model (measured ~0.6 GB)


def class_memory_mb(workers: int) -> float:
    """The memory all sessions of all workers may hold together (``PAL_CLASS_MEMORY_MB``, MiB): the operator's
    value when set, else the memory available before the workers start less ``WORKER_BASE_BYTES`` each (a
    worker that measured it after starting would count the others' PyTorch and model, not loaded yet, as
    free). Raises SystemExit when that leaves nothing for sessions, or the memory cannot be read."""
    sys.path.insert(0, str(ROOT))
    from infra.class_limits import CLASS_MEMORY_ENV, _env_number
    from engine.memory import available_host_memory_bytes

    try:
        given = _env_number(CLASS_MEMORY_ENV, 0, 1)
    except ValueError as exc:
        raise SystemExit(f"class server: {exc}") from None
    if given:
        return given
    available = available_host_memory_bytes()
    if available is None:
        raise SystemExit(f"class server: the available memory cannot be read here; set {CLASS_MEMORY_ENV} (MiB "
                         f"all sessions may hold together)")
    left = available - workers * WORKER_BASE_BYTES
    if left <= 0:
        raise SystemExit(f"class server: {available / 2**20:,.0f} MiB available leaves nothing for sessions beside "
                         f"{workers} workers of ~{WORKER_BASE_BYTES / 2**20:,.0f} MiB each; use fewer --workers")
    return left / 2**20
OWN_OPTIONS = ("--server.port", "--server.address")  # set per worker here: one forwarded would clash


def cgroup_cpus(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """Whole CPUs the container's cgroup quota allows (``cpu.max``: "quota period", or "max"), or None."""
    try:
        quota, period = Path(path).read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, int(quota) // int(period))


def default_workers() -> int:
    """One worker per core this process may use, no more than the cgroup's CPU quota allows (``docker run
    --cpus``) nor than the memory available holds at ``WORKER_BYTES`` each; at least 1."""
    sys.path.insert(0, str(ROOT))
    from engine.memory import available_host_memory_bytes

    limits = [len(os.sched_getaffinity(0)), cgroup_cpus()]
    available = available_host_memory_bytes()
    if available is not None:
        limits.append(available // WORKER_BYTES)
    return max(1, min(n for n in limits if n is not None))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=None,
                        help="Streamlit processes (default: one per core this process may use, within the "
                             "container's CPU quota and ~0.8 GB of available memory each)")
    parser.add_argument("--port", type=int, default=8501, help="the port students open")
    parser.add_argument("--address", default="0.0.0.0", help="the interface students reach (default: all)")
    parser.add_argument("--first-worker-port", type=int, default=None,
                        help="workers listen on 127.0.0.1 from this port up (default: --port + 1)")
    args, extra = parser.parse_known_args(argv)
    if args.workers is None:
        args.workers = default_workers()
    if not 1 <= args.workers <= MAX_WORKERS:
        parser.error(f"--workers {args.workers}: between 1 and {MAX_WORKERS}")
    if clash := [o for o in extra if o.split("=", 1)[0] in OWN_OPTIONS]:
        parser.error(f"{clash[0]}: each worker gets its own port and address here; use --port / --address")
    return args, extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    os.environ["PAL_CLASS_SERVER"] = "1"
    if args.workers == 1:  # no proxy needed
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "streamlit", "run", "app.py", "--server.address",
                                  args.address, "--server.port", str(args.port), *extra])
    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
    if nginx is None:
        raise SystemExit("class server: --workers > 1 needs nginx (Debian: apt-get install nginx), or run "
                         "--workers 1")
    first = args.first_worker_port or args.port + 1
    ports = list(range(first, first + args.workers))
    for address, port in [(args.address, args.port)] + [("127.0.0.1", p) for p in ports]:
        if not port_free(address, port):
            raise SystemExit(f"class server: port {port} on {address} is in use")
    memory_mb = class_memory_mb(args.workers)
    folder, temp_folder = nginx_folders()
    Path(folder, "nginx.conf").write_text(nginx_config(args.address, args.port, ports, folder,
                                                       temp_folder=temp_folder))
    # one cookie secret for all (Streamlit takes it from the environment only, never from the command line)
    # and one file for the Class page's classes: a presenter and the students may be on different workers
    # and one file for the sessions' memory reservations, so that all workers' sessions together stay within
    # one total (infra.class_limits.ShareRegistry), measured before any worker started
    env = {**os.environ, "STREAMLIT_SERVER_COOKIE_SECRET": secrets.token_hex(16),
           "PAL_CLASS_STATE": f"{folder}/classes.json", "PAL_MEMORY_STATE": f"{folder}/memory.json",
           "PAL_CLASS_MEMORY_MB": f"{memory_mb:.1f}"}
    procs: list[subprocess.Popen] = []

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        for port in ports:
            procs.append(subprocess.Popen(worker_command(port, extra), cwd=ROOT, env=env))
        for port, proc in zip(ports, procs):
            wait_healthy(port, proc)
        # -e: nginx opens its default error log before reading the config (/var/log/nginx: root's)
        procs.append(subprocess.Popen([nginx, "-p", folder, "-e", f"{folder}/error.log", "-c",
                                       f"{folder}/nginx.conf"]))
        print(f"class server: http://{args.address}:{args.port} -> {args.workers} workers on 127.0.0.1:"
              f"{ports[0]}-{ports[-1]} (nginx, one worker per browser)", flush=True)
        return supervise(procs, ports, extra, env)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second Ctrl+C / SIGTERM must not cut the cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop(procs)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(temp_folder, ignore_errors=True)


def supervise(procs: list[subprocess.Popen], ports: list[int], extra: list[str], env: dict) -> int:
    """Watch the workers (``procs[:-1]``) and nginx (``procs[-1]``): a worker that exits is started again on
    its port (its students' sessions are lost: their pages reconnect to a fresh session; everyone else's go
    on); if nginx exits, returns 1 (the caller stops the workers)."""
    while True:
        time.sleep(0.5)
        if procs[-1].poll() is not None:
            print(f"class server: nginx exited ({procs[-1].returncode}); stopping", file=sys.stderr)
            return 1
        for i, port in enumerate(ports):
            if procs[i].poll() is not None:
                print(f"class server: the worker on port {port} exited ({procs[i].returncode}); starting it again",
                      file=sys.stderr, flush=True)
                procs[i] = subprocess.Popen(worker_command(port, extra), cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
