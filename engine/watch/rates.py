"""Rates over time from a mirror's batch history, by the server's own clock (each batch's ``ts``).

Lifetime totals say little about a server that has run for a day; these are windowed: what happened in the
last ``WINDOW_S`` seconds of the server's clock (``window_rates``), or per time bin (``binned``), so a live
watch and a replay of its capture (which keeps every batch's ``ts``) give the same figures.

Every rate is ``engine.metrics.per_second``; the hit rate comes from /metrics deltas
(``metrics.windowed_hit_rate_pct``): the KV events say what was stored and evicted, never what was hit.
"""

from __future__ import annotations

from .. import metrics

WINDOW_S = 60.0   # the window of the "now" rates, seconds of the server's clock


def window_rates(history, window_s: float = WINDOW_S) -> dict:
    """Over the batches in the last ``window_s`` seconds before the newest batch's ``ts`` (or since the first
    batch seen, when the view is younger than that): ``evictions_per_s`` and ``stores_per_s`` (blocks per
    second; a clear or a restart's drop is not an eviction), ``evicted`` / ``stored`` (blocks),
    ``mean_evicted_age_s`` (how long the evicted blocks had been cached, on average; None when none was),
    ``hot_evicted`` (hot prefixes evicted, ``cache_mirror``), ``seconds`` (the window's length). None rates
    when the window is empty."""
    batches = list(history)
    if not batches:
        return {"evictions_per_s": None, "stores_per_s": None, "evicted": 0, "stored": 0,
                "mean_evicted_age_s": None, "hot_evicted": 0, "seconds": 0.0}
    last = batches[-1].ts
    since = last - window_s
    inside = [b for b in batches if b.ts > since]
    seconds = min(window_s, last - batches[0].ts) if batches[0].ts > since else window_s
    evicted = sum(b.removed for b in inside if not b.cleared)
    ages = [a for b in inside for a in getattr(b, "evicted_ages", ())]
    return {"evictions_per_s": metrics.per_second(evicted, seconds),
            "stores_per_s": metrics.per_second(sum(b.stored for b in inside), seconds),
            "evicted": evicted, "stored": sum(b.stored for b in inside),
            "mean_evicted_age_s": round(sum(ages) / len(ages), 3) if ages else None,
            "hot_evicted": sum(getattr(b, "hot_evicted", 0) for b in inside), "seconds": round(seconds, 3)}


def binned(history, bin_s: float | None = None, max_bins: int = 120) -> dict:
    """The history in time bins of the server's clock: ``t`` (each bin's start, seconds since the first
    batch), ``evictions_per_s``, ``stores_per_s``, ``mean_evicted_age_s`` (None where nothing was evicted),
    ``hot_evicted``, ``bin_s`` (chosen so at most ``max_bins`` bins cover the history, at least 1 s), ``t0``
    (the first batch's ``ts``)."""
    batches = list(history)
    if not batches:
        return {"t": [], "evictions_per_s": [], "stores_per_s": [], "mean_evicted_age_s": [], "hot_evicted": [],
                "bin_s": bin_s or 1.0, "t0": None}
    t0 = batches[0].ts
    span = max(batches[-1].ts - t0, 1e-9)
    if bin_s is None:
        bin_s = max(1.0, span / max_bins)
        for nice in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
            if nice >= bin_s:
                bin_s = float(nice)
                break
    n = int(span // bin_s) + 1
    evicted, stored, hot = [0] * n, [0] * n, [0] * n
    ages: list[list[float]] = [[] for _ in range(n)]
    for b in batches:
        i = min(n - 1, max(0, int((b.ts - t0) // bin_s)))
        if not b.cleared:
            evicted[i] += b.removed
        stored[i] += b.stored
        hot[i] += getattr(b, "hot_evicted", 0)
        ages[i].extend(getattr(b, "evicted_ages", ()))
    return {"t": [i * bin_s for i in range(n)],
            "evictions_per_s": [metrics.per_second(e, bin_s) for e in evicted],
            "stores_per_s": [metrics.per_second(s, bin_s) for s in stored],
            "mean_evicted_age_s": [round(sum(a) / len(a), 3) if a else None for a in ages],
            "hot_evicted": hot, "bin_s": bin_s, "t0": t0}


def hit_rate_series(scrapes: list, t0: float | None = None) -> dict:
    """A server's hit rate between consecutive /metrics reads: ``t`` (the later read, seconds since ``t0`` or
    the first read) and ``hit_rate_pct`` (``metrics.windowed_hit_rate_pct``; None where no query came).
    ``scrapes``: (time, values) oldest first, time in seconds since the epoch."""
    if len(scrapes) < 2:
        return {"t": [], "hit_rate_pct": []}
    base = scrapes[0][0] if t0 is None else t0
    ts, rates = [], []
    for (_, a), (t, b) in zip(scrapes, scrapes[1:]):
        ts.append(round(t - base, 3))
        rates.append(metrics.windowed_hit_rate_pct(a, b))
    return {"t": ts, "hit_rate_pct": rates}
