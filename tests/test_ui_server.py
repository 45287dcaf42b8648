"""The Server page (ui/server.py) and its figures (viz/server.py): a real server's prefix cache from its KV
events, live over ZMQ and replayed from a capture.

Live tests run the lab's own engine in this process, publishing in vLLM's format (``EngineConfig(
kv_events_endpoint=...)``), and read the page with AppTest, re-running it until the numbers arrive (bounded
waits). The replay tests use ``tests/data/kv_capture_small.jsonl``, recorded by ``make_small_capture`` below
(``python tests/test_ui_server.py`` records it again).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from metrics_http import serve_metrics

from engine.watch.cache_mirror import PrefixCacheMirror

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "data" / "kv_capture_small.jsonl"
PAGE = "ui/server.py"


# ------------------------------------------------------------------------------------ the test capture
def _engine_config(**fields):
    from engine import EngineConfig
    return EngineConfig(semantics="v1", device="cpu", dtype="float32", kv_events_endpoint="tcp://127.0.0.1:0",
                        kv_events_replay_endpoint="tcp://127.0.0.1:0", **fields)


def _run_workload_steps(engines_and_workloads, pause_s: float = 0.0) -> None:
    """Step several engines in turn (so their batches interleave in time), each fed its workload by arrival
    step, until all are done."""
    pending = [sorted(w.requests, key=lambda r: r.arrival_step) for _, w in engines_and_workloads]
    starts = [e.step_count for e, _ in engines_and_workloads]
    while any(pending) or any(e.has_unfinished() for e, _ in engines_and_workloads):
        for i, (engine, _) in enumerate(engines_and_workloads):
            now = engine.step_count - starts[i]
            while pending[i] and pending[i][0].arrival_step <= now:
                r = pending[i].pop(0)
                engine.add_request(r.prompt, r.params)
            if engine.has_unfinished():
                engine.step()
        if pause_s:
            time.sleep(pause_s)


def make_small_capture(path: str | Path) -> dict:
    """Record a small two-rank capture the way the Server page records one: two lab engines (vLLM V1
    semantics, prefix caching on) publish their KV events in vLLM's format on their own endpoints (ranks 0
    and 1, as a data-parallel vLLM does); one ``KVEventSubscriber`` per endpoint receives them, and
    ``capture_from_raw`` + ``dumps_capture`` write what was received.

    Rank 0 runs "shared-prefix" (eight requests, one system prompt: a tree with one trunk and eight
    branches); rank 1 runs "batch" in 12 blocks (evictions), then resets its prefix cache (an
    AllBlocksCleared) and runs two more requests. Returns counts for the log."""
    from engine import LLMEngine, SamplingParams
    from engine.watch.capture import capture_from_raw, dumps_capture, new_header
    from engine.watch.kv_subscriber import KVEventSubscriber
    from engine.scenarios.presets import get_scenario

    e0 = LLMEngine(_engine_config(block_size=16, num_blocks=64, max_model_len=256))
    e1 = LLMEngine(_engine_config(block_size=16, num_blocks=12, max_model_len=128), (e0.model, e0.tokenizer))
    engines = [e0, e1]
    subs = [KVEventSubscriber(e.kv_event_publisher.endpoint, e.kv_event_publisher.replay_endpoint, rank=i)
            for i, e in enumerate(engines)]
    try:
        assert all(s.wait_for(lambda v: v.state == "connected", 10) for s in subs)
        tokenize = lambda text: e0.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        _run_workload_steps([(e0, get_scenario("shared-prefix").make(0, tokenize)),
                             (e1, get_scenario("batch").make(0, tokenize))], pause_s=0.01)
        assert e1.reset_prefix_cache()
        for i, prompt in enumerate(["ROMEO. But soft, what light through yonder window breaks? It is the east",
                                    "JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father"]):
            e1.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True))
        while e1.has_unfinished():
            e1.step()
        published = []
        for e in engines:
            e.kv_event_publisher.flush()
            published.append(e.kv_event_publisher.published)
        for s, n in zip(subs, published):
            assert s.wait_for(lambda v, n=n: v.received >= n, 10), (s.view().received, n)
        raws = [r for s in subs for r in s.raw_batches()]
        header = new_header("the lab's engine, vLLM V1 semantics, as two data-parallel ranks (tests/test_ui_server.py)",
                            [s.endpoint for s in subs], model="assets/tiny_model", block_size=16)
        Path(path).write_text(dumps_capture(capture_from_raw(raws, header)), encoding="utf-8")
        return {"batches": len(raws), "published": published,
                "blocks": [s.view().mirror.num_blocks for s in subs]}
    finally:
        for s in subs:
            s.stop()
        for e in engines:
            e.close()


if __name__ == "__main__":
    print(make_small_capture(CAPTURE))


# ------------------------------------------------------------------------------------------- helpers
def new_app(mode: str | None = None):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180)
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception
    if mode is not None:
        at.radio(key="server_mode").set_value(mode).run()
        assert not at.exception
    return at


def button(at, label: str):
    return next(b for b in at.button if b.label == label)


def shown(at) -> list[dict]:
    """Each rank column's metrics, in rank order: [{label: value}]."""
    out: list[dict] = []
    for m in at.metric:
        if m.label == "cached blocks":
            out.append({})
        if out:
            out[-1][m.label] = m.value
    return out


def texts(at) -> str:
    parts = [e.value for kind in ("markdown", "caption", "error", "warning", "info", "success")
             for e in getattr(at, kind)]
    return "\n".join(parts)


def charts(at) -> list[dict]:
    import json

    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def upload(at, name: str, content: bytes) -> None:
    at.sidebar.file_uploader(key="replay_upload").set_value((name, content, "application/octet-stream")).run()
    assert not at.exception


def rerun_until(at, predicate, timeout_s: float = 30.0, pause_s: float = 0.2) -> bool:
    """Re-run the page (as the live fragment's timer does) until ``predicate(at)``; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        at.run()
        assert not at.exception
        if predicate(at):
            return True
        time.sleep(pause_s)
    return False


def set_endpoints(at, endpoints: str, replays: str = "", url: str = "") -> None:
    at.text_input(key="server_endpoints").set_value(endpoints)
    at.text_input(key="server_replays").set_value(replays)
    at.text_input(key="server_metrics_url").set_value(url)


def connect(at, endpoints: str, replays: str = "", url: str = "") -> None:
    set_endpoints(at, endpoints, replays, url)
    button(at, "Connect").click().run()
    assert not at.exception


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_threads(endpoint: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kv-events-{endpoint}" and t.is_alive()]


def wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def live_app():
    """A page in live mode; whatever it connected is stopped afterwards."""
    at = new_app("Live server")
    yield at
    live = at.session_state["server_live"] if "server_live" in at.session_state else None
    if live is not None:
        live.stop()


def mirror_of(events_by_batch: list[list[dict]], rank: int = 0) -> PrefixCacheMirror:
    m = PrefixCacheMirror(rank=rank)
    for seq, events in enumerate(events_by_batch):
        m.apply(seq, 1000.0 + seq, events)
    return m


def stored(hashes: list[str], parent: str | None, tokens: list[int], block_size: int = 2) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU"}


def huge_event(n: int = 50_000, block_size: int = 16) -> dict:
    """One BlockStored of ``n`` chained blocks (the lab's form: hashes as hex digests)."""
    return stored([format(i + 1, "064x") for i in range(n)], None, [i % 1000 for i in range(n * block_size)],
                  block_size)


# ------------------------------------------------------------------------------------------- viz unit
def test_tree_layout_chains_stay_on_a_row_and_branches_open_rows_below():
    """A -> B -> C and B -> D: the chain A B C is row 0, D (C's sibling) row 1, one column right of B."""
    m = mirror_of([[stored(["a", "b", "c"], None, [1, 2, 3, 4, 5, 6])], [stored(["d"], "b", [7, 8])]])
    from viz.server import prefix_tree_figure, tree_layout

    lay = tree_layout(m)
    assert lay["pos"] == {"a": (0, 0), "b": (1, 0), "c": (2, 0), "d": (2, 1)}
    assert lay["roots"] == ["a"] and sorted(lay["edges"]) == [("a", "b"), ("b", "c"), ("b", "d")]
    fig = prefix_tree_figure(m)
    edges, nodes = fig.data
    assert len(nodes.x) == 4 and list(nodes.x) == [0, 1, 2, 2] and list(nodes.y) == [0, 0, 0, 1]
    assert len([x for x in edges.x if x is None]) == 3  # three edges
    assert "rank 0: 4 prefixes in 1 tree (4 blocks = 8 tokens)" in fig.layout.title.text


def test_tree_hover_says_hash_tokens_text_parent_copies_batch_and_age():
    m = mirror_of([[stored(["a1b2c3d4e5f6a7b8"], None, [1, 2])], [stored(["ffff000011112222"], "a1b2c3d4e5f6a7b8",
                                                                       [3, 4])],
                   [stored(["ffff000011112222"], "a1b2c3d4e5f6a7b8", [3, 4])]])  # the same hash, a second copy
    from viz.server import prefix_tree_figure

    fig = prefix_tree_figure(m, decode=lambda ids: "<" + "".join(chr(96 + i) for i in ids) + ">")
    nodes = fig.data[1]
    child = nodes.hovertext[1]
    assert "block ffff00001111" in child and "[3, 4]" in child
    assert "text: &lt;cd&gt;" in child  # decoded, HTML escaped
    assert "parent: a1b2c3d4e5f6" in child and "copies: 2 physical blocks" in child
    assert "stored by batch #1, 1.0 s before the last batch" in child
    assert "parent: none" in nodes.hovertext[0] and "0 s" not in nodes.hovertext[0].split("stored")[0]
    assert list(nodes.text) == ["", "x2"]  # copies > 1 is labelled
    assert nodes.marker.size[1] > nodes.marker.size[0]
    assert "xN: held by N blocks" in fig.layout.title.text
    by_root = prefix_tree_figure(m, color_by="root")
    assert "colour: one per tree" in by_root.layout.title.text
    with pytest.raises(ValueError, match="color_by"):
        prefix_tree_figure(m, color_by="size")


def test_tree_draws_at_most_max_blocks_and_says_so():
    m = mirror_of([[huge_event(50_000)]])
    from viz.server import prefix_tree_figure

    fig = prefix_tree_figure(m)
    assert len(fig.data[1].x) == 1500
    assert "showing 1,500 of 50,000 blocks (the most recently stored)" in fig.layout.title.text
    assert "50,000 blocks = 800,000 tokens" in fig.layout.title.text
    small = prefix_tree_figure(m, max_blocks=10)
    assert len(small.data[1].x) == 10 and "showing 10 of 50,000" in small.layout.title.text


def test_tree_of_an_empty_cache_says_so():
    from viz.server import prefix_tree_figure

    fig = prefix_tree_figure(PrefixCacheMirror())
    assert len(fig.data) == 0
    assert "waiting for events" in fig.layout.annotations[0].text
    emptied = mirror_of([[stored(["a"], None, [1, 2])], [{"type": "AllBlocksCleared"}]])
    assert "empty after 2 batches" in prefix_tree_figure(emptied).layout.annotations[0].text


def test_tree_survives_a_parent_cycle():
    """A malformed stream can make two blocks each other's parent: each is drawn once, nothing hangs."""
    m = mirror_of([[stored(["a"], "b", [1, 2])], [stored(["b"], "a", [3, 4])]])
    from viz.server import prefix_tree_figure, tree_layout

    assert set(tree_layout(m)["pos"]) == {"a", "b"}
    assert len(prefix_tree_figure(m).data[1].x) == 2


def test_batch_figures_show_stores_evictions_clears_and_the_pool():
    m = mirror_of([[stored(["a", "b"], None, [1, 2, 3, 4])],
                   [{"type": "BlockRemoved", "block_hashes": ["b"], "medium": "GPU"}],
                   [{"type": "AllBlocksCleared"}]])
    from viz.server import batch_activity_figure, cache_size_figure

    fig = batch_activity_figure(m.history)
    traces = {t.name: t for t in fig.data}
    assert list(traces["stored"].y) == [2, 0, 0] and list(traces["removed (evicted)"].y) == [0, -1, -1]
    assert list(traces["all blocks cleared"].x) == [2]
    size = cache_size_figure(m.history, num_gpu_blocks=65)
    assert list(size.data[0].y) == [2, 1, 0]
    assert size.layout.shapes[0].y0 == 64  # the pool less vLLM's null block
    assert not cache_size_figure(m.history).layout.shapes
    m.apply(3, 1003.0, [stored(["c"], None, [5, 6])], replayed=True)  # recovered from the replay socket
    traces = {t.name: t for t in batch_activity_figure(m.history).data}
    assert list(traces["stored (from the replay socket)"].x) == [3] and list(traces["stored"].x) == [0, 1, 2]
    assert traces["stored (from the replay socket)"].marker.pattern.shape == "/"


def test_rank_and_server_numbers_come_from_engine_metrics():
    from engine import metrics
    from viz.server import rank_numbers, server_numbers

    m = mirror_of([[stored(["a", "b", "c"], None, [1, 2, 3, 4, 5, 6])]])
    n = rank_numbers(m, num_gpu_blocks=11)
    assert n["blocks"] == 3 and n["tokens"] == 6 and n["prefixes"] == 3 and n["roots"] == 1
    assert n["pool_share_pct"] == metrics.cached_share_pct(3, 11) == 30.0
    assert rank_numbers(m)["pool_share_pct"] is None
    values = {"kv_cache_usage": 0.25, "prefix_cache_queries": 200.0, "prefix_cache_hits": 50.0, "num_preemptions": 3.0}
    s = server_numbers(values)
    assert s["hit_rate_pct"] == metrics.server_hit_rate_pct(values) == 25.0
    assert s["kv_cache_usage_pct"] == 25.0 and s["preemptions"] == 3 and s["running"] is None


def test_state_lines_say_what_to_do():
    from types import SimpleNamespace as NS

    from viz.server import state_line

    view = lambda state, at=None: NS(state=state, endpoint="tcp://127.0.0.1:5557", last_batch_at=at)  # noqa: E731
    assert state_line(view("unreachable")).startswith("unreachable: nothing listens at tcp://127.0.0.1:5557: is the "
                                                      "server started with --kv-events-config")
    assert state_line(view("connected")) == "connected, waiting for events"
    assert state_line(view("idle", 100.0), now=112.0) == "idle: no batch for 12 s"
    assert state_line(view("live", 100.0), now=100.5) == "live: last batch 0.5 s ago"
    assert state_line(view("disconnected")).startswith("disconnected: the server went away; showing what was")


def test_server_figures_import_neither_torch_nor_streamlit_nor_zmq():
    import subprocess
    import sys

    code = ("import sys, viz.server; bad = [m for m in ('torch', 'streamlit', 'zmq') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --------------------------------------------------------------------------------------------- replay
def test_the_page_loads_in_both_modes():
    at = new_app()
    assert at.title[0].value == "Server"
    assert "Not connected" in texts(at)
    assert "BlockStored" in texts(at) and "vLLM V1" in texts(at)
    at.radio(key="server_mode").set_value("Replay a capture").run()
    assert not at.exception
    assert "Choose a capture" in texts(at) or "batch 0 of" in texts(at)  # a shipped capture may load itself


def test_replay_step_back_and_scrub_show_the_capture_state():
    from engine.watch.capture import CaptureReplay, read_capture

    replay = CaptureReplay(read_capture(CAPTURE))
    total = len(replay)
    at = new_app("Replay a capture")
    upload(at, CAPTURE.name, CAPTURE.read_bytes())
    assert f"batch 0 of {total}" in texts(at)

    def expect(k: int) -> None:
        state = replay.state(k)
        want = [{"cached blocks": f"{state.mirrors[r].num_blocks:,}", "tokens": f"{state.mirrors[r].num_tokens:,}"}
                for r in sorted(state.mirrors)]
        got = [{k2: v for k2, v in rank.items() if k2 in ("cached blocks", "tokens")} for rank in shown(at)]
        assert got == want, (k, got, want)
        assert at.session_state["replay_pos"] == k
        if k:
            assert f"batch {k} of {total}" in texts(at)

    expect(0)
    for k in (1, 2, 3):
        button(at, "Step").click().run()
        assert not at.exception
        expect(k)
    button(at, "Back").click().run()
    expect(2)
    at.slider(key="replay_scrub").set_value(20).run()
    assert not at.exception
    expect(20)
    at.slider(key="replay_scrub").set_value(total).run()
    expect(total)
    assert button(at, "Step").disabled  # the end
    titles = [c["layout"]["title"]["text"] for c in charts(at)]
    final = replay.state(total).mirrors
    assert any(t.startswith(f"rank 0: {len(final[0].blocks)} prefixes") for t in titles)
    assert any("AllBlocksCleared" in str(c["data"]) for c in charts(at))  # rank 1's reset is marked


def test_replay_play_advances_and_stops_at_the_end():
    at = new_app("Replay a capture")
    upload(at, CAPTURE.name, CAPTURE.read_bytes())
    at.select_slider(key="replay_speed").set_value(50).run()
    button(at, "Play").click().run()  # each run of the page is one tick of the timer
    assert not at.exception and at.session_state["replay_playing"]
    first = at.session_state["replay_pos"]
    assert first > 0
    for _ in range(60):  # ticks until the end (50 batches/s by the clock, each run one tick)
        at.run()
        if not at.session_state["replay_playing"]:
            break
        time.sleep(0.05)
    assert not at.exception
    assert at.session_state["replay_pos"] == len(at.session_state["replay"]["replay"])
    assert not at.session_state["replay_playing"]  # stopped at the end
    assert any(b.label == "Play" for b in at.button)


def test_a_bad_upload_says_why_and_keeps_the_capture_shown():
    at = new_app("Replay a capture")
    upload(at, CAPTURE.name, CAPTURE.read_bytes())
    button(at, "Step").click().run()
    before = shown(at)
    lines = CAPTURE.read_bytes().splitlines()
    upload(at, "broken.jsonl", b"\n".join(lines[:3] + [b'{"kind": "batch", "rank": 0}'] + lines[4:]))
    errors = [e.value for e in at.error]
    assert any("broken.jsonl: line 4: batch field 'seq' is None" in e for e in errors), errors
    assert at.session_state["replay"]["name"] == CAPTURE.name and shown(at) == before  # nothing lost
    button(at, "Step").click().run()
    assert not at.exception and at.session_state["replay_pos"] == 2
    upload(at, "notes.txt", b"hello")
    assert any("notes.txt: line 1: not JSON" in e.value for e in at.error)
    at.sidebar.file_uploader(key="replay_upload").clear().run()  # the bad file taken out: its error goes
    assert not at.exception and not at.error and at.session_state["replay_pos"] == 2


# ----------------------------------------------------------------------------------------------- live
def test_a_bad_endpoint_is_named_and_nothing_connects(live_app):
    at = live_app
    connect(at, "http://127.0.0.1:5557")
    assert any("must be a ZMQ endpoint" in e.value and "'http://127.0.0.1:5557'" in e.value for e in at.error)
    assert "server_live" not in at.session_state
    connect(at, "tcp://*:5557")
    assert any("'tcp://*:5557' is the address a server binds" in e.value and "tcp://127.0.0.1:5557" in e.value
               for e in at.error)
    connect(at, "tcp://127.0.0.1:5557", replays="tcp://127.0.0.1:5558, tcp://127.0.0.1:5559")
    assert any("2 replay endpoint(s) for 1 endpoint(s)" in e.value for e in at.error)
    connect(at, "tcp://127.0.0.1:5557", url="127.0.0.1:8000/metrics")
    assert any("'127.0.0.1:8000/metrics' must start with http://" in e.value for e in at.error)
    connect(at, "tcp://127.0.0.1")  # ZMQ's own refusal, through the subscriber
    assert any("tcp://127.0.0.1" in e.value and e.value.startswith("Not connected") for e in at.error)
    assert "server_live" not in at.session_state and "Not connected" in texts(at)


def test_a_bad_tokenizer_folder_is_a_message_and_the_page_still_draws(live_app, tmp_path):
    at = live_app
    at.sidebar.text_input(key="server_tokenizer").set_value(str(tmp_path / "nope")).run()
    assert not at.exception
    assert any("does not exist; blocks show token ids only" in w.value for w in at.sidebar.warning)
    (tmp_path / "empty").mkdir()
    at.sidebar.text_input(key="server_tokenizer").set_value(str(tmp_path / "empty")).run()
    assert not at.exception
    assert any("No tokenizer could be loaded from" in w.value for w in at.sidebar.warning)
    at.radio(key="server_mode").set_value("Replay a capture").run()
    upload(at, CAPTURE.name, CAPTURE.read_bytes())
    button(at, "Step").click().run()
    assert not at.exception and charts(at)
    assert "text: " not in charts(at)[0]["data"][1]["hovertext"][0]  # ids only


def test_nothing_listening_is_unreachable_and_stop_ends_the_thread(live_app):
    at = live_app
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    connect(at, endpoint)
    assert rerun_until(at, lambda a: any(f"unreachable: nothing listens at {endpoint}" in e.value for e in a.error))
    assert len(kv_threads(endpoint)) == 1
    button(at, "Stop").click().run()
    assert not at.exception
    assert wait(lambda: not kv_threads(endpoint))
    assert "stopped: showing what was received" in texts(at)


def test_live_view_follows_the_engine_and_reconnect_never_doubles_threads(live_app, tmp_path):
    from engine import LLMEngine
    from engine.watch.capture import read_capture
    from engine.scenarios.presets import get_scenario

    at = live_app
    engine = LLMEngine(_engine_config(block_size=16, num_blocks=64, max_model_len=256))
    try:
        pub = engine.kv_event_publisher
        connect(at, pub.endpoint, pub.replay_endpoint)
        button(at, "Connect").click().run()  # twice: the same endpoints keep the one set
        assert len(kv_threads(pub.endpoint)) == 1
        live = at.session_state["server_live"]
        tokenize = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        _run_workload_steps([(engine, get_scenario("shared-prefix").make(0, tokenize))])
        pub.flush()
        cached = engine.block_manager.cached_blocks
        want_blocks = sum(len(b) for b in cached.values())
        assert want_blocks > 10
        assert rerun_until(at, lambda a: shown(a) and shown(a)[0]["cached blocks"] == f"{want_blocks:,}"), shown(at)
        assert shown(at)[0]["tokens"] == f"{want_blocks * 16:,}"
        tree = charts(at)[0]
        assert tree["layout"]["title"]["text"].startswith(f"rank 0: {len(cached)} prefixes")
        assert "text: " in tree["data"][1]["hovertext"][0]  # decoded with the embedded model's tokenizer
        assert f"batches {pub.published}" in texts(at) and "malformed 0" in texts(at)
        capture = read_capture(live.capture_text().encode())  # what Download capture sends
        assert len(capture.batches) == pub.published and capture.header["endpoints"] == [pub.endpoint]
        # reconnecting to other endpoints stops the old set first
        other = f"tcp://127.0.0.1:{free_port()}"
        connect(at, other)
        assert wait(lambda: not kv_threads(pub.endpoint)) and len(kv_threads(other)) == 1
        assert at.session_state["server_live"] is not live and not live.running
    finally:
        engine.close()


def test_a_malformed_message_is_counted_and_later_batches_still_apply(live_app):
    import zmq

    from engine.kv_events import encode_batch

    at = live_app
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        connect(at, f"tcp://127.0.0.1:{port}")
        assert rerun_until(at, lambda a: "connected, waiting for events" in texts(a))
        time.sleep(0.3)  # the subscription reaches the publisher
        send = lambda seq, payload: pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))  # noqa: E731
        send(0, encode_batch([stored([format(1, "064x"), format(2, "064x")], None, [1, 2, 3, 4])]))
        assert rerun_until(at, lambda a: shown(a) and shown(a)[0]["cached blocks"] == "2")
        send(1, b"garbage")
        assert rerun_until(at, lambda a: "malformed 1" in texts(a))
        assert any("skipped batch 1: not msgpack" in w.value for w in at.warning)
        assert shown(at)[0]["cached blocks"] == "2"  # nothing already shown is lost
        send(2, encode_batch([stored([format(3, "064x")], format(2, "064x"), [5, 6])]))
        assert rerun_until(at, lambda a: shown(a)[0]["cached blocks"] == "3")
        assert "malformed 1" in texts(at)
    finally:
        pub.close(linger=0)


def test_a_huge_batch_is_applied_and_the_tree_draws_a_capped_part(live_app):
    from engine.kv_publisher import KVEventPublisher

    at = live_app
    with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        connect(at, pub.endpoint, pub.replay_endpoint)
        assert rerun_until(at, lambda a: "connected, waiting for events" in texts(a))
        pub.publish([huge_event(50_000)])
        pub.flush()
        assert rerun_until(at, lambda a: shown(a) and shown(a)[0]["cached blocks"] == "50,000", timeout_s=60)
    assert shown(at)[0]["tokens"] == "800,000"
    tree = charts(at)[0]
    assert "showing 1,500 of 50,000 blocks" in tree["layout"]["title"]["text"]
    assert len(tree["data"][1]["x"]) == 1500


METRICS_TEXT = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="2",num_gpu_blocks="65"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
"""


@pytest.fixture
def metrics_url():
    """A tiny HTTP server answering /metrics in vLLM's exposition format."""
    with serve_metrics(lambda: METRICS_TEXT) as url:
        yield url


def test_metrics_give_the_pool_share_and_the_servers_own_counters(live_app, metrics_url):
    from engine import metrics
    from engine.kv_publisher import KVEventPublisher
    from engine.watch.server_metrics import parse_metrics

    at = live_app
    values = parse_metrics(METRICS_TEXT)
    with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
        connect(at, pub.endpoint, pub.replay_endpoint, url=metrics_url)
        assert rerun_until(at, lambda a: "connected, waiting for events" in texts(a))
        pub.publish([stored([format(1, "064x"), format(2, "064x")], None, [1, 2, 3, 4])])
        want_share = f"{metrics.cached_share_pct(2, 65):.1f}%"
        assert rerun_until(at, lambda a: shown(a) and shown(a)[0].get("share of pool") == want_share), shown(at)
    got = {m.label: m.value for m in at.metric}
    assert got["prefix cache hit rate"] == f"{metrics.server_hit_rate_pct(values):.1f}%" == "25.0%"
    assert got["KV cache usage"] == "25.0%" and got["preemptions"] == "3" and got["pool (blocks)"] == "65"
    # a /metrics nobody answers: said plainly, the events unaffected
    button(at, "Stop").click().run()
    connect(at, f"tcp://127.0.0.1:{free_port()}", url=f"http://127.0.0.1:{free_port()}/metrics")
    assert rerun_until(at, lambda a: any("/metrics unreachable: cannot read metrics from" in w.value
                                         for w in a.warning))


def test_a_batch_in_words():
    from viz.server import batch_line

    m = mirror_of([[stored(["a", "b"], None, [1, 2, 3, 4])],
                   [{"type": "BlockRemoved", "block_hashes": ["b"], "medium": "GPU"}],
                   [{"type": "AllBlocksCleared"}, stored(["c"], None, [5, 6])]])
    first, evict, reset = m.history
    assert batch_line(0, first, 1, 3) == ("batch 1 of 3: rank 0, #0: stored 2 blocks, removed none; cache 2 blocks "
                                          "= 4 tokens")
    assert "stored 0 blocks, removed 1 (evicted); cache 1 block = 2 tokens" in batch_line(0, evict)
    assert "removed 1: all blocks cleared (AllBlocksCleared" in batch_line(0, reset)


def test_a_port_that_is_not_a_publisher_and_a_late_join_are_said_on_the_page(live_app):
    """Rank 0 is an HTTP-like port (answers ZMQ's greeting with 400 and closes, as vLLM's API port does);
    rank 1 a publisher already at batch 40, watched without a replay endpoint."""
    import socket

    import zmq

    from engine.kv_events import encode_batch

    http = socket.socket()
    http.bind(("127.0.0.1", 0))
    http.listen()
    http.settimeout(0.2)
    running = True

    def serve() -> None:
        while running:
            try:
                c, _ = http.accept()
            except OSError:
                continue
            c.recv(64)
            c.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            c.close()

    xpub = zmq.Context.instance().socket(zmq.XPUB)  # XPUB: sends once the page's subscription reaches it
    xpub.setsockopt(zmq.LINGER, 0)
    pub_port = xpub.bind_to_random_port("tcp://127.0.0.1")

    def publish() -> None:
        if xpub.poll(30_000):
            xpub.recv()
            xpub.send_multipart((b"", (40).to_bytes(8, "big"), encode_batch([stored(["ab" * 32], None, [1, 2])])))

    threads = [threading.Thread(target=serve, daemon=True), threading.Thread(target=publish, daemon=True)]
    for t in threads:
        t.start()
    http_endpoint = f"tcp://127.0.0.1:{http.getsockname()[1]}"
    try:
        at = live_app
        connect(at, f"{http_endpoint}, tcp://127.0.0.1:{pub_port}")
        assert rerun_until(at, lambda a: "the view starts at batch 40" in texts(a)
                           and any(e.value.startswith("not a KV event publisher") for e in a.error)), texts(at)
        said = texts(at)
        assert f"{http_endpoint} accepted the TCP connection but did not answer ZMQ's handshake" in said
        assert "went away" not in said and "blocks stored before it are unknown" in said
    finally:
        running = False
        threads[0].join(timeout=2)
        threads[1].join(timeout=31)
        http.close()
        xpub.close()


@pytest.mark.slow
def test_the_caption_names_every_count_on_the_page(live_app):
    """The live caption under each rank names every count the subscriber keeps, read from its view: fed a late
    join (batch 40), a duplicate (41 again), an impossible jump (10**12, not continued), a gap (45 after 42: 43
    and 44 lost, no replay endpoint) and a malformed payload (46). Before, it showed malformed, gaps and lost
    only (and the 40 batches before the join nowhere)."""
    import zmq

    from engine.kv_events import encode_batch

    xpub = zmq.Context.instance().socket(zmq.XPUB)  # XPUB: sends once the page's subscription reaches it
    xpub.setsockopt(zmq.LINGER, 0)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    batch = lambda seq, h: (b"", seq.to_bytes(8, "big"),  # noqa: E731
                            encode_batch([stored([format(h, "064x")], None, [h, h + 1])]))

    def publish() -> None:
        if xpub.poll(30_000):
            xpub.recv()
            for m in (batch(40, 1), batch(41, 2), batch(41, 3), batch(10**12, 4), batch(42, 5), batch(45, 6),
                      (b"", (46).to_bytes(8, "big"), b"not msgpack\xc1"), batch(47, 7)):
                xpub.send_multipart(m)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        at = live_app
        connect(at, f"tcp://127.0.0.1:{port}")
        assert rerun_until(at, lambda a: any(c.value.startswith("batches 5 applied") for c in a.caption)), texts(at)
        caption = next(c for c in at.caption if c.value.startswith("batches "))
        assert caption.value == ("batches 5 applied (0 from the replay socket) · malformed 1 · duplicate or out of "
                                 "order 1 · impossible sequence jumps 1 · gaps 1 · lost 2 · before the watch began "
                                 "40 (not lost)")
        assert "before the watch began: batches published before the first one this watch saw" in caption.help
    finally:
        thread.join(timeout=31)
        xpub.close()
