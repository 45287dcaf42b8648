"""Compare what vLLM did with what the lab did on one conformance case, check by check.

Both results have ``peer/vllm_driver.py``'s shape (``peer.lab_runner`` writes the lab's). Blocks are
compared by content, not by hash: the two hash functions differ, so a stored block is identified by the
token ids of the whole prefix it ends, rebuilt by chaining each ``BlockStored``'s ``parent_block_hash``
(``prefix_events``). Child requests of ``n > 1`` are named differently on the two sides and are compared
as "<parent>#<index>".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def _hash_prefixes(steps: list[dict]) -> dict[str, tuple[int, ...]]:
    """Every stored block hash -> the token ids of the whole prefix its block ends. A BlockStored that names
    a hash per block of its tokens gives each hash its prefix from the parent's; one that names fewer (a
    sliding-window group caches only the blocks a later hit can use, vLLM's ``reachable_block_mask``, and
    skips null blocks) cannot say which hash is which block, but the block hashes are the request's own,
    whatever the group (vLLM's ``BlockHashWithGroupId`` adds the group only inside the pool), so another
    group's event of the same blocks names them. Passes until nothing new is learned: a group's event can
    come before the one that names its parent."""
    prefix: dict[str, tuple[int, ...]] = {}
    events = [e for step in steps for e in step["kv_events"] if e["type"] == "BlockStored"
              and len(e["token_ids"]) == len(e["block_hashes"]) * e["block_size"]]
    while True:
        learned = False
        for e in events:
            parent = e.get("parent_block_hash")
            if parent is not None and str(parent) not in prefix:
                continue
            head = prefix[str(parent)] if parent is not None else ()
            size = e["block_size"]
            for i, h in enumerate(e["block_hashes"]):
                head = head + tuple(e["token_ids"][i * size:(i + 1) * size])
                if str(h) not in prefix:
                    prefix[str(h)] = head
                    learned = True
        if not learned:
            return prefix


def _group(e: dict, stored: bool) -> tuple:
    """An event's KV cache group as vLLM 0.32 writes it: ``group_idx`` (both kinds), and on a BlockStored
    ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``. Absent reads as None, so an event without
    them differs from one with them."""
    if stored:
        return (e.get("group_idx"), e.get("kv_cache_spec_kind"), e.get("kv_cache_spec_sliding_window"))
    return (e.get("group_idx"),)


def prefix_events(steps: list[dict]) -> list[list[tuple]]:
    """Per step, its KV events by content, in order: ("stored", group, (prefix token ids of each block),
    (first token, tokens covered)), ("removed", group, (prefix token ids of each block)) or ("cleared",),
    where group is ``_group``'s. One event per vLLM event, so how blocks are grouped into events is compared
    too. A hash whose block no event names reads as ("unknown hash", hash)."""
    prefix = _hash_prefixes(steps)

    def named(h) -> tuple:
        return prefix.get(str(h), ("unknown hash", str(h)))

    out = []
    for step in steps:
        events = []
        for e in step["kv_events"]:
            if e["type"] == "BlockStored":
                parent = e.get("parent_block_hash")
                start = len(named(parent)) if parent is not None else 0
                span = (start, len(e["token_ids"]))  # the range the call covered, the blocks it skipped included
                events.append(("stored", _group(e, True), tuple(named(h) for h in e["block_hashes"]), span))
            elif e["type"] == "BlockRemoved":
                events.append(("removed", _group(e, False), tuple(named(h) for h in e["block_hashes"])))
            else:
                events.append(("cleared",))
        out.append(events)
    return out


def _canonical(result: dict) -> dict[str, str]:
    """Request id -> comparable name: a child of ``n > 1`` becomes "<parent>#<index>"."""
    names = {}
    for parent, kids in result.get("child_ids", {}).items():
        for i, kid in enumerate(kids):
            names[str(kid)] = f"{parent}#{i}"
    return names


def _schedule(result: dict) -> list[dict]:
    names = _canonical(result)
    return [{names.get(str(k), str(k)): v for k, v in s["scheduled"].items()} for s in result["steps"]]


def _preempted(result: dict) -> list[list[str]]:
    """Per step, the requests preempted, in the order the scheduler preempted them."""
    names = _canonical(result)
    return [[names.get(str(r), str(r)) for r in s["preempted"]] for s in result["steps"]]


def _finished(result: dict) -> list[list[tuple[str, str]]]:
    """Per step, (request, finish_reason) of every request that finished in it, sorted by request (the
    order outputs come out within one step is not scheduling)."""
    names = _canonical(result)
    return [sorted((names.get(str(r), str(r)), str(s["finish_reasons"].get(r))) for r in s["finished"])
            for s in result["steps"]]


def _reasons(result: dict) -> dict[str, list[tuple]]:
    """Request -> (finish_reason, stop_reason) of each completion, in completion order."""
    return {rid: list(zip(r["finish_reasons"], r["stop_reasons"])) for rid, r in result["requests"].items()}


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"step {i + 1}: vLLM {_short(x)} vs lab {_short(y)}"
    if len(a) != len(b):
        return f"vLLM ran {len(a)} steps, the lab {len(b)}"
    return ""


def _short(value, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _describe_events(events: list[tuple]) -> list[tuple]:
    """Shorter form for messages: kind, group and each block's prefix length in tokens (with its last
    token id), and a BlockStored's span."""
    return [(e[0], e[1], tuple((len(b), b[-1:]) for b in e[2]), *e[3:]) if len(e) > 1 else e for e in events]


def _cached(result: dict) -> dict[str, int]:
    """Request -> num_cached_tokens; a request with children -> each child's, as "<parent>#<index>" (the
    parent's own value is the last-finished child's, an order the two engines need not share)."""
    out = {}
    for rid, r in result["requests"].items():
        kids = result.get("child_ids", {}).get(rid)
        if kids:
            out.update({f"{rid}#{i}": r["child_num_cached_tokens"][str(k)] for i, k in enumerate(kids)})
        else:
            out[rid] = r["num_cached_tokens"]
    return out


def compare(vllm: dict, lab: dict) -> list[Check]:
    """The checks of one case: outputs, num_cached_tokens, the requests preempted and finished per step,
    finish and stop reasons, the watermark applied, per-step schedule, per-step KV events by content, KV
    cache usage after each step, and the prefix-cache counters."""
    checks = []
    outs_v = {r: v["outputs"] for r, v in vllm["requests"].items()}
    outs_l = {r: v["outputs"] for r, v in lab["requests"].items()}
    bad = [r for r in outs_v if outs_v[r] != outs_l.get(r)]
    checks.append(Check("identical greedy token ids per request", not bad and outs_v.keys() == outs_l.keys(),
                        "; ".join(f"{r}: vLLM {_short(outs_v[r], 200)} vs lab {_short(outs_l.get(r), 200)}"
                                  for r in bad[:3])))
    cached_v, cached_l = _cached(vllm), _cached(lab)
    checks.append(Check("identical num_cached_tokens per request", cached_v == cached_l,
                        "" if cached_v == cached_l else f"vLLM {cached_v} vs lab {cached_l}"))
    pre_v, pre_l = _preempted(vllm), _preempted(lab)
    same = pre_v == pre_l and vllm["num_preemptions"] == lab["num_preemptions"]
    checks.append(Check("same requests preempted, in the same order, step by step", same,
                        "" if same else f"vLLM {vllm['num_preemptions']} vs lab {lab['num_preemptions']} in all; "
                        + _first_difference(pre_v, pre_l)))
    fin_v, fin_l = _finished(vllm), _finished(lab)
    checks.append(Check("same requests finished, step by step, with the same finish_reason", fin_v == fin_l,
                        _first_difference(fin_v, fin_l)))
    why_v, why_l = _reasons(vllm), _reasons(lab)
    bad = sorted(r for r in why_v.keys() | why_l.keys() if why_v.get(r) != why_l.get(r))
    checks.append(Check("same finish_reason and stop_reason per completion", not bad,
                        "; ".join(f"{r}: vLLM {why_v.get(r)} vs lab {why_l.get(r)}" for r in bad[:4])))
    wm_v = (vllm["settings"].get("watermark"), vllm["settings"].get("watermark_blocks"))
    wm_l = (lab["settings"].get("watermark"), lab["settings"].get("watermark_blocks"))
    checks.append(Check("same watermark applied (share, blocks kept free)", wm_v == wm_l,
                        "" if wm_v == wm_l else f"vLLM {wm_v} vs lab {wm_l}"))
    sched_v, sched_l = _schedule(vllm), _schedule(lab)
    checks.append(Check("same tokens scheduled per request, step by step", sched_v == sched_l,
                        _first_difference(sched_v, sched_l)))
    ev_v, ev_l = prefix_events(vllm["steps"]), prefix_events(lab["steps"])
    checks.append(Check("same KV events in the same order (blocks by prefix content), batch by batch", ev_v == ev_l,
                        _first_difference([_describe_events(e) for e in ev_v], [_describe_events(e) for e in ev_l])))
    use_v = [round(s["kv_cache_usage"], 9) for s in vllm["steps"]]
    use_l = [round(s["kv_cache_usage"], 9) for s in lab["steps"]]
    checks.append(Check("same KV cache usage after every step (vLLM's BlockPool.get_usage)", use_v == use_l,
                        _first_difference(use_v, use_l)))
    st_v, st_l = vllm.get("prefix_cache_stats"), lab.get("prefix_cache_stats")
    keys = [k for k in ("queries", "hits", "preempted_queries", "preempted_hits") if st_v and k in st_v]
    same = bool(keys) and all(st_v[k] == st_l[k] for k in keys)
    checks.append(Check("same prefix-cache queries and hits (preempted apart)", same,
                        "" if same else f"vLLM {st_v} vs lab {st_l}"))
    return checks
