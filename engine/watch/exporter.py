"""The mirror's own numbers for Prometheus (``python -m engine watch --metrics-port PORT``).

Served by ``prometheus_client`` (its own registry and HTTP server, text exposition format) at
``http://HOST:PORT/metrics``, every metric labelled ``server`` (the ``--server`` name; ``server`` for the
positional form) and ``rank`` (the server's data-parallel rank), names under ``paged_lab_mirror_``:

    paged_lab_mirror_cached_blocks          gauge    physical blocks cached (copies counted), per the KV events
    paged_lab_mirror_distinct_prefixes      gauge    distinct cached block hashes
    paged_lab_mirror_prefix_roots           gauge    prefix trees (blocks with no cached parent)
    paged_lab_mirror_cached_tokens          gauge    cached blocks x block size
    paged_lab_mirror_pool_share_ratio       gauge    cached blocks / the server's usable pool (0..1; needs /metrics)
    paged_lab_mirror_evictions_per_second   gauge    blocks removed per second of the server's clock, last window
    paged_lab_mirror_hit_rate_ratio         gauge    the server's prefix-cache hit rate over the last window of its
                                                     /metrics counters (0..1; ``metrics.windowed_hit_rate_pct``;
                                                     label ``rank`` is "all")
    paged_lab_mirror_batches                gauge    batches applied
    paged_lab_mirror_blocks_stored / _removed   gauge  blocks stored / removed since the watch began
    paged_lab_mirror_lost_batches           gauge    batches lost in gaps

``batches``, ``blocks_stored``, ``blocks_removed`` and ``lost_batches`` are totals since this watch began:
they never go back within the watch, across restarts of the server too (the mirror's view of the cache is
reset when its server restarts, its counts are not), as Prometheus counters behave; they stay gauges so
their names are the ones documented (``increase()`` / ``rate()`` over them are right). The windowed numbers
are honest about an empty window: no /metrics query in the last window (an idle server), or a server
whose /metrics cannot be read now, takes the ``hit_rate_ratio`` series out (absent, the Server page's "-"),
not the last value seen; a restart of the server's counters inside the window counts as Prometheus'
``increase()`` counts it (from 0), never as a negative or a lost window. A
gauge whose value is unknown now (``pool_share_ratio`` without /metrics) is absent too. The window is
``rates.WINDOW_S`` of the server's own clock (the batches' ``ts``; for the hit rate, the scrapes' times).
Every ratio is ``engine.metrics``'s, divided by 100.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest, start_http_server

from .. import metrics
from .rates import WINDOW_S, window_rates

PREFIX = "paged_lab_mirror_"
GAUGES = {
    "cached_blocks": "physical KV blocks cached, per the server's KV events (copies counted)",
    "distinct_prefixes": "distinct cached block hashes",
    "prefix_roots": "prefix trees: cached blocks whose parent is not cached",
    "cached_tokens": "cached blocks x block size",
    "pool_share_ratio": "cached blocks over the server's usable pool (needs its /metrics)",
    "evictions_per_second": f"blocks removed per second of the server's clock over the last {WINDOW_S:g} s",
    "batches": "KV event batches applied since the watch began (across server restarts)",
    "blocks_stored": "blocks stored since the watch began (across server restarts)",
    "blocks_removed": "blocks removed since the watch began (across server restarts)",
    "lost_batches": "batches lost in gaps of the stream since the watch began",
}


class MirrorExporter:
    """One registry, one HTTP server; ``update(views, pollers)`` sets every gauge from the subscribers' views
    (stream -> ``SubscriberView``) and the servers' /metrics pollers (name -> ``MetricsPoller``).

    Raises ValueError naming the port when it cannot be bound (in use, not 0..65535)."""

    def __init__(self, servers, port: int | None, host: str = "127.0.0.1") -> None:
        if port is not None and (not isinstance(port, int) or not 0 <= port <= 65535):
            raise ValueError(f"--metrics-port {port!r}: expected a port from 1 to 65535 (0: any free port)")
        self.servers = servers
        self.registry = CollectorRegistry()
        self.gauges = {k: Gauge(PREFIX + k, doc, ["server", "rank"], registry=self.registry)
                       for k, doc in GAUGES.items()}
        self.hit_rate = Gauge(PREFIX + "hit_rate_ratio", "the server's prefix-cache hit rate over its last "
                              "/metrics window (hits / queries deltas)", ["server", "rank"], registry=self.registry)
        self._server = None
        self.port = self.url = None
        if port is None:  # the registry only (``text()``), no HTTP server
            return
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ValueError(f"--metrics-port {port}: cannot serve on {host}:{port} ({exc.strerror or exc})") from None
        self.port = self._server.server_port
        self.url = f"http://{host}:{self.port}/metrics"

    def update(self, views: dict, pollers: dict) -> None:
        for sv in self.servers:
            poller = pollers.get(sv.name)
            values = poller.latest()[0] if poller is not None else None
            pool = (values or {}).get("num_gpu_blocks")
            for r, stream in enumerate(sv.streams):
                v = views.get(stream)
                if v is None:
                    continue
                m = v.mirror
                labels = (sv.name, str(r))
                share = metrics.cached_share_pct(m.num_blocks, pool)
                rates = window_rates(m.history)
                numbers = {"cached_blocks": m.num_blocks, "distinct_prefixes": len(m.blocks),
                           "prefix_roots": len(m.children().get(None, [])), "cached_tokens": m.num_tokens,
                           "pool_share_ratio": None if share is None else share / 100,
                           "evictions_per_second": rates["evictions_per_s"], "batches": m.num_batches,
                           "blocks_stored": m.total_stored, "blocks_removed": m.total_removed,
                           "lost_batches": v.lost}
                for k, value in numbers.items():  # unknown now: absent, never the last value seen
                    _set(self.gauges[k], labels, value)
            if poller is not None:
                _, error, _ = poller.latest()
                hit = None if error else hit_rate_window(poller.history())  # unreadable now: unknown now
                _set(self.hit_rate, (sv.name, "all"), None if hit is None else hit / 100)

    def text(self) -> str:
        """The exposition as Prometheus would scrape it."""
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _set(gauge, labels: tuple, value) -> None:
    """Set a labelled gauge, or take its series out when the value is unknown now (None)."""
    if value is not None:
        gauge.labels(*labels).set(value)
        return
    try:
        gauge.remove(*labels)
    except KeyError:  # never set
        pass


def hit_rate_window(scrapes: list, window_s: float = WINDOW_S) -> float | None:
    """The hit rate (percent) over the last ``window_s`` seconds of scrapes: the increase of the hits over the
    increase of the queries between the newest scrape and the newest one at least ``window_s`` older (or the
    oldest kept), counted as Prometheus' ``increase()`` counts: a counter that went back (the server
    restarted) increased by its new value. None when no query came in the window. ``scrapes``: (time, values)
    oldest first."""
    if len(scrapes) < 2:
        return None
    t_last = scrapes[-1][0]
    first = max((i for i, (t, _) in enumerate(scrapes) if t_last - t >= window_s), default=0)
    inside = scrapes[first:]

    def increase(key: str) -> float:
        total = 0.0
        for (_, a), (_, b) in zip(inside, inside[1:]):
            x, y = a.get(key, 0.0), b.get(key, 0.0)
            total += y - x if y >= x else y  # a reset: counted from 0
        return total

    dq, dh = increase("prefix_cache_queries"), increase("prefix_cache_hits")
    return metrics.windowed_hit_rate_pct({}, {"prefix_cache_queries": dq, "prefix_cache_hits": dh})
