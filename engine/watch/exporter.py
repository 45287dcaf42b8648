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

Gauges, not counters, for the totals: a mirror restarts with its server (its counts begin again), which a
Prometheus counter must never do. The window is ``rates.WINDOW_S`` of the server's own clock (the batches'
``ts``). Every ratio is ``engine.metrics``'s, divided by 100.
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
    "batches": "KV event batches applied",
    "blocks_stored": "blocks stored since the watch began",
    "blocks_removed": "blocks removed since the watch began",
    "lost_batches": "batches lost in gaps of the stream",
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
                for k, value in numbers.items():
                    if value is not None:
                        self.gauges[k].labels(*labels).set(value)
            if poller is not None:
                scrapes = poller.history()
                hit = hit_rate_window(scrapes)
                if hit is not None:
                    self.hit_rate.labels(sv.name, "all").set(hit / 100)

    def text(self) -> str:
        """The exposition as Prometheus would scrape it."""
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def hit_rate_window(scrapes: list, window_s: float = WINDOW_S) -> float | None:
    """The hit rate (percent) between the newest scrape and the newest one at least ``window_s`` older (or the
    oldest kept): ``metrics.windowed_hit_rate_pct``. ``scrapes``: (time, values) oldest first."""
    if len(scrapes) < 2:
        return None
    t_last, last = scrapes[-1]
    earlier = next((v for t, v in reversed(scrapes) if t_last - t >= window_s), scrapes[0][1])
    return metrics.windowed_hit_rate_pct(earlier, last)
