"""The one definition of every count and ratio the lab shows: the CLI's ``--json``, the Playground, Compare,
the figures, the lessons and the benchmarks all read these functions, and none computes a ratio itself.

Pure Python over step records (no torch), so figures may import it.

Definitions (units in brackets):
- slots used [tokens]: slots holding K/V of live sequences; paged: the fills of blocks in use; contiguous:
  written slots of live reservations.
- slots allocated [slots]: paged: blocks in use x block size; contiguous: the live reservations' slots.
- slack now [%]: (allocated - used) / allocated: paged, the unfilled tail of last blocks; contiguous,
  reserved slots not (yet) holding a token.
- KV utilisation [%]: used / allocated, averaged over the steps where anything was allocated.
- final length L [tokens]: a completion's prompt + generated tokens (what it needed at its longest).
- waste at final lengths [%]: paged, the empty share of the blocks every request holds at its final
  length, counting a block once however many hold it: a request's samples or beams share its prompt's
  full blocks (fork), and the prompt blocks a first admission found in the prefix cache were not
  allocated again; contiguous, sum(R - L) / sum(R) over each request's reservation R.
- internal fragmentation [slots]: R - L of a finished request's reservation (Kwon et al., SOSP 2023,
  section 3): the reserved slots it never needed.
- external fragmentation [slots]: free slots in gaps smaller than one reservation, counted only when the
  free slots together would hold one (else the region is simply full).
- prefix-cache hit rate [%]: hit tokens / queried prompt tokens of *first* admissions; re-admissions after
  a preemption are counted apart (they mostly hit their own freed blocks), as vLLM's PrefixCacheStats does.
- recompute share [%]: prefill tokens computed again for re-admitted requests / all prefill tokens.
"""

from __future__ import annotations

import statistics


def pct(part: float, whole: float) -> float:
    """100 x part / whole, 0.0 when whole is 0 (a percentage of nothing is no waste)."""
    return 100.0 * part / whole if whole else 0.0


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens occupy: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def blocks_left_window(num_computed_tokens: int, block_size: int, sliding_window: int) -> int:
    """Blocks a sliding-window KV cache group has given back from the start of a request's table once
    ``num_computed_tokens`` tokens are computed: those wholly before the window of the next token,
    ``max(0, num_computed_tokens - sliding_window + 1) // block_size`` (vLLM's
    ``SlidingWindowManager.get_num_skipped_tokens``, then whole blocks; a query at position p reads
    p - W + 1 .. p)."""
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def hybrid_blocks_saved(num_computed_tokens: int, block_size: int, group_windows) -> int:
    """Blocks a request of a hybrid model holds fewer than its all-full-attention twin (the same KV cache
    groups, the same bytes per block, every layer attending to everything) once ``num_computed_tokens``
    tokens are computed and its next tokens scheduled: the blocks each sliding-window group has given back
    (``blocks_left_window``), summed over the groups (``group_windows``: each group's window, None for
    full attention). Times the bytes per block, the memory the windows save."""
    return sum(blocks_left_window(num_computed_tokens, block_size, w) for w in group_windows if w is not None)


def hybrid_saving(snap, bytes_per_block: int | None = None) -> dict | None:
    """What a hybrid model's pool holds fewer than its all-full-attention twin after a step, read from the
    snapshot's tables (None without KV cache groups, ``Snapshot.kv_cache_groups``).

    ``blocks`` (the number the Playground, the presenter and the CLI show) is a pool count: ``twin - held``.
    ``held``: the distinct physical blocks the running sequences' tables hold now, every group, the null
    block (-1) left out, a block two tables share counted once, as the pool counts it (its blocks with a
    reference). ``twin``: what the same run would hold with every layer full, every group's tables shaped as
    the full-attention group's: the distinct blocks of the running sequences' full-attention tables
    (``SequenceState.block_table``), once per group. The screen shows this and not the sum of the requests'
    savings because a prefix two requests share (prefix caching, V1's n > 1 samples) is one block per group
    in the twin as in the pool: a request that hits a cached prefix finds its early sliding entries null
    (vLLM's sliding hit rule asks only for the last blocks before the hit point), yet the twin would not
    have held those blocks twice, so summing the requests' null entries counts the prefix once per request
    and overstates what the pool gains.

    ``by_sequence``: per running sequence, the null entries of its sliding-window tables: the arithmetic
    for one request, ``hybrid_blocks_saved(c, block_size, windows)`` for ``c`` the tokens it had computed
    when its step was scheduled (a request decoding past the window gives a block back at the step that
    computes position ``W - 1 + k * B``, its "leave_window" event). Its sum equals ``blocks`` when no
    block is shared and exceeds it when a shared prefix has left a window.

    A model with no full-attention group (a uniform sliding window) has no table that keeps the whole
    prefix; its twin is read from the sliding tables: two sequences hold one twin block at logical block
    ``i`` when some group's tables share a physical block at a position ``j >= i`` (a block's hash chains
    from its whole prefix, so sharing block ``j`` means sharing every block before it); a prefix that left
    every window in both is then counted once per sequence (a lower bound on the saving).

    Returns ``{"blocks": twin - held, "bytes": blocks x bytes_per_block (None without it), "by_sequence":
    {seq_id: blocks}, "held": blocks, "twin": blocks}``. ``bytes_per_block``: one block of the pool
    (``engine.kv_cache.page_bytes``)."""
    groups = getattr(snap, "kv_cache_groups", None)
    if not groups:
        return None
    sliding = [g for g, d in enumerate(groups) if d["kind"] == "sliding_window"]
    full = [g for g, d in enumerate(groups) if d["kind"] != "sliding_window"]
    live = [s for s in snap.sequences if s.status == "running" and s.group_block_tables]
    by_seq, held = {}, set()
    for s in live:
        by_seq[s.seq_id] = sum(s.group_block_tables[g].count(-1) for g in sliding)
        held.update(b for t in s.group_block_tables for b in t if b >= 0)
    if full:
        per_group = len({b for s in live for b in s.group_block_tables[full[0]] if b >= 0})
    else:
        per_group = _twin_blocks_from_windows(live)
    twin = per_group * len(groups)
    blocks = twin - len(held)
    return {"blocks": blocks, "bytes": None if bytes_per_block is None else blocks * bytes_per_block,
            "by_sequence": by_seq, "held": len(held), "twin": twin}


def _twin_blocks_from_windows(seqs) -> int:
    """Blocks one group of the all-full twin holds for ``seqs`` when no group keeps the whole prefix: per
    logical block ``i``, one block per class of sequences that share a physical block at some ``j >= i``."""
    n = max((len(t) for s in seqs for t in s.group_block_tables), default=0)
    total = 0
    for i in range(n):
        parent = {s.seq_id: s.seq_id for s in seqs if len(s.group_block_tables[0]) > i}

        def find(x):
            while parent[x] != x:
                x = parent[x]
            return x
        first: dict[tuple[int, int, int], str] = {}
        for s in seqs:
            if s.seq_id not in parent:
                continue
            for g, t in enumerate(s.group_block_tables):
                for j in range(i, len(t)):
                    if t[j] >= 0:
                        other = first.setdefault((g, j, t[j]), s.seq_id)
                        parent[find(s.seq_id)] = find(other)
        total += len({find(x) for x in parent})
    return total


# ------------------------------------------------------------------------------------------ one snapshot
def slots_used(snap) -> int:
    """Token slots holding K/V of live sequences (tokens)."""
    if snap.contiguous is not None:
        return snap.contiguous["used_slots"]
    return sum(f for f, c in zip(snap.fills, snap.ref_counts) if c > 0)


def slots_allocated(snap) -> int:
    """Slots taken by live sequences: blocks in use x block size (paged), reserved slots (contiguous)."""
    if snap.contiguous is not None:
        return snap.contiguous["used_slots"] + snap.contiguous["reserved_unused_slots"]
    return (snap.num_blocks - snap.num_free_blocks) * snap.block_size


def slack_pct(snap) -> float:
    """Allocated slots not holding a token now, in % of the allocated slots."""
    allocated = slots_allocated(snap)
    return pct(allocated - slots_used(snap), allocated)


def utilization_pct(snap) -> float:
    """Slots holding K/V over slots allocated now, in %."""
    return pct(slots_used(snap), slots_allocated(snap))


def kv_cache_usage_pct(snap) -> float:
    """vLLM's "KV cache usage" (``BlockPool.get_usage``, the ``vllm:kv_cache_usage_perc`` gauge): blocks
    not in the free queue over the pool's blocks, in %. Free blocks that still hold a cached prefix count
    as free (they can be evicted at once), so it can be well below the slots that hold tokens would
    suggest. vLLM's pool has one more block, its reserved null block, which it leaves out of both counts."""
    return pct(snap.num_blocks - snap.num_free_blocks, snap.num_blocks)


def internal_fragmentation(reserved: int, final_len: int) -> int:
    """Slots of a finished request's reservation beyond its final length (slots)."""
    return max(reserved - final_len, 0)


def external_fragmentation(gap_lengths: list[int], free_slots: int, need: int) -> int:
    """Free slots in gaps smaller than ``need`` slots, counted only when ``free_slots`` >= ``need``."""
    if free_slots < need:
        return 0
    return sum(n for n in gap_lengths if n < need)


def row_final_length(row: dict, final_lengths: dict[str, int] | None = None) -> int:
    """A live contiguous row's final length as far as it is known (tokens): ``final_lengths[seq_id]`` (never
    below the slots already written, never past the row), else the whole row (nothing is internal yet). A
    spare row (``spare``: reserved for a sample or beam not forked yet) is its request's future: the row."""
    length = row["length"]
    if row.get("spare"):
        return length
    return min(length, max(row["used"], (final_lengths or {}).get(row["seq_id"], length)))


def contiguous_waste_now(layout: dict, final_lengths: dict[str, int] | None = None) -> dict:
    """The contiguous region's three kinds of waste now, in slots (``Snapshot.contiguous`` layout):

    - ``reserved_not_yet_used``: slots live rows reserved for tokens still to come (up to each row's
      known final length, ``row_final_length``; spare rows whole);
    - ``internal``: slots of live rows past their known final length: reserved, never to be used (only
      with ``final_lengths``: a policy or a later run that knows them); a finished request's reservation
      is released at its finish, so it is no longer in the region (``internal_frag_slots`` sums those);
    - ``external``: free slots in gaps too small for the next reservation (``external_frag_slots``).
    """
    finals = [(r, row_final_length(r, final_lengths)) for r in layout["regions"]]
    return {"reserved_not_yet_used": sum(final - r["used"] for r, final in finals),
            "internal": sum(internal_fragmentation(r["length"], final) for r, final in finals),
            "external": layout.get("external_frag_slots", 0)}


def prefix_cache_stats(stats: dict) -> dict:
    """Hit rate of first admissions and the re-admissions' hits apart, from ``BlockManager.stats``."""
    return {
        "requests": stats.get("requests", 0),
        "query_tokens": stats.get("queries", 0),
        "hit_tokens": stats.get("hits", 0),
        "hit_rate_pct": round(pct(stats.get("hits", 0), stats.get("queries", 0)), 2),
        "readmissions": stats.get("preempted_requests", 0),
        "readmission_query_tokens": stats.get("preempted_queries", 0),
        "readmission_hit_tokens": stats.get("preempted_hits", 0),
        "evictions": stats.get("evictions", 0),
    }


def server_hit_rate_pct(server_metrics: dict) -> float | None:
    """A vLLM server's own prefix-cache hit rate from its /metrics (``engine.watch.server_metrics``): hits /
    queries in tokens at first admission (vLLM's PrefixCacheStats), in percent; None before any query."""
    queries = server_metrics.get("prefix_cache_queries")
    return None if not queries else round(pct(server_metrics.get("prefix_cache_hits", 0.0), queries), 2)


def usable_pool_blocks(num_gpu_blocks: int | None) -> int | None:
    """Blocks of a vLLM pool that can hold KV: ``num_gpu_blocks`` (vLLM's ``cache_config_info`` count)
    less its null block (``BlockPool`` keeps block 0 aside); None when the pool's size is not known."""
    return num_gpu_blocks - 1 if num_gpu_blocks and num_gpu_blocks >= 2 else None


def cached_share_pct(num_cached_blocks: int, num_gpu_blocks: int | None) -> float | None:
    """Cached blocks a server's KV events describe, as a share of its usable pool (``usable_pool_blocks``),
    in percent; None when the pool's size is not known."""
    usable = usable_pool_blocks(num_gpu_blocks)
    return None if usable is None else round(pct(num_cached_blocks, usable), 2)


def server_kv_usage_pct(server_metrics: dict) -> float | None:
    """vLLM's ``kv_cache_usage_perc`` gauge (0..1: blocks held by running requests over the usable pool,
    ``BlockPool.get_usage``) in percent; cached blocks no request holds count as free, so it can read 0%
    while the prefix cache fills the pool. None when absent."""
    usage = server_metrics.get("kv_cache_usage")
    return None if usage is None else round(pct(usage, 1.0), 2)


def active_blocks(server_metrics: dict) -> int | None:
    """Blocks a vLLM server's running requests hold, from its /metrics: ``kv_cache_usage_perc`` (0..1) x the
    usable pool (``usable_pool_blocks``), rounded; None when either is absent. The load term of a KV-aware
    router's cost (``engine.watch.router``)."""
    usage = server_metrics.get("kv_cache_usage")
    usable = usable_pool_blocks(server_metrics.get("num_gpu_blocks"))
    return None if usage is None or usable is None else int(round(usage * usable))


def windowed_hit_rate_pct(earlier: dict, later: dict) -> float | None:
    """A server's prefix-cache hit rate between two /metrics reads (the counters' deltas): (hits_later -
    hits_earlier) / (queries_later - queries_earlier), in percent, tokens at first admission; None when no
    query came between them or a counter went back (the server restarted)."""
    dq = later.get("prefix_cache_queries", 0.0) - earlier.get("prefix_cache_queries", 0.0)
    dh = later.get("prefix_cache_hits", 0.0) - earlier.get("prefix_cache_hits", 0.0)
    return None if dq <= 0 or dh < 0 else round(pct(dh, dq), 2)


def per_second(count: float, seconds: float) -> float | None:
    """A count over a window as a rate (e.g. blocks evicted per second of the server's clock); None for an
    empty window."""
    return None if not seconds > 0 else round(count / seconds, 3)


# ------------------------------------------------------------------------------------------- a whole run
def final_lengths(outputs) -> list[int]:
    """Each completion's final length L = prompt + generated tokens (tokens)."""
    return [len(o.prompt_token_ids) + len(c.token_ids) for o in outputs for c in o.outputs]


def kv_utilization_pct(snapshots) -> float:
    """Mean over snapshots with anything allocated of ``utilization_pct`` (%)."""
    live = [s for s in snapshots if slots_allocated(s)]
    return statistics.fmean(utilization_pct(s) for s in live) if live else 0.0


def request_blocks(prompt: list[int], completions: list[list[int]], block_size: int, hit_tokens: int = 0,
                   beams: bool = False) -> tuple[int, int]:
    """(blocks, tokens) one request holds at its final lengths, each block and token counted once.

    Its ``completions`` (generated token ids each) share what fork shares: samples the prompt's full blocks
    (each then writes its own, and the partly filled last prompt block is copied on write); beams every
    full block of the prefix they have in common (a beam forks from its parent with all its blocks).
    ``hit_tokens`` of the prompt were found in the prefix cache at its first admission (those blocks
    existed already). Tokens count each shared token once too.
    """
    full: set = set()  # a full block, named by the tokens it closes (a prefix) when shared, else its owner
    partial = 0
    tokens: set = set()
    for k, out in enumerate(completions):
        seq = list(prompt) + list(out)
        for t in range(len(seq)):
            tokens.add(tuple(seq[:t + 1]) if beams or t < len(prompt) else (k, t))
        for i in range(len(seq) // block_size):
            end = (i + 1) * block_size
            full.add(tuple(seq[:end]) if beams or end <= len(prompt) else (k, i))
        partial += bool(len(seq) % block_size)
    if not completions:
        return 0, 0
    return len(full) + partial - hit_tokens // block_size, len(tokens) - hit_tokens


def paged_accounting(outputs, block_size: int, hit_tokens: dict[str, int] | None = None,
                     beam_requests: set[str] = frozenset()) -> dict:
    """Blocks and slots the requests hold at their final lengths (``request_blocks``), and the share of
    those slots left empty. ``hit_tokens``: request id -> prefix-cache hit tokens of its first admission
    (``first_admission_hits``); ``beam_requests``: ids of beam-search requests."""
    hits = hit_tokens or {}
    per_request = [request_blocks(o.prompt_token_ids, [c.token_ids for c in o.outputs], block_size,
                                  hits.get(o.request_id, 0), o.request_id in beam_requests) for o in outputs]
    blocks = sum(b for b, _ in per_request)
    used = sum(t for _, t in per_request)
    return {"blocks_allocated": blocks, "slots_allocated": blocks * block_size, "slots_used": used,
            "waste_pct": round(pct(blocks * block_size - used, blocks * block_size), 2)}


def first_admission_hits(records, parents: dict[str, list[str]] | None = None) -> dict[str, int]:
    """Request id -> prefix-cache hit tokens at its first admission (re-admissions left out). ``parents``
    (V1's ``LLMEngine.parents``: a request with n > 1 -> its child requests): a parent's hit is its first
    child's, the one that computed or found the prompt; the others found it in the cache from that child."""
    hits = _hits_by_request(records)
    for parent, kids in (parents or {}).items():
        hits[parent] = hits.get(kids[0], 0)
    return hits


def _hits_by_request(records) -> dict[str, int]:
    hits: dict[str, int] = {}
    for r in records:
        owner = {s.seq_id: s.request_id for s in r.snapshot.sequences}  # a sample "R3.0" belongs to R3
        for e in r.events:
            if e.kind == "prefix_hit" and not e.data.get("readmission"):
                rid = owner.get(e.request_id, e.request_id)
                hits[rid] = hits.get(rid, 0) + e.data["num_tokens"]
    return hits


def contiguous_accounting(finished: list[tuple[int, int]]) -> dict:
    """``finished``: (reserved slots, final length) per finished request. Reserved, used, internal
    fragmentation and the waste share."""
    reserved = sum(r for r, _ in finished)
    internal = sum(internal_fragmentation(r, n) for r, n in finished)
    return {"reserved_slots": reserved, "used_slots": reserved - internal, "internal_frag_slots": internal,
            "waste_pct": round(pct(internal, reserved), 2),
            "mean_reservation": round(reserved / len(finished), 1) if finished else 0.0}


def preemption_counts(records) -> dict:
    """Preemptions by mode, requests preempted at least once, and the recompute share of prefill (%)."""
    preempts = [e for r in records for e in r.events if e.kind == "preempt"]
    admits = [e for r in records for e in r.events if e.kind == "admit"]
    prefill = sum(e.data.get("computed", 0) for e in admits)
    again = sum(e.data.get("computed", 0) for e in admits if e.data.get("readmission"))
    return {
        "preemptions": len(preempts),
        "by_recompute": sum(e.data.get("mode") == "recompute" for e in preempts),
        "by_swap": sum(e.data.get("mode") == "swap" for e in preempts),
        "requests_preempted": len({e.request_id for e in preempts}),
        "prefill_tokens": prefill,
        "recomputed_tokens": again,
        "recompute_share_pct": round(pct(again, prefill), 2),
    }


def run_stats(records, outputs) -> dict:
    """Steps, tokens, time and concurrency of a run, and its mean KV utilisation."""
    busy = sum(r.elapsed_s for r in records)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    # requests kept waiting before their first admission (a preempted request waiting to come back is not
    # "queued at the door": the contiguous baseline never preempts, so only this compares like with like)
    admitted: set = set()
    waited: set = set()
    for r in records:
        for e in r.events:
            if e.kind == "wait" and e.request_id not in admitted:
                waited.add(e.request_id)
            elif e.kind == "admit":
                admitted.add(e.request_id)
    running = [len(r.snapshot.running) for r in records]
    seqs = [sum(s.status == "running" for s in r.snapshot.sequences) for r in records]
    return {
        "steps": len(records),
        "generated_tokens": generated,
        "seconds": round(busy, 3),
        "tokens_per_s": round(generated / busy, 2) if busy else 0.0,
        "peak_concurrency": max(running, default=0),  # running requests
        "peak_running_seqs": max(seqs, default=0),  # their samples / beams, what max_num_seqs caps
        "mean_concurrency": round(statistics.fmean(running), 2) if running else 0.0,
        "kv_utilization": round(kv_utilization_pct(r.snapshot for r in records), 2),
        "queued_at_door": len(waited),
    }


def preemption_cost(records, bytes_per_block: int) -> dict:
    """What a run's preemptions cost, read from its step records.

    - recompute: ``recomputed_tokens``, the prefill tokens computed again for re-admitted requests (the
      "admit" events with ``readmission``), and ``recompute_steps`` / ``recompute_s``: the steps that
      computed them and their wall time (seconds; such a prefill step may admit other requests too);
    - swap: ``swap_out_blocks`` / ``swap_in_blocks``, the blocks copied to and back from the CPU swap
      pool (the pairs of the "swap_out" / "swap_in" events), ``swap_bytes`` = their sum x
      ``bytes_per_block`` (one block's K and V over all layers: ``KVGeometry.bytes_per_block``, or the
      KV tensors' bytes / blocks), and ``swap_steps`` / ``swap_s``: the steps that copied and their wall
      time (each also decoded the rest of its batch);
    - ``plain_decode_s``: the median wall time of the run's other decode steps (no swap, no preemption),
      the yardstick for the two above; 0.0 when there is none.

    Times are ``StepRecord.elapsed_s``: this machine's, at the time of the run.
    """
    counts = preemption_counts(records)
    recompute = [r for r in records
                 if any(e.kind == "admit" and e.data.get("readmission") for e in r.events)]
    swaps = [r for r in records if any(e.kind in ("swap_out", "swap_in") for e in r.events)]
    out_blocks = sum(len(e.data.get("pairs", [])) for r in records for e in r.events if e.kind == "swap_out")
    in_blocks = sum(len(e.data.get("pairs", [])) for r in records for e in r.events if e.kind == "swap_in")
    busy = {r.step for r in swaps} | {r.step for r in records if any(e.kind == "preempt" for e in r.events)}
    plain = [r.elapsed_s for r in records if r.kind == "decode" and r.step not in busy]
    return {
        "preemptions": counts["preemptions"],
        "by_recompute": counts["by_recompute"],
        "by_swap": counts["by_swap"],
        "recomputed_tokens": counts["recomputed_tokens"],
        "recompute_steps": [r.step for r in recompute],
        "recompute_s": sum(r.elapsed_s for r in recompute),
        "swap_out_blocks": out_blocks,
        "swap_in_blocks": in_blocks,
        "swap_bytes": (out_blocks + in_blocks) * bytes_per_block,
        "swap_steps": [r.step for r in swaps],
        "swap_s": sum(r.elapsed_s for r in swaps),
        "plain_decode_s": statistics.median(plain) if plain else 0.0,
    }
