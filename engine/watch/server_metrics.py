"""Read a vLLM server's Prometheus ``/metrics`` for what the KV events do not carry: the pool's size, its
usage, and the server's own prefix-cache counters, shown beside the events on the Server page.

Names read (vLLM 0.32, ``vllm/v1/metrics/loggers.py``); each is summed over the ``engine`` /
``model_name`` labels of one server:

    vllm:cache_config_info{num_gpu_blocks=..., block_size=...}   the pool (labels of an info gauge)
    vllm:kv_cache_usage_perc          share of the pool's blocks in use, 0..1 (vLLM's ``get_usage``)
    vllm:prefix_cache_queries_total   tokens looked up in the prefix cache at first admission
    vllm:prefix_cache_hits_total      of those, tokens found cached
    vllm:num_preemptions_total        preemptions so far
    vllm:num_requests_running / vllm:num_requests_waiting

Parsing uses ``prometheus_client``'s text parser (no hand-written exposition-format parsing).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

WANTED = {"vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:prefix_cache_queries": "prefix_cache_queries",
          "vllm:prefix_cache_hits": "prefix_cache_hits", "vllm:num_preemptions": "num_preemptions",
          "vllm:num_requests_running": "num_requests_running", "vllm:num_requests_waiting": "num_requests_waiting"}


def parse_metrics(text: str) -> dict:
    """The values above from one exposition text, as {short name: float}, plus ``num_gpu_blocks`` and
    ``block_size`` from ``vllm:cache_config_info`` when present. Names absent from the text are absent."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "vllm:cache_config_info":
                for label in ("num_gpu_blocks", "block_size"):
                    value = sample.labels.get(label)
                    if value not in (None, "", "None"):
                        out[label] = int(value)
                continue
            if name.endswith("_info") and sample.labels.get("max_model_len", "").isdigit():
                out["max_model_len"] = int(sample.labels["max_model_len"])  # where a server's info gauge says it
            base = name[:-len("_total")] if name.endswith("_total") else name
            if base in WANTED and not name.endswith("_created"):
                key = WANTED[base]
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def fetch_metrics(url: str, timeout_s: float = 2.0) -> dict:
    """GET ``url`` (a server's ``/metrics``) and parse it. Raises ValueError with the reason when the server
    cannot be reached or answers with an error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ValueError(f"cannot read metrics from {url}: {exc}") from None
    try:
        return parse_metrics(text)
    except ValueError as exc:  # e.g. an HTML page: prometheus_client says "invalid metric name:<!--"
        raise ValueError(f"{url} is not a Prometheus /metrics page ({str(exc)[:60]})") from None



class MetricsPoller:
    """Reads one server's /metrics every ``every_s`` in its own thread (a slow or dead server never holds up
    its reader); ``latest()`` is (values, error, when); ``history()`` every scrape kept (at most
    ``max_scrapes``, oldest dropped), each (time, values), for a capture and the windowed rates.
    ``on_scrape(at, values)`` is called in the thread after each successful read (e.g. a capture writer)."""

    def __init__(self, url: str, every_s: float = 2.0, max_scrapes: int = 10_000, on_scrape=None) -> None:
        self.url, self.every_s, self.max_scrapes, self.on_scrape = url, every_s, max_scrapes, on_scrape
        self.values: dict | None = None
        self.error: str | None = None
        self.at: float | None = None
        self.scrapes: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> "MetricsPoller":
        threading.Thread(target=self._loop, name=f"metrics-{self.url}", daemon=True).start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                values, error = fetch_metrics(self.url, timeout_s=self.every_s), None
            except ValueError as exc:
                values, error = None, str(exc)
            with self._lock:
                self.at = time.time()
                self.error = error
                if values is not None:
                    self.values = values
                    self.scrapes.append((self.at, values))
                    del self.scrapes[:-self.max_scrapes]
            if values is not None and self.on_scrape is not None:
                self.on_scrape(self.at, values)
            self._stop.wait(self.every_s)

    def history(self) -> list:
        with self._lock:
            return list(self.scrapes)

    def latest(self) -> tuple[dict | None, str | None, float | None]:
        with self._lock:
            return self.values, self.error, self.at

    def stop(self) -> None:
        self._stop.set()
