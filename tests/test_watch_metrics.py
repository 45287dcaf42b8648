"""The mirror's own metrics for Prometheus (issue 27, item 3: ``watch --metrics-port``) and rates over time
by the server's clock (item 4).

The exposition is read back with prometheus_client's own parser; two lab publishers play two servers, and a
tiny HTTP server plays one's vLLM /metrics whose counters grow with every read (so the windowed hit rate
differs from the lifetime one)."""

from __future__ import annotations

import io
import threading
import time
import urllib.request
from argparse import Namespace

import pytest
from metrics_http import serve_metrics
from prometheus_client.parser import text_string_to_metric_families

from engine import metrics
from engine.kv_publisher import KVEventPublisher
from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.command import watch as watch_cli
from engine.watch.rates import binned, hit_rate_series, window_rates


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int = 2) -> dict:
    return {"type": "BlockStored", "block_hashes": [format(x, "064x") for x in hashes],
            "parent_block_hash": None if parent is None else format(parent, "064x"), "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU"}


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [format(x, "064x") for x in hashes], "medium": "GPU"}


@pytest.fixture
def growing_metrics():
    """/metrics whose counters grow by 100 queries and 40 hits per read, after 200 / 50 (lifetime 25%)."""
    reads = {"n": 0}

    def body() -> str:
        n = reads["n"]
        reads["n"] += 1
        return (f'vllm:cache_config_info{{block_size="2",num_gpu_blocks="11"}} 1.0\n'
                f'vllm:kv_cache_usage_perc{{engine="0"}} 0.0\n'
                f'vllm:prefix_cache_queries_total{{engine="0"}} {200 + 100 * n}\n'
                f'vllm:prefix_cache_hits_total{{engine="0"}} {50 + 40 * n}\n')

    with serve_metrics(body) as url:
        yield url


def samples(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


class FakePoller:
    def __init__(self, scrapes):
        self.scrapes = scrapes

    def latest(self):
        return self.scrapes[-1][1], None, self.scrapes[-1][0]

    def history(self):
        return list(self.scrapes)


def test_the_exporters_gauges_are_each_servers_own():
    from types import SimpleNamespace

    from engine.watch.exporter import MirrorExporter
    from engine.watch.servers import parse_servers

    servers = parse_servers(["vllm=tcp://127.0.0.1:1", "lab=tcp://127.0.0.1:2"])
    a = mirror_at([(1000.0, [stored([1, 2], None, [1, 2, 3, 4]), stored([3], None, [7, 7])]),
                   (1030.0, [removed([3])])])
    b = mirror_at([(1000.0, [stored([9], None, [1, 2])])])
    pool = {"num_gpu_blocks": 11, "prefix_cache_queries": 200, "prefix_cache_hits": 50}
    later = {**pool, "prefix_cache_queries": 300, "prefix_cache_hits": 90}
    exporter = MirrorExporter(servers, port=None)
    exporter.update({0: SimpleNamespace(mirror=a, lost=0), 1: SimpleNamespace(mirror=b, lost=2)},
                    {"vllm": FakePoller([(0.0, pool), (2.0, later)])})
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(exporter.text()) for s in f.samples}
    key = lambda name, server: (f"paged_lab_mirror_{name}", (("rank", "0"), ("server", server)))  # noqa: E731
    assert got[key("cached_blocks", "vllm")] == 2 and got[key("cached_blocks", "lab")] == 1
    assert got[key("pool_share_ratio", "vllm")] == pytest.approx(metrics.cached_share_pct(2, 11) / 100)
    assert key("pool_share_ratio", "lab") not in got and got[key("lost_batches", "lab")] == 2
    assert got[key("evictions_per_second", "vllm")] == metrics.per_second(1, 30.0)
    assert got[("paged_lab_mirror_hit_rate_ratio", (("rank", "all"), ("server", "vllm")))] == pytest.approx(0.40)


@pytest.mark.slow
def test_watch_serves_each_servers_mirror_for_prometheus(growing_metrics):
    out = io.StringIO()
    with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as a, \
            KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as b:
        a.publish([stored([1, 2], None, [1, 2, 3, 4]), stored([3], None, [7, 7])])
        b.publish([stored([9], None, [1, 2])])
        a.flush(), b.flush()
        args = Namespace(endpoints=[], server=[f"vllm={a.endpoint}", f"lab={b.endpoint}"],
                         replay=[f"vllm={a.replay_endpoint}", f"lab={b.replay_endpoint}"],
                         metrics=[f"vllm={growing_metrics}"], replay_endpoint=[], topic="", record=None,
                         duration=6.0, max_batches=None, tokenizer=None, metrics_port=0, metrics_host="127.0.0.1")
        thread = threading.Thread(target=watch_cli, args=(args, out), daemon=True)
        thread.start()
        deadline = time.monotonic() + 5
        while "serving the mirror's metrics at " not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        url = out.getvalue().split("serving the mirror's metrics at ")[1].split()[0]
        got = {}
        while time.monotonic() < deadline + 3:  # two /metrics reads (2 s apart) and an export after them
            got = samples(url)
            if ("paged_lab_mirror_hit_rate_ratio", (("rank", "all"), ("server", "vllm"))) in got:
                break
            time.sleep(0.3)
        thread.join(15)
    key = lambda name, server: (f"paged_lab_mirror_{name}", (("rank", "0"), ("server", server)))  # noqa: E731
    assert got[key("cached_blocks", "vllm")] == 3 and got[key("cached_blocks", "lab")] == 1
    assert got[key("prefix_roots", "vllm")] == 2 and got[key("distinct_prefixes", "vllm")] == 3
    assert got[key("cached_tokens", "lab")] == 2
    # the share of vLLM's own pool (10 usable); the lab has no /metrics, so no share is exported for it
    assert got[key("pool_share_ratio", "vllm")] == pytest.approx(metrics.cached_share_pct(3, 11) / 100)
    assert key("pool_share_ratio", "lab") not in got
    # the windowed hit rate is the counters' deltas (40 / 100), not the lifetime ratio
    hit = got[("paged_lab_mirror_hit_rate_ratio", (("rank", "all"), ("server", "vllm")))]
    assert hit == pytest.approx(0.40) and metrics.server_hit_rate_pct({"prefix_cache_queries": 300,
                                                                        "prefix_cache_hits": 90}) == 30.0
    assert not thread.is_alive()


def test_a_metrics_port_in_use_is_named():
    from engine.watch.exporter import MirrorExporter
    from engine.watch.servers import one_server

    first = MirrorExporter(one_server(["tcp://127.0.0.1:1"]), port=0)
    try:
        with pytest.raises(ValueError, match=f"--metrics-port {first.port}: cannot serve on 127.0.0.1:{first.port}"):
            MirrorExporter(one_server(["tcp://127.0.0.1:1"]), port=first.port)
        with pytest.raises(ValueError, match="--metrics-port 70000"):
            MirrorExporter(one_server(["tcp://127.0.0.1:1"]), port=70000)
    finally:
        first.close()


# ------------------------------------------------------------------------------------- rates over time
def mirror_at(times_and_events) -> PrefixCacheMirror:
    m = PrefixCacheMirror()
    for seq, (ts, events) in enumerate(times_and_events):
        m.apply(seq, ts, events)
    return m


def test_rates_are_by_the_servers_clock_and_evictions_say_their_age():
    m = mirror_at([(1000.0, [stored([1, 2], None, [1, 2, 3, 4])]),
                   (1010.0, [stored([3], None, [5, 6])]),
                   (1100.0, [removed([1])]),                    # 100 s after it was stored
                   (1130.0, [removed([3])]),                    # 120 s after
                   (1150.0, [{"type": "AllBlocksCleared"}])])   # a reset, not an eviction
    r = window_rates(m.history, window_s=60.0)  # batches after 1090: two evictions in 60 s
    assert r["evicted"] == 2 and r["evictions_per_s"] == metrics.per_second(2, 60.0)
    assert r["mean_evicted_age_s"] == 110.0
    b = binned(m.history, bin_s=50.0)
    assert b["t"] == [0.0, 50.0, 100.0, 150.0]  # the clear at 1150 s opens the last bin, evicting nothing
    assert b["evictions_per_s"] == [0.0, 0.0, metrics.per_second(2, 50.0), 0.0]
    assert b["mean_evicted_age_s"] == [None, None, 110.0, None]


def test_the_windowed_hit_rate_is_from_deltas():
    series = hit_rate_series([(0.0, {"prefix_cache_queries": 100, "prefix_cache_hits": 90}),
                              (5.0, {"prefix_cache_queries": 200, "prefix_cache_hits": 100}),
                              (9.0, {"prefix_cache_queries": 200, "prefix_cache_hits": 100})])
    assert series == {"t": [5.0, 9.0], "hit_rate_pct": [10.0, None]}  # no query in the second window: None


def test_a_hot_prefix_evicted_is_noted():
    # block 1 is extended by three requests within a minute (three stores under it): hot; then it is evicted
    m = mirror_at([(1000.0, [stored([1], None, [1, 2])]),
                   (1010.0, [stored([2], 1, [3, 4])]),
                   (1020.0, [stored([3], 1, [5, 6])]),
                   (1030.0, [stored([4], 1, [7, 8])]),
                   (1040.0, [removed([2, 3, 4])]),
                   (1050.0, [removed([1])])])
    assert m.history[-1].hot_evicted == 1 and m.history[-2].hot_evicted == 0
    assert any("hot prefix evicted" in n and "3 requests extended it" in n for n in m.notes)
    assert window_rates(m.history)["hot_evicted"] == 1


def test_the_page_shows_rates_by_the_servers_clock_live_and_replayed_alike():
    from engine.kv_publisher import KVEventPublisher
    from test_ui_server import button, charts, connect, new_app, rerun_until, texts, upload

    from viz.server import rates_line

    at = new_app("Live server")
    try:
        with KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub:
            t = 1_700_000_000.0  # the server's clock, far from this machine's: the rates must use it
            pub.publish([stored([1], None, [1, 2])], ts=t)
            for i, child in enumerate((2, 3, 4)):
                pub.publish([stored([child], 1, [3 + i, 3])], ts=t + 10 + i)
            pub.publish([removed([2, 3, 4])], ts=t + 40)
            pub.publish([removed([1])], ts=t + 50)
            connect(at, pub.endpoint, pub.replay_endpoint)
            want = "last 50 s of the server's clock: 0.08 evictions / s (4 blocks)"
            assert rerun_until(at, lambda x: want in texts(x)), texts(at)
            live_line = next(c.value for c in at.caption if c.value.startswith("last 50 s"))
            assert "1 hot prefix evicted" in live_line and "evicted after" in live_line
            fig = next(c for c in charts(at) if c["layout"]["title"]["text"].startswith("Evictions over time"))
            assert any(d.get("name") == "hot prefix evicted" for d in fig["data"])
            captured = at.session_state["server_live"].capture_text().encode()
        button(at, "Stop").click().run()
        at.radio(key="server_mode").set_value("Replay a capture").run()
        upload(at, "rates.jsonl", captured)
        at.slider(key="replay_scrub").set_value(6).run()
        assert not at.exception
        assert live_line in [c.value for c in at.caption]  # the replay says what the live view said
        assert live_line == rates_line(at.session_state["replay"]["replay"].state(6).mirrors[0].history)
    finally:
        live = at.session_state["server_live"] if "server_live" in at.session_state else None
        if live is not None:
            live.stop()
