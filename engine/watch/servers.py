"""Several servers watched side by side: who each one is, which KV event streams are its, where its /metrics is.

A *server* is one inference server (a vLLM API server, the lab's engine, ...): a name, one KV events endpoint
per data-parallel rank (vLLM publishes rank r on the endpoint's port + r), optionally one replay endpoint per
rank and one ``/metrics`` URL. Its pool size and counters come from its own ``/metrics`` (or its own entry in a
capture's header), never from another server's.

Every stream (one endpoint) gets a global index, ``stream``: 0, 1, ... over all servers in the order given.
The subscribers, a capture's ``rank`` field and ``CaptureReplay``'s mirrors are keyed by it (a capture written
before servers had names is one server whose streams are its ranks), and ``ServerSpec.streams`` says which are
whose.

The forms (the CLI's flags and the Server page's fields read the same text):

    --server NAME=ENDPOINT[,ENDPOINT...]      repeatable: one server, its endpoints in rank order
    --replay NAME=ENDPOINT[,ENDPOINT...]      its replay endpoints, one per endpoint, same order (optional)
    --metrics NAME=URL                        its /metrics (optional)

A NAME is 1-40 of ``A-Z a-z 0-9 _ . -``. The positional form ``watch ENDPOINT...`` (with ``--replay-endpoint``,
repeated, and ``--metrics URL``) is one server named ``server``. On the page several servers are written as
the same ``NAME=...`` entries separated by ``;`` or new lines; text without ``NAME=`` is one server.

Errors: ``ValueError`` naming the flag and the value (a missing ``=``, a bad name, a name given twice, a
replay or metrics entry for a name no ``--server`` gave, a count of replay endpoints that does not match).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..config import check_endpoint

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
DEFAULT_NAME = "server"


@dataclass
class ServerSpec:
    """One server: ``name``, ``endpoints`` (one per data-parallel rank), ``replays`` (None or one per
    endpoint), ``metrics_url`` (None or its /metrics), ``streams`` (the global stream index of each endpoint,
    set by ``number_streams``)."""
    name: str
    endpoints: list[str]
    replays: list[str | None] = field(default_factory=list)
    metrics_url: str | None = None
    streams: list[int] = field(default_factory=list)

    def label(self, stream: int, single: bool) -> str:
        """How a stream of this server is named in a line of output: ``rank r`` when the whole watch is one
        unnamed server (as before servers had names), ``NAME`` for a one-rank server, ``NAME rank r``
        otherwise."""
        r = self.streams.index(stream)
        if single and self.name == DEFAULT_NAME:
            return f"rank {r}"
        return self.name if len(self.endpoints) == 1 else f"{self.name} rank {r}"

    def header(self, num_gpu_blocks: int | None = None) -> dict:
        """This server's entry in a capture header (``capture.py``: ``servers``)."""
        return {"name": self.name, "streams": list(self.streams), "endpoints": list(self.endpoints),
                "replay_endpoints": [r for r in self.replays if r], "metrics": self.metrics_url,
                "num_gpu_blocks": num_gpu_blocks}


def check_name(name: str, where: str) -> str:
    if not NAME_RE.match(name or ""):
        raise ValueError(f"{where}: server name {name!r} must be 1-40 letters, digits, '_', '.' or '-'")
    return name


def check_metrics_url(url: str, where: str) -> str:
    """``where``: how the message names the value (``--metrics`` for the bare URL)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{where} {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000/metrics)")
    return url


def _named(value: str, flag: str, what: str) -> tuple[str, str]:
    """``NAME=REST`` -> (NAME, REST), or ValueError naming the flag and the value."""
    name, eq, rest = value.partition("=")
    if not eq or not rest.strip():
        raise ValueError(f"{flag} {value!r}: expected NAME={what}")
    return check_name(name.strip(), f"{flag} {value!r}"), rest.strip()


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _split_strict(text: str, where: str) -> list[str]:
    """``A,B`` as its items; ValueError naming the value when one is empty (``A,,`` / a trailing comma)."""
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise ValueError(f"{where} {text!r}: an empty endpoint (two commas, or one at the end): give "
                         f"ENDPOINT[,ENDPOINT...]")
    return parts


def parse_servers(servers: list[str], replays: list[str] | None = None,
                  metrics: list[str] | None = None) -> list[ServerSpec]:
    """The ``--server`` / ``--replay`` / ``--metrics`` values as ServerSpecs (streams numbered)."""
    specs: dict[str, ServerSpec] = {}
    for value in servers:
        name, rest = _named(value, "--server", "ENDPOINT[,ENDPOINT...]")
        if name in specs:
            raise ValueError(f"--server {value!r}: the name {name!r} is given twice")
        endpoints = [check_endpoint(e, f"--server {name}: endpoint") for e in _split_strict(rest, f"--server {name}:")]
        for e in endpoints:
            other = next((sp.name for sp in specs.values() if e in sp.endpoints), None)
            if other is not None or endpoints.count(e) > 1:
                raise ValueError(f"--server {value!r}: the endpoint {e!r} is given twice"
                                 + (f" (also server {other!r})" if other else "") + ": one stream is one server's")
        specs[name] = ServerSpec(name, endpoints, [None] * len(endpoints))
    for value in replays or []:
        name, rest = _named(value, "--replay", "ENDPOINT[,ENDPOINT...]")
        spec = _known(specs, name, "--replay", value)
        eps = [check_endpoint(e, f"--replay {name}: endpoint") for e in _split_strict(rest, f"--replay {name}:")]
        if len(eps) != len(spec.endpoints):
            raise ValueError(f"--replay {value!r}: {len(eps)} replay endpoint(s) for the {len(spec.endpoints)} "
                             f"endpoint(s) of server {name!r}: give one per endpoint, in the same order")
        spec.replays = eps
    for value in metrics or []:
        name, rest = _named(value, "--metrics", "URL")
        _known(specs, name, "--metrics", value).metrics_url = check_metrics_url(rest, f"--metrics {value!r}: the URL")
    return number_streams(list(specs.values()))


def _known(specs: dict, name: str, flag: str, value: str) -> ServerSpec:
    if name not in specs:
        given = ", ".join(specs) or "none"
        raise ValueError(f"{flag} {value!r}: no --server is named {name!r} (servers given: {given})")
    return specs[name]


def number_streams(specs: list[ServerSpec]) -> list[ServerSpec]:
    i = 0
    for s in specs:
        s.streams = list(range(i, i + len(s.endpoints)))
        i += len(s.endpoints)
        if not s.replays:
            s.replays = [None] * len(s.endpoints)
    return specs


def one_server(endpoints: list[str], replays: list[str] | None = None, metrics_url: str | None = None,
               name: str = DEFAULT_NAME) -> list[ServerSpec]:
    """The positional form: one server, ``endpoints`` its ranks."""
    for e in endpoints:
        check_endpoint(e, "ENDPOINT")
    replays = list(replays or [])
    for r in replays:
        check_endpoint(r, "--replay-endpoint")
    if replays and len(replays) != len(endpoints):
        raise ValueError(f"{len(replays)} --replay-endpoint(s) for {len(endpoints)} endpoint(s): give one per "
                         f"endpoint, in the same order")
    if metrics_url:
        check_metrics_url(metrics_url, "--metrics")
    return number_streams([ServerSpec(name, list(endpoints), replays or [None] * len(endpoints), metrics_url)])


def page_entries(text: str) -> list[str]:
    """The Server page's field split into entries: by ``;`` and new lines."""
    return [p.strip() for p in re.split(r"[;\n]", text or "") if p.strip()]


def is_named(entry: str) -> bool:
    name, eq, _ = entry.partition("=")
    return bool(eq) and "://" not in name


def parse_page(endpoints: str, replays: str = "", metrics: str = "") -> list[ServerSpec]:
    """The Server page's three fields as ServerSpecs: ``NAME=...`` entries (as the CLI's flags, separated by
    ``;`` or new lines), or, with no name anywhere, one server (endpoints comma or newline separated, as
    before). Raises ValueError naming the bad value."""
    entries = page_entries(endpoints)
    for e in entries:
        m = re.match(r"^([A-Za-z0-9_.-]{1,40})\s+(\S+://\S*)$", e)
        if m:
            raise ValueError(f"server entry {e!r}: write NAME=ENDPOINT ({m.group(1)}={m.group(2)}), not a space")
    if not any(is_named(e) for e in entries):
        eps = _split(",".join(entries))
        reps = _split(",".join(page_entries(replays)))
        if not eps:
            raise ValueError("no KV events endpoint given")
        if any(is_named(e) for e in page_entries(replays) + page_entries(metrics)):
            raise ValueError("replay endpoints or /metrics are given with NAME= but the servers have no names: "
                             "write the servers as NAME=ENDPOINT too")
        return one_server(eps, reps, metrics.strip() or None)
    unnamed = [e for e in entries if not is_named(e)]
    if unnamed:
        raise ValueError(f"server entry {unnamed[0]!r} has no NAME=: when one server is named, name every one "
                         f"(NAME=ENDPOINT[,ENDPOINT...], separated by ';')")
    return parse_servers(entries, page_entries(replays), page_entries(metrics))


def servers_of_capture(header: dict, streams: list[int]) -> list[ServerSpec]:
    """The servers a capture was recorded from: its header's ``servers`` (validated by ``read_capture``), or,
    for a capture without them, one server whose ranks are ``streams``."""
    entries = header.get("servers")
    if not entries:
        endpoints = list(header.get("endpoints") or [])
        n = max([len(endpoints), *(s + 1 for s in streams)], default=0) or 1
        endpoints += ["?"] * (n - len(endpoints))
        spec = ServerSpec(DEFAULT_NAME, endpoints[:n], [None] * n, None, list(range(n)))
        return [spec]
    out = []
    for e in entries:
        out.append(ServerSpec(e["name"], list(e.get("endpoints") or ["?"] * len(e["streams"])),
                              [None] * len(e["streams"]), e.get("metrics"), list(e["streams"])))
    return out
