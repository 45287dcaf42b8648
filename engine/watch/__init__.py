"""Watching other servers: a vLLM server's (or the lab's own) prefix cache mirrored from its KV events.

Apart from the inference engine: nothing here runs a model or touches the block pool; it reads vLLM's
KV-event stream (``engine.kv_events`` holds the schema both sides share).

- ``kv_subscriber``: a ZMQ SUB socket per endpoint (per data-parallel rank), gaps, replays, reconnects;
- ``cache_mirror``: ``PrefixCacheMirror``, the server's cached blocks rebuilt from ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared``;
- ``capture``: a stream recorded to JSON lines and replayed;
- ``server_metrics``: a server's Prometheus /metrics read for its pool size and hit counters;
- ``servers``: several named servers (``--server NAME=ENDPOINT[,...]``), their streams and /metrics;
- ``router``: a prompt's cached prefix per server and the KV-aware router's choice (``python -m engine route``);
- ``rates``: rates over time by the server's clock; ``groups``: big pools by root prefix, storage tiers;
- ``exporter``: the mirror's numbers for Prometheus (``watch --metrics-port``);
- ``command``: ``python -m engine watch`` and ``python -m engine replay``.
"""
