"""The KV-aware router's view of a prompt: how much of it each server has cached, and where a router would
send it.

Prefix-aware routers keep, per worker, a tree of the blocks its KV events say are cached (NVIDIA Dynamo's
``KvIndexer``, llm-d's KV-cache indexer behind its precise prefix-cache scorer) and read a new request's
longest cached prefix from it. This module reads the same thing from the lab's mirrors
(``cache_mirror.PrefixCacheMirror``, one per stream).

Cached prefix, by vLLM's rules (``vllm/v1/core/kv_cache_manager.py`` ``get_computed_blocks``, 0.32):

* whole blocks only: the prompt's first ``len // block_size`` blocks can be cached, a partial last block never;
* chained hashes: block i is a hit only if block i-1 is (a block's hash covers its parent's), so the match is
  the longest run from the first block, and it stops at the first miss even if later blocks are cached;
* the last-token rule: a prompt's last token is never served from the cache (its logits must be computed),
  so at most ``(len - 1) // block_size`` blocks hit (a prompt of exactly 2 blocks gets at most 1).

A hybrid server (KV cache groups: sliding-window and full-attention layers, ``cache_mirror``'s
``group_specs``) serves a prefix only when every group has it, as vLLM's ``HybridKVCacheCoordinator.
find_longest_cache_hit`` (vllm/v1/core/kv_cache_coordinator.py) settles it: full-attention groups from the
left (as above); a sliding-window group within that length, searched from the right: a prefix of ``k`` blocks
is usable when its last ``ceil((window - 1) / B)`` blocks are cached in that group (``SlidingWindowManager.
find_longest_cache_hit``, ``_contiguous_blocks_for_hit``), and without such a run the group's cached blocks
from the start are the hit; a group that finds less shortens the length and the groups are asked again, except
in vLLM's "simple hybrid" (one full and one other kind), where one pass settles it. The prompt's block hashes
are read from the content chain (below), held in whichever group; each group's blocks by ``group_idx``.
(A uniform sliding-window server has no full group: its chain is known only as far as its blocks are in the
view.)

Hashes are matched the way ``cache_mirror`` compares servers, by content: the prompt's block i matches the
cached block whose token ids equal it and whose parent is the block matched for i-1 (None for i = 0). This
is the chained-hash lookup without recomputing the server's hash function (vLLM's sha256 over CBOR with a
per-process seed, the lab's over its own encoding): equal content under an equal parent is an equal hash, for
any server. LoRA adapters and multimodal inputs, which also enter vLLM's hash, are not told apart here.

The router rule implemented is Dynamo's KV router cost (Dynamo docs, "Router design" / "Routing concepts":
https://docs.nvidia.com/dynamo/latest/design-docs/router-design and .../components/router/routing-concepts):

    cost(worker) = overlap_score_weight x prefill_blocks + decode_blocks           (lower is better)
    prefill_blocks = (prompt tokens - cached prefix tokens) / B                     (tokens to compute, in blocks)
    decode_blocks  = (the worker's active tokens) / B + ceil(prompt tokens / B)     ("potential active blocks")

with Dynamo's defaults ``kv_overlap_score_weight = 1.0`` and router temperature 0 (the lowest cost wins).
Dynamo's workers all have one block size B. Servers watched side by side may not (the lab's 16 beside a vLLM
server's 32): costing each in its own blocks would make a block of 32 tokens weigh as much as one of 16, and a
server with 80 of 99 tokens cached could lose to one with none. So every figure is counted in tokens and
divided by one common B for all servers, ``cost_block_size``: the smallest block size among the servers that
are candidates (with one block size for all it is Dynamo's cost exactly). A server's active tokens are its
active blocks x its own block size. With equal load, more cached tokens never costs more.
Dynamo counts a worker's active blocks itself, from the requests it routed; a watcher has no such record, so
the active blocks here are read from the server's own ``/metrics``: ``vllm:kv_cache_usage_perc`` x its usable
pool (blocks held by running requests, ``metrics.active_blocks``). A server without ``/metrics`` counts 0
active blocks and is said to have an unknown load. Ties (equal cost) go to the server with more cached
tokens, then the one given first (Dynamo samples among equal workers; a view must be reproducible).
llm-d's precise prefix-cache scorer scores the same longest cached prefix (consecutive blocks from the first,
per pod), normalised, beside its load scorers with configurable weights; Dynamo's single cost is the rule
implemented.

Not a candidate: a server none of whose KV event streams could be read (unreachable, not a publisher, never
connected: ``unavailable``) is shown as "unreachable: not a candidate" and never chosen (a router has no
tree for it). Its block size is its own (from its /metrics) or unknown, never another server's.

A mirror that joined a running server without the batches before it (its first batch numbered above 0, or
no batch at all) may be missing blocks stored before: its row says so (``incomplete``), since its cached
prefix may be larger than shown.

A server with several data-parallel ranks is several workers to a router: each rank is scored and the
server's row is its best rank (``rank`` says which).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

from .. import metrics
from ..kv_events import WHOLE_RANGE_KINDS
from ..records import plural

OVERLAP_SCORE_WEIGHT = 1.0   # Dynamo's default kv_overlap_score_weight
DEFAULT_BLOCK_SIZE = 16      # vLLM's default, for a server whose block size nothing has told yet
MAX_PROMPT_TOKENS = 1_048_576  # a prompt longer than this is refused (no served model takes 2**20 tokens)
RULE = ("Dynamo KV router cost: overlap_score_weight x prefill_blocks + decode_blocks, lowest wins, every server "
        "counted in blocks of one common size (cost_block_size) "
        "(https://docs.nvidia.com/dynamo/latest/design-docs/router-design)")
UNREACHABLE = "unreachable: not a candidate"


@dataclass
class PrefixMatch:
    """A prompt's cached prefix on one stream: ``blocks`` / ``tokens`` served from the cache (after the
    last-token rule), ``matched_blocks`` (the chain of whole blocks found cached, before it), ``hashes`` (the
    matched blocks' hashes, first to last: what the Server page highlights), ``block_size``."""
    blocks: int = 0
    tokens: int = 0
    matched_blocks: int = 0
    hashes: list[str] = field(default_factory=list)
    block_size: int | None = None


def check_prompt(ids) -> list[int]:
    """Token ids as a list of ints >= 0, or ValueError naming the bad value (an empty prompt, a prompt longer
    than ``MAX_PROMPT_TOKENS``)."""
    ids = list(ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(f"the prompt is {len(ids):,} tokens, more than the {MAX_PROMPT_TOKENS:,} this view takes")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"token {i} of the prompt is {t!r}, expected a token id (an int >= 0)")
    return ids


def parse_ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3`` (commas and/or spaces) as ids, or ValueError naming the bad item."""
    parts = [p for p in text.replace(",", " ").split()]
    ids = []
    for p in parts:
        try:
            ids.append(int(p))
        except ValueError:
            raise ValueError(f"--prompt-ids {text[:60]!r}: {p[:30]!r} is not a token id (give ints separated by "
                             f"commas, e.g. 1,2,3)") from None
    return check_prompt(ids)


def cached_prefix(mirror, ids: list[int]) -> PrefixMatch:
    """The longest prefix of ``ids`` the mirror's server would serve from its cache (see the module
    docstring). O(blocks in the mirror + prompt length)."""
    size = mirror.block_size
    if size is None or not mirror.blocks:
        return PrefixMatch(block_size=size)
    index: dict[tuple, str] = {}
    for h, b in mirror.blocks.items():  # a block whose parent left the view can match no prompt: keyed as sent
        index.setdefault((b.parent, tuple(b.token_ids)), h)
    hashes: list[str] = []
    parent = None
    for i in range(len(ids) // size):
        h = index.get((parent, tuple(ids[i * size:(i + 1) * size])))
        if h is None:
            break
        hashes.append(h)
        parent = h
    if mirror.hybrid:
        matched = hybrid_hit_blocks(mirror, hashes, len(ids) // size)
        usable = hybrid_hit_blocks(mirror, hashes, (len(ids) - 1) // size)  # the last-token rule
        return PrefixMatch(blocks=usable, tokens=usable * size, matched_blocks=matched, hashes=hashes[:usable],
                           block_size=size)
    usable = min(len(hashes), (len(ids) - 1) // size)  # the last-token rule
    return PrefixMatch(blocks=usable, tokens=usable * size, matched_blocks=len(hashes), hashes=hashes[:usable],
                       block_size=size)


def hybrid_hit_blocks(mirror, hashes: list[str], max_blocks: int) -> int:
    """The blocks of a prompt every KV cache group of ``mirror`` serves (see the module docstring): ``hashes``
    are the prompt's block hashes as far as the view knows them, ``max_blocks`` the most a hit may take.
    vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``: full-attention groups first, then the others
    within the length so far, until no group shortens it (one pass for a "simple hybrid")."""
    size = mirror.block_size
    specs = mirror.group_specs
    held = {g: mirror.group_hashes(g) for g in specs}
    full = {g: specs[g]["kind"] in (None, *WHOLE_RANGE_KINDS) or not specs[g].get("sliding_window") for g in specs}
    order = sorted(specs, key=lambda g: (not full[g], g))
    kinds = {(full[g], specs[g].get("sliding_window")) for g in specs}
    simple = len(kinds) == 2 and full[order[0]]
    found: dict[int, int] = {}
    hit = max(0, min(max_blocks, len(hashes)))
    while True:
        current = hit
        for g in order:
            if full[g] and g in found:  # full attention is downward-closed: looked up once
                current = min(current, found[g])
                continue
            if full[g]:
                n = 0
                while n < current and hashes[n] in held[g]:
                    n += 1
            else:
                need = math.ceil((specs[g]["sliding_window"] - 1) / size)  # vLLM's _contiguous_blocks_for_hit
                n = run = 0
                for i in range(current - 1, -1, -1):  # from the right: the first run of ``need`` wins
                    if hashes[i] in held[g]:
                        run += 1
                        if run >= need:
                            n = i + run
                            break
                    else:
                        run = 0
                else:
                    n = run  # no full run: the cached blocks from the start
            current = found[g] = n
        if current >= hit:
            break
        hit = current
        if simple:
            break
    return hit


@dataclass
class WorkerScore:
    """One stream (a server's data-parallel rank) as Dynamo's cost sees it; see the module docstring. The
    ``*_blocks`` of the cost are in blocks of ``cost_block_size`` (common to all servers); ``block_size`` is
    the server's own (None: unknown)."""
    server: str
    rank: int
    stream: int
    prompt_tokens: int
    block_size: int | None
    cost_block_size: int
    cached_prefix_tokens: int
    cached_prefix_blocks: int
    matched_blocks: int
    prefill_blocks: float | None
    active_blocks: int | None     # None: the server's load is unknown (no /metrics), counted as 0
    request_blocks: int | None
    decode_blocks: float | None
    cost: float | None            # None: not a candidate
    hashes: list[str] = field(default_factory=list)
    reachable: bool = True
    candidate: bool = True
    why_not: str | None = None
    incomplete: str | None = None


def own_block_size(mirror, server_metrics: dict | None) -> int | None:
    """A stream's block size: its events', else its /metrics', else None (unknown)."""
    values = server_metrics or {}
    return mirror.block_size or (int(values["block_size"]) if values.get("block_size") else None)


def incomplete_note(mirror, has_replay: bool = False) -> str | None:
    """Why the mirror may be missing blocks the server holds, or None: it joined after the server began (its
    first batch numbered above 0) or saw no batch at all. With a replay endpoint the past was asked for; a
    first batch above 0 then still means the server's replay buffer no longer held the start."""
    if mirror.first_seq is None:
        if mirror.num_batches:
            return None
        return "no batch seen: blocks stored before this view began are unknown"
    if mirror.first_seq > 0:
        return (f"cache seen from batch {mirror.first_seq}: blocks stored before are unknown"
                + ("" if has_replay else " (no --replay endpoint)"))
    return None


def score(server: str, rank: int, stream: int, mirror, ids: list[int], server_metrics: dict | None = None,
          overlap_score_weight: float = OVERLAP_SCORE_WEIGHT, cost_block_size: int = DEFAULT_BLOCK_SIZE
          ) -> WorkerScore:
    """One stream's figures, its cost in blocks of ``cost_block_size`` (common to all servers: the module
    docstring)."""
    m = cached_prefix(mirror, ids)
    values = server_metrics or {}
    size = own_block_size(mirror, values)
    active = metrics.active_blocks(values)
    b = cost_block_size
    request_blocks = math.ceil(len(ids) / b)
    prefill = (len(ids) - m.tokens) / b
    decode = (active or 0) * (size or b) / b + request_blocks
    return WorkerScore(server=server, rank=rank, stream=stream, prompt_tokens=len(ids), block_size=size,
                       cost_block_size=b, cached_prefix_tokens=m.tokens, cached_prefix_blocks=m.blocks,
                       matched_blocks=m.matched_blocks, prefill_blocks=round(prefill, 4), active_blocks=active,
                       request_blocks=request_blocks, decode_blocks=round(decode, 4),
                       cost=round(overlap_score_weight * prefill + decode, 4), hashes=m.hashes)


def route(servers, mirrors: dict, ids: list[int], server_metrics: dict | None = None,
          overlap_score_weight: float = OVERLAP_SCORE_WEIGHT, unavailable: dict | None = None,
          model_limit: tuple[int, str] | None = None) -> dict:
    """Every server's best rank and the choice.

    Args:
        servers: ``servers.ServerSpec`` list (their ``streams`` key ``mirrors``).
        mirrors: stream -> PrefixCacheMirror.
        ids: the prompt's token ids (``check_prompt``).
        server_metrics: server name -> its parsed /metrics (``server_metrics.parse_metrics``), where known.
        unavailable: stream -> why its events could not be read (unreachable, not a publisher, never
            connected); a server all of whose streams are here is not a candidate.
        model_limit: (tokens, where it was read) the longest prompt the model takes (the tokenizer's
            ``model_max_length`` / the config's ``max_position_embeddings``), for servers whose /metrics give
            no ``max_model_len``; a server whose limit the prompt exceeds cannot take it: not a candidate.

    Returns ``{"servers": {name: {cached_prefix_tokens, cached_prefix_blocks, reachable, candidate, ...}},
    "choice": name, "rule": RULE, "cost_block_size": B, "overlap_score_weight": w, "prompt_tokens": n}``;
    ``choice`` is None when no server is a candidate."""
    ids = check_prompt(ids)
    if not overlap_score_weight >= 0:
        raise ValueError(f"overlap_score_weight must be >= 0, got {overlap_score_weight}")
    from .cache_mirror import PrefixCacheMirror

    unavailable = unavailable or {}
    values_of = {sv.name: (server_metrics or {}).get(sv.name) for sv in servers}
    reach = {sv.name: [st for st in sv.streams if st not in unavailable] for sv in servers}
    sizes = [own_block_size(mirrors.get(st) or PrefixCacheMirror(rank=st), values_of[sv.name])
             for sv in servers for st in reach[sv.name]]
    known = [x for x in sizes if x]
    common = min(known) if known else DEFAULT_BLOCK_SIZE
    rows: dict[str, WorkerScore] = {}
    order = {}
    for i, sv in enumerate(servers):
        order[sv.name] = i
        values = values_of[sv.name]
        best = None
        for r, stream in enumerate(sv.streams):
            if stream in unavailable:
                continue
            mirror = mirrors.get(stream) or PrefixCacheMirror(rank=stream)
            s = score(sv.name, r, stream, mirror, ids, values, overlap_score_weight, common)
            replays = list(getattr(sv, "replays", None) or [])
            s.incomplete = incomplete_note(mirror, bool(r < len(replays) and replays[r]))
            if best is None or (s.cost, -s.cached_prefix_tokens) < (best.cost, -best.cached_prefix_tokens):
                best = s
        limit = model_limit
        if values and values.get("max_model_len"):
            limit = (int(values["max_model_len"]), "max_model_len from its /metrics")
        if best is not None and limit and len(ids) > limit[0]:  # vLLM refuses such a request outright
            best.candidate, best.cost = False, None
            best.why_not = (f"cannot take it: the prompt is {len(ids):,} tokens, more than {limit[0]:,} "
                            f"({limit[1]}): not a candidate")
        if best is None:  # no stream of it could be read: a router has no tree for it
            stream = sv.streams[0] if sv.streams else -1
            why = "; ".join(f"{unavailable[st]}" for st in sv.streams if st in unavailable)
            best = WorkerScore(server=sv.name, rank=0, stream=stream, prompt_tokens=len(ids),
                               block_size=own_block_size(PrefixCacheMirror(rank=stream), values),
                               cost_block_size=common, cached_prefix_tokens=0, cached_prefix_blocks=0,
                               matched_blocks=0, prefill_blocks=None, active_blocks=metrics.active_blocks(values or {}),
                               request_blocks=None, decode_blocks=None, cost=None, reachable=False, candidate=False,
                               why_not=f"{UNREACHABLE} ({why})" if why else UNREACHABLE)
        rows[sv.name] = best
    candidates = [s for s in rows.values() if s.candidate]
    choice = min(candidates, key=lambda s: (s.cost, -s.cached_prefix_tokens, order[s.server]), default=None)
    out = {name: {k: v for k, v in asdict(s).items() if k not in ("server", "hashes", "stream")}
           for name, s in rows.items()}
    for name, s in rows.items():
        out[name]["load_known"] = s.active_blocks is not None
    return {"servers": out, "choice": None if choice is None else choice.server, "rule": RULE,
            "cost_block_size": common, "overlap_score_weight": overlap_score_weight, "prompt_tokens": len(ids),
            "_hashes": {name: s.hashes for name, s in rows.items() if s.candidate},
            "_streams": {name: s.stream for name, s in rows.items() if s.candidate}}


def public(result: dict) -> dict:
    """``route``'s result without the private keys (what ``--json`` prints)."""
    return {k: v for k, v in result.items() if not k.startswith("_")}


def lines(result: dict) -> list[str]:
    """``route``'s result in words, one line per server and the choice."""
    b = result.get("cost_block_size")
    out = [f"prompt: {result['prompt_tokens']:,} tokens; costs in blocks of {b} tokens for every server"]
    for name, r in result["servers"].items():
        size = f"blocks of {r['block_size']}" if r["block_size"] else "block size unknown"
        if not r["candidate"]:
            out.append(f"  {name}: {r['why_not']}; {size}")
            continue
        load = (f"{r['active_blocks']:,} active blocks (/metrics)" if r["load_known"] else
                "load unknown (no /metrics: 0 active blocks counted)")
        rank = f" rank {r['rank']}" if r["rank"] else ""
        out.append(f"  {name}{rank}: cached prefix {r['cached_prefix_tokens']:,} tokens = "
                   f"{plural(r['cached_prefix_blocks'], 'block')} of {r['block_size']}"
                   + (f" ({r['matched_blocks']} cached, the last-token rule leaves {r['cached_prefix_blocks']})"
                      if r["matched_blocks"] != r["cached_prefix_blocks"] else "")
                   + f"; prefill {r['prefill_blocks']:g} blocks, decode {r['decode_blocks']:g} blocks ({load}); "
                     f"cost {r['cost']:g}")
        if r.get("incomplete"):
            out.append(f"    note: {r['incomplete']}: the cached prefix may be larger than shown")
    choice = result["choice"] if result["choice"] is not None else "none (no server is a candidate)"
    out.append(f"a KV-aware router would send it to: {choice}  ({result['rule']}, "
               f"overlap_score_weight {result['overlap_score_weight']:g})")
    return out


# --------------------------------------------------------------------------------------------- the CLI
def add_parser(sub) -> None:
    r = sub.add_parser("route", help="where a KV-aware router would send a prompt: its cached prefix per server",
                       description="Per server, the longest prefix of the prompt cached there (vLLM's rules) and "
                                   "the server Dynamo's KV router cost would choose.")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--capture", help="read the servers' caches from this capture (its final state)")
    src.add_argument("--server", action="append", metavar="NAME=ENDPOINT[,ENDPOINT...]",
                     help="watch this server live (repeat for several; --replay / --metrics as for watch)")
    r.add_argument("--replay", action="append", default=[], metavar="NAME=ENDPOINT[,ENDPOINT...]",
                   help="server NAME's replay endpoint(s): the batches before this command started come from there")
    r.add_argument("--metrics", action="append", default=[], metavar="NAME=URL",
                   help="server NAME's /metrics: its load (active blocks) for the router's cost")
    p = r.add_mutually_exclusive_group(required=True)
    p.add_argument("--prompt", help="the prompt's text (with --tokenizer)")
    p.add_argument("--prompt-ids", help="the prompt's token ids, e.g. 1,2,3")
    r.add_argument("--tokenizer", help="model folder whose tokenizer turns --prompt into ids (the servers' model)")
    r.add_argument("--wait", type=float, default=2.0,
                   help="live: seconds to listen before answering (the replay socket fills in the past)")
    r.add_argument("--overlap-score-weight", type=float, default=OVERLAP_SCORE_WEIGHT,
                   help="Dynamo's kv_overlap_score_weight (default 1.0)")
    r.add_argument("--json", action="store_true", help="print one JSON object")


def load_tokenizer(folder: str):
    """``--tokenizer DIR``'s tokenizer, or ValueError naming the folder."""
    from pathlib import Path

    if not Path(folder).is_dir():
        raise ValueError(f"--tokenizer {folder!r} is not a folder")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - one line naming the folder
        raise ValueError(f"--tokenizer {folder!r}: no tokenizer could be loaded from it "
                         f"({type(exc).__name__})") from None


def model_limit(tok, folder: str) -> tuple[int, str] | None:
    """The longest prompt the model takes, from the tokenizer's ``model_max_length`` (transformers' "no
    limit" is a huge sentinel, ignored) or the folder's config.json ``max_position_embeddings``; None when
    neither says."""
    n = getattr(tok, "model_max_length", None)
    if isinstance(n, int) and 0 < n < 10 ** 8:
        return n, f"the tokenizer's model_max_length in {folder}"
    from pathlib import Path

    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return (n, f"max_position_embeddings in {folder}/config.json") if isinstance(n, int) and n > 0 else None


def prompt_ids(args) -> list[int]:
    """The prompt's ids; sets ``args.model_limit`` ((tokens, source) or None) from ``--tokenizer``."""
    args.model_limit = None
    if args.prompt_ids is not None:
        ids = parse_ids(args.prompt_ids)
        if args.tokenizer:
            tok = load_tokenizer(args.tokenizer)
            args.model_limit = model_limit(tok, args.tokenizer)
            vocab = len(tok)
            bad = next(((i, t) for i, t in enumerate(ids) if t >= vocab), None)
            if bad:
                raise ValueError(f"--prompt-ids: token {bad[0]} is {bad[1]}, beyond the vocabulary of "
                                 f"{vocab:,} ids of --tokenizer {args.tokenizer!r}")
        return ids
    if not args.tokenizer:
        raise ValueError("--prompt needs --tokenizer DIR (the servers' model folder) to become token ids; or give "
                         "--prompt-ids")
    tok = load_tokenizer(args.tokenizer)
    args.model_limit = model_limit(tok, args.tokenizer)
    # as vLLM's /v1/completions tokenizes a text prompt (special tokens added); verbose=False: transformers'
    # "Token indices sequence length is longer than..." warning is said by the router's row instead
    return check_prompt(tok(args.prompt, verbose=False)["input_ids"])


def from_capture(path: str):
    from .capture import CaptureReplay, read_capture, server_scrapes
    from .servers import servers_of_capture

    capture = read_capture(path)
    replay = CaptureReplay(capture)
    state = replay.state(len(replay))
    servers = servers_of_capture(capture.header, capture.ranks)
    values = {}
    for sv in servers:
        scrapes = server_scrapes(capture, sv.name)
        if scrapes:
            values[sv.name] = scrapes[-1]["values"]
    return servers, state.mirrors, values


def from_live(args):
    from .kv_subscriber import KVEventSubscriber
    from .server_metrics import fetch_metrics
    from .servers import parse_servers

    servers = parse_servers(args.server, args.replay, args.metrics)
    if not 0 < args.wait <= 600:  # NaN fails too
        raise ValueError(f"--wait must be seconds above 0, at most 600, got {args.wait}")
    subs = []
    try:
        for sv in servers:
            for stream, e, rep in zip(sv.streams, sv.endpoints, sv.replays):
                subs.append(KVEventSubscriber(e, rep, rank=stream))
        start = time.monotonic()
        try:
            while time.monotonic() < start + args.wait:
                time.sleep(0.1)
        except KeyboardInterrupt:  # Ctrl-C: answer now, with what was heard (as watch ends on Ctrl-C)
            print(f"interrupted after {time.monotonic() - start:.1f} s of --wait {args.wait:g}: answering with "
                  f"what was heard", file=sys.stderr, flush=True)
        views = {s.rank: s.view() for s in subs}
    finally:
        for s in subs:
            s.stop()
    down = {s.rank: f"{s.endpoint}: {v.state}" for s, v in zip(subs, views.values())
            if v.state in ("unreachable", "not_publisher", "connecting")}
    problems = list(down.values())
    if len(problems) == len(subs):  # nothing to route on: an answer would only say every cache is empty
        raise ValueError(f"no server's KV events could be read within --wait {args.wait:g} s ({'; '.join(problems)})")
    values = {}
    for sv in servers:
        if sv.metrics_url:
            try:
                values[sv.name] = fetch_metrics(sv.metrics_url)
            except ValueError as exc:
                problems.append(str(exc))
    return servers, {k: v.mirror for k, v in views.items()}, values, problems, down


def main(args, out=None) -> int:
    out = sys.stdout if out is None else out
    ids = prompt_ids(args)
    problems: list[str] = []
    down: dict = {}
    if args.capture:
        if args.replay or args.metrics:
            raise ValueError("--replay / --metrics go with --server, not --capture (a capture holds its /metrics)")
        servers, mirrors, values = from_capture(args.capture)
    else:
        servers, mirrors, values, problems, down = from_live(args)
    result = route(servers, mirrors, ids, values, args.overlap_score_weight, unavailable=down,
                   model_limit=getattr(args, "model_limit", None))
    incomplete = [f"{name}: {r['incomplete']}" for name, r in result["servers"].items() if r.get("incomplete")]
    if args.json:
        print(json.dumps({**public(result), "problems": problems + incomplete}), file=out)
    else:
        for line in lines(result):
            print(line, file=out)
        for p in problems:
            print(f"note: {p}", file=out)
    return 0
