"""The mirror's Prometheus export after the operator trial (issue 27): the windowed hit rate is absent when
no query came in the window (not the last request's value for minutes), starts again after the server's
counters restart, and the totals never go back within a watch (documented as such)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.watch.cache_mirror import PrefixCacheMirror
from engine.watch.exporter import MirrorExporter, hit_rate_window
from engine.watch.servers import parse_servers

HIT = ("paged_lab_mirror_hit_rate_ratio", (("rank", "all"), ("server", "vllm")))


class Poller:
    def __init__(self, scrapes, error=None):
        self.scrapes, self.error = scrapes, error

    def latest(self):
        return self.scrapes[-1][1], self.error, self.scrapes[-1][0]

    def history(self):
        return list(self.scrapes)


def q(t, queries, hits):
    return (t, {"prefix_cache_queries": queries, "prefix_cache_hits": hits})


def samples(exporter) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(exporter.text()) for s in f.samples}


def test_the_hit_rate_goes_away_when_the_window_holds_no_query():
    exporter = MirrorExporter(parse_servers(["vllm=tcp://127.0.0.1:1"]), port=None)
    views = {0: SimpleNamespace(mirror=PrefixCacheMirror(rank=0), lost=0)}
    busy = [q(0.0, 100, 0), q(2.0, 200, 80)]
    exporter.update(views, {"vllm": Poller(busy)})
    assert samples(exporter)[HIT] == pytest.approx(0.8)
    # minutes later, scraped every 2 s, no request since: the last 60 s hold no query
    idle = busy + [q(2.0 + 2 * i, 200, 80) for i in range(1, 100)]
    exporter.update(views, {"vllm": Poller(idle)})
    assert HIT not in samples(exporter)
    # the server cannot be read now: unknown, not the last value
    exporter.update(views, {"vllm": Poller(busy, error="cannot read metrics")})
    assert HIT not in samples(exporter)


def test_the_hit_rate_window_counts_a_counter_restart_as_prometheus_does():
    # 100 queries / 50 hits, then the server restarts (counters from 0): 50 / 10, then 150 / 30 more
    scrapes = [q(0.0, 1000, 900), q(10.0, 1100, 950), q(20.0, 50, 10), q(30.0, 200, 40)]
    assert hit_rate_window(scrapes) == 30.0  # 90 hits of 300 queries
    assert hit_rate_window([q(0.0, 1000, 900), q(5.0, 10, 0)]) == 0.0  # 10 queries since the restart, no hit


def test_the_totals_never_go_back_across_a_server_restart():
    m = PrefixCacheMirror(rank=0)
    block = {"type": "BlockStored", "block_hashes": ["a" * 64], "parent_block_hash": None, "token_ids": [1, 2],
             "block_size": 2, "lora_id": None, "medium": "GPU"}
    for seq in range(5):
        m.apply(seq, 1000.0 + seq, [{**block, "block_hashes": [format(seq, "064x")]}])
    m.restart(0)  # the server restarted: seq 0 again (what the subscriber calls, kv_subscriber.py)
    m.apply(0, 2000.0, [{**block, "block_hashes": ["f" * 64]}])
    exporter = MirrorExporter(parse_servers(["vllm=tcp://127.0.0.1:1"]), port=None)
    exporter.update({0: SimpleNamespace(mirror=m, lost=0)}, {})
    got = samples(exporter)
    key = lambda n: (f"paged_lab_mirror_{n}", (("rank", "0"), ("server", "vllm")))  # noqa: E731
    assert got[key("cached_blocks")] == 1  # the view restarted with its server
    assert got[key("blocks_stored")] == 6 and got[key("batches")] == 6  # the totals did not
    import engine.watch.exporter as ex
    assert "never go back" in ex.__doc__ and "across restarts of the server" in ex.__doc__
