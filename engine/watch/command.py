"""``python -m engine watch ENDPOINT...`` and ``python -m engine replay FILE``: a server's prefix cache in
the terminal, one line per KV event batch, from a live ZMQ stream or a capture.

Each line: ``rank 0  #12  +3 stored  -1 removed  cache 40 blocks = 1,280 tokens`` (blocks count physical
copies, ``cache_mirror.py``); a replayed batch says so; gaps, malformed messages and connection changes get
their own lines, and so does each note of the mirror (a late join, a restart, the memory cap) when it is
written. At the end (Ctrl-C, ``--duration`` or ``--max-batches``) the cache's state per rank: blocks,
tokens, distinct prefixes, the roots of the prefix tree and the longest chain, and the stream's counts
(batches received and replayed, malformed, duplicates, impossible jumps, gaps, lost, and, for a late
join, the batches published before the watch began, which are not lost); with ``--tokenizer DIR`` the
text of each root's first block.

``replay --speed S`` waits, between two batches, the time the server put between them (their own ``ts``,
``capture.replay_gap``) divided by S; S is 0 (no waiting) or from ``MIN_SPEED`` to ``MAX_SPEED``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

from .cache_mirror import BatchSummary, PrefixCacheMirror, hash_labels
from .capture import (CaptureReplay, CaptureWriter, new_header, read_capture, replay_gap, server_pool,
                      server_scrapes)
from .groups import root_groups, tiers, tiers_line
from .kv_subscriber import KVEventSubscriber
from .server_metrics import MetricsPoller, fetch_metrics
from .servers import DEFAULT_NAME, ServerSpec, is_named, one_server, parse_servers, servers_of_capture
from .. import metrics as lab_metrics
from ..records import plural

MIN_SPEED, MAX_SPEED = 0.01, 10_000.0  # replay --speed: 100x slower .. 10,000x faster than recorded (or 0)
MAX_WAIT_S = 60.0  # replay waits at most this long between two batches


def add_parsers(sub) -> None:
    w = sub.add_parser("watch", help="print servers' KV cache events live (vLLM, SGLang or the lab)",
                       description="Watch one server (ENDPOINT... are its data-parallel ranks) or several "
                                   "(--server NAME=ENDPOINT[,ENDPOINT...], repeated).")
    w.add_argument("endpoints", nargs="*", metavar="ENDPOINT",
                   help="one server's KV events PUB endpoint(s), one per data-parallel rank, e.g. "
                        "tcp://127.0.0.1:5557 (or use --server)")
    w.add_argument("--server", action="append", default=[], metavar="NAME=ENDPOINT[,ENDPOINT...]",
                   help="a server to watch: its name and its endpoint(s), one per data-parallel rank; repeat for "
                        "several servers")
    w.add_argument("--replay", action="append", default=[], metavar="NAME=ENDPOINT[,ENDPOINT...]",
                   help="the replay (ROUTER) endpoint(s) of server NAME, one per endpoint, same order")
    w.add_argument("--metrics", action="append", default=[], metavar="NAME=URL",
                   help="server NAME's /metrics URL (its pool size and counters); with the positional form: URL")
    w.add_argument("--replay-endpoint", action="append", default=[],
                   help="positional form: the replay (ROUTER) endpoint of each ENDPOINT, in the same order (repeat "
                        "the flag)")
    w.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the mirror's own metrics for Prometheus at http://HOST:PORT/metrics (0: any free "
                        "port), one 'server' label per server (names in the README)")
    w.add_argument("--metrics-host", default="127.0.0.1", help="with --metrics-port: the address to bind")
    w.add_argument("--topic", default="", help="subscribe to this topic (default: all, vLLM's default '')")
    w.add_argument("--record", help="append every batch received to this capture file (JSON lines)")
    w.add_argument("--duration", type=float, help="stop after this many seconds")
    w.add_argument("--max-batches", type=int, help="stop after this many batches (all servers together)")
    w.add_argument("--tokenizer", help="model folder whose tokenizer decodes block text in the final state")
    r = sub.add_parser("replay", help="print a KV event capture as `watch` would have, and its final state")
    r.add_argument("file", help="a capture written by `watch --record` or the Server page")
    r.add_argument("--speed", type=float, default=0.0,
                   help=f"replay at this multiple of the server's pace (the batches' own timestamps), from "
                        f"{MIN_SPEED:g} to {MAX_SPEED:g} (default 0: as fast as possible)")
    r.add_argument("--tokenizer", help="model folder whose tokenizer decodes block text in the final state")
    from . import router

    router.add_parser(sub)


def servers_of_args(args) -> list[ServerSpec]:
    """The servers a ``watch`` (or ``route``) command line names: ``--server`` (with ``--replay`` /
    ``--metrics``) or the positional form; ValueError naming the bad value."""
    named = getattr(args, "server", None) or []
    positional = getattr(args, "endpoints", None) or []
    if named and positional:
        raise ValueError(f"give servers either as ENDPOINT... (one server) or as --server NAME=ENDPOINT..., not "
                         f"both (got {positional[0]!r} and --server {named[0]!r})")
    if named:
        if getattr(args, "replay_endpoint", None):
            raise ValueError("--replay-endpoint goes with the positional form; with --server use --replay "
                             "NAME=ENDPOINT[,ENDPOINT...]")
        return parse_servers(named, args.replay, args.metrics)
    if not positional:
        raise ValueError("no server given: name one with --server NAME=ENDPOINT[,ENDPOINT...] (or give its "
                         "ENDPOINT...)")
    if getattr(args, "replay", None):
        raise ValueError(f"--replay {args.replay[0]!r} names a server: use --server NAME=ENDPOINT with it, or "
                         f"--replay-endpoint with the positional form")
    metrics = getattr(args, "metrics", None) or []
    if len(metrics) > 1:
        raise ValueError(f"{len(metrics)} --metrics for one server: give one URL")
    url = metrics[0] if metrics else None
    if url and is_named(url):
        name, _, url = url.partition("=")
        if name != DEFAULT_NAME:
            raise ValueError(f"--metrics {metrics[0]!r}: no --server is named {name!r} (the positional form is one "
                             f"server, named {DEFAULT_NAME!r})")
    return one_server(positional, getattr(args, "replay_endpoint", None), url)


def summary_line(rank: int | str, s: BatchSummary) -> str:
    """One batch in a line; ``rank``: the stream's label (``ServerSpec.label``; an int reads ``rank N``)."""
    tag = "  (replayed)" if s.replayed else ""
    clear = ("  view reset: the publisher restarted" if s.restarted else
             "  all blocks cleared" if s.cleared else "")
    label = f"rank {rank}" if isinstance(rank, int) else rank
    return (f"{label}  #{s.seq:<6} +{s.stored:<4} stored  -{s.removed:<4} removed{clear}  "
            f"cache {s.num_blocks:,} blocks = {s.num_tokens:,} tokens{tag}")


def state_lines(mirror: PrefixCacheMirror, decode=None, max_roots: int = 8, label: str | None = None,
                num_gpu_blocks: int | None = None) -> list[str]:
    """The cache's state in a few lines: totals (with the share of the server's own pool when its size is
    known, ``metrics.cached_share_pct``), roots of the prefix tree, the longest chain. ``label``: the stream's
    name (default ``rank N``)."""
    kids = mirror.children()
    roots = kids.get(None, [])
    depth: dict[str, int] = {}
    stack = [(h, 1) for h in roots]
    while stack:  # iterative: a chain can be thousands of blocks long
        h, d = stack.pop()
        depth[h] = d
        stack.extend((c, d + 1) for c in kids.get(h, []))
    share = lab_metrics.cached_share_pct(mirror.num_blocks, num_gpu_blocks)
    pool = (f", {share:.1f}% of its pool of {lab_metrics.usable_pool_blocks(num_gpu_blocks):,} usable blocks"
            if share is not None else "")
    lines = [f"{label or f'rank {mirror.rank}'}: {mirror.num_blocks:,} cached blocks ({len(mirror.blocks):,} "
             f"distinct) = {mirror.num_tokens:,} tokens{pool}, {len(roots)} prefix roots, longest chain "
             f"{max(depth.values(), default=0)} blocks; stored {mirror.total_stored:,}, removed "
             f"{mirror.total_removed:,} over {mirror.num_batches:,} batches"]
    shown = sorted(roots, key=lambda r: mirror.blocks[r].stored_seq)[:max_roots]
    label = hash_labels(shown)  # distinct hashes print distinctly (a small int hash's prefix is all zeros)
    for h in shown:
        b = mirror.blocks[h]
        subtree = _subtree_size(h, kids)
        text = f"  {decode(b.token_ids)!r}" if decode else ""
        lines.append(f"  root {label[h]} stored in batch {b.stored_seq}: a tree of {subtree} "
                     f"block{'s' * (subtree != 1)}{text}")
    if len(roots) > max_roots:
        lines.append(f"  ... {len(roots) - max_roots} more roots")
        groups = root_groups(mirror)[:5]  # a big pool: the trees that hold most of it
        names = hash_labels([g.root for g in groups])
        lines.append("  largest prefix trees: " + "; ".join(
            f"{names[g.root]} {plural(g.blocks, 'block')} (extended {plural(g.extended, 'time')})" for g in groups))
    counts = tiers(mirror)
    if tiers_line(counts):
        lines.append(f"  storage tiers: {tiers_line(counts)}")
    last = mirror.notes[-5:]
    if mirror.join_note and mirror.join_note not in last:  # where the view joined stays in the final state
        lines.append(f"  note: {mirror.join_note}")
    lines += [f"  note: {n}" for n in last]
    if mirror.unknown_removals:
        what = plural(mirror.unknown_removals, "removal")
        if mirror.first_seq == 0 and mirror.starts_at is None and mirror.lost_batches == 0:
            lines.append(f"  note: {what} of blocks never stored (unknown hashes: this watch saw every batch "
                         f"from #0)")
        else:
            lines.append(f"  note: {what} of blocks stored before the watch began (or in batches it missed)")
    return lines


def stream_line(v, state: str | None = None) -> str:
    """A subscriber's counts (``kv_subscriber.SubscriberView``) in one line, for the final summary;
    ``state``: the last one seen while watching (the view's own says "stopped" once the watch ended)."""
    return counts_line(v.received, v.replayed, v.malformed, v.duplicates, v.jumps, v.gaps, v.lost,
                       v.before_watch, v.mirror) + f"; last state {state or v.state}"


def counts_line(received: int, replayed: int, malformed: int, duplicates: int, jumps: int, gaps: int, lost: int,
                before_watch: int, mirror: PrefixCacheMirror) -> str:
    """The stream's counts in one line: the same words for a live watch (its subscriber's counts) and for a
    replay of its capture (counted from the capture's batches and marker lines, ``capture.py``)."""
    line = (f"  stream: {plural(received, 'batch applied', 'batches applied')} ({replayed:,} from the replay "
            f"socket), {malformed:,} malformed, {duplicates:,} duplicate or out of order, "
            f"{plural(jumps, 'impossible sequence jump')}, {plural(gaps, 'gap')}, "
            f"{plural(lost, 'batch', 'batches')} lost")
    if before_watch:  # a late join: the batches before its first one are not lost, they predate the watch
        line += (f", {plural(before_watch, 'batch', 'batches')} published before the watch began (not counted "
                 f"as lost)")
    if mirror.capped_out:
        line += f", {mirror.capped_out:,} blocks dropped from the view by its {mirror.max_blocks:,}-block cap"
    return line


def _subtree_size(h: str, kids: dict) -> int:
    n, stack = 0, [h]
    while stack:
        n += 1
        stack.extend(kids.get(stack.pop(), []))
    return n


def _decoder(path: str | None):
    """``--tokenizer``: a callable token ids -> text, or ValueError naming the folder."""
    if not path:
        return None
    from transformers import AutoTokenizer  # only when asked: the watch itself needs no model

    if not Path(path).is_dir():
        raise ValueError(f"--tokenizer {path!r} is not a folder (give a model folder with a tokenizer, e.g. "
                         f"assets/tiny_model)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; one line names the folder
        raise ValueError(f"--tokenizer {path!r}: no tokenizer could be loaded from it ({type(exc).__name__})") from None
    return lambda ids: tok.decode(ids)


def _check_args(args) -> None:
    if getattr(args, "max_batches", None) is not None and args.max_batches < 1:
        raise ValueError(f"--max-batches must be at least 1, got {args.max_batches}")
    if getattr(args, "duration", None) is not None and not args.duration > 0:
        raise ValueError(f"--duration must be a number of seconds > 0, got {args.duration}")
    speed = getattr(args, "speed", None)
    if speed is not None and speed != 0 and not MIN_SPEED <= speed <= MAX_SPEED:  # NaN fails both
        raise ValueError(f"--speed must be 0 (as fast as possible) or a multiple of the recorded pace from "
                         f"{MIN_SPEED:g} to {MAX_SPEED:g}, got {speed}")
    if getattr(args, "record", None):
        folder = Path(args.record).resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--record {args.record!r}: the folder {str(folder)!r} does not exist")


def watch(args, out=None) -> int:
    out = sys.stdout if out is None else out
    _check_args(args)
    servers = servers_of_args(args)
    single = len(servers) == 1
    label = {st: sv.label(st, single) for sv in servers for st in sv.streams}
    endpoints = [e for sv in servers for e in sv.endpoints]
    decode = _decoder(args.tokenizer)
    # markers: the stream's counts are in marker lines (``capture.py``), so a replay counts what this watch did
    header = {**new_header("python -m engine watch", endpoints, model=args.tokenizer), "markers": True}
    named = not (single and servers[0].name == DEFAULT_NAME)
    if named:
        header["servers"] = [sv.header() for sv in servers]
    writer = CaptureWriter(args.record, header) if args.record else None
    on_raw = writer.add if writer else None  # batches and markers (what a replay counts)
    subs = []
    try:
        for sv in servers:
            for stream, e, r in zip(sv.streams, sv.endpoints, sv.replays):
                subs.append(KVEventSubscriber(e, r, topic=args.topic, rank=stream, on_raw=on_raw))
    except ValueError:
        for sub in subs:
            sub.stop()
        raise
    for sv in servers:  # a /metrics URL that cannot be read is said at the start, with why
        if sv.metrics_url:
            try:
                fetch_metrics(sv.metrics_url)
            except ValueError as exc:
                print(f"note: {sv.name} /metrics: {exc} (the KV events do not depend on it; read again every "
                      f"few seconds)", file=out, flush=True)
    pollers = {sv.name: MetricsPoller(sv.metrics_url, on_scrape=(
        (lambda at, values, n=(sv.name if named else None): writer.add_metrics(n, at, values)) if writer else None
    )).start() for sv in servers if sv.metrics_url}
    exporter = None
    if getattr(args, "metrics_port", None) is not None:
        from .exporter import MirrorExporter

        try:
            exporter = MirrorExporter(servers, port=args.metrics_port,
                                      host=getattr(args, "metrics_host", "127.0.0.1"))
        except ValueError:
            for sub in subs:
                sub.stop()
            for p in pollers.values():
                p.stop()
            raise
        print(f"serving the mirror's metrics at {exporter.url}", file=out, flush=True)
    stop = {"now": False}
    main_thread = threading.current_thread() is threading.main_thread()  # only there can Ctrl-C be caught
    # Ctrl-C and SIGTERM (a service manager, ``kill``) end the watch alike: the final summary is printed
    previous = signal.signal(signal.SIGINT, lambda *_: stop.update(now=True)) if main_thread else None
    previous_term = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True)) if main_thread else None
    start = time.monotonic()
    logged = {s.rank: 0 for s in subs}    # log entries printed per stream (``KVEventSubscriber.log``)
    states = {s.rank: None for s in subs}
    what = ", ".join(endpoints) if not named else "; ".join(f"{sv.name} = {', '.join(sv.endpoints)}" for sv in servers)
    print(f"watching {what} (Ctrl-C to stop)", file=out, flush=True)
    exported = 0.0
    try:
        while not stop["now"]:
            total = 0
            for s in subs:
                name = label[s.rank]
                state, applied = s.progress()  # never ``view()`` here: it copies the whole mirror
                if state != states[s.rank]:
                    states[s.rank] = state
                    said = {"not_publisher": "not a KV event publisher"}.get(state, state)
                    print(f"{name}  {s.endpoint}: {said}", file=out, flush=True)
                # notes, errors and batches in the order they happened (a join, a gap or a restart is
                # noted before the batch that showed it is applied)
                entries, logged[s.rank] = s.log_since(logged[s.rank])
                for kind, item in entries:
                    print(summary_line(name, item) if kind == "batch" else
                          f"{name}  note: {item}" if kind == "note" else f"{name}  {item}",
                          file=out, flush=True)
                total += applied
            if exporter is not None and time.monotonic() - exported >= 1.0:
                exporter.update({s.rank: s.view() for s in subs}, pollers)
                exported = time.monotonic()
            if args.max_batches is not None and total >= args.max_batches:
                break
            if args.duration is not None and time.monotonic() - start >= args.duration:
                break
            time.sleep(0.1)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, previous_term)
        for s in subs:
            s.stop()
        for p in pollers.values():
            p.stop()
        if exporter is not None:
            exporter.close()
        if writer:
            sizes = {s.view().mirror.block_size for s in subs} - {None}
            replace = ({"servers": [sv.header(_pool(pollers.get(sv.name))) for sv in servers]} if named else
                       {"num_gpu_blocks": _pool(pollers.get(servers[0].name))} if pollers else None)
            writer.close(replace, block_size=sizes.pop() if len(sizes) == 1 else None)
    views = {s.rank: s.view() for s in subs}
    for sv in servers:
        values = pollers[sv.name].latest()[0] if sv.name in pollers else None
        if named:
            print(server_line(sv, values), file=out)
        for stream in sv.streams:
            v = views[stream]
            for line in state_lines(v.mirror, decode, label=label[stream],
                                    num_gpu_blocks=(values or {}).get("num_gpu_blocks")):
                print(line, file=out)
            print(stream_line(v, states[stream]), file=out)
    if args.record:
        print(f"capture written to {args.record}", file=out)
    return 0


def _pool(poller) -> int | None:
    return None if poller is None else (poller.latest()[0] or {}).get("num_gpu_blocks")


def server_line(sv: ServerSpec, values: dict | None) -> str:
    """A server's headline: its name, its endpoints, and its own /metrics (pool, hit rate, usage) when read."""
    line = f"server {sv.name}: {', '.join(sv.endpoints)}"
    if values:
        hit = lab_metrics.server_hit_rate_pct(values)
        usage = lab_metrics.server_kv_usage_pct(values)
        pool = values.get("num_gpu_blocks")
        line += (f"; /metrics: pool {'-' if pool is None else f'{pool:,}'} blocks, KV cache usage "
                 f"{'-' if usage is None else f'{usage:.1f}%'}, prefix cache hit rate "
                 f"{'-' if hit is None else f'{hit:.1f}%'} (lifetime)")
    elif sv.metrics_url:
        line += f"; /metrics {sv.metrics_url}: not read"
    return line


def replay(args, out=None) -> int:
    out = sys.stdout if out is None else out
    _check_args(args)
    capture = read_capture(args.file)
    decode = _decoder(args.tokenizer)
    servers = servers_of_capture(capture.header, capture.ranks)
    single = len(servers) == 1
    label = {st: sv.label(st, single) for sv in servers for st in sv.streams}
    where = (f"ranks {capture.ranks}" if single and servers[0].name == DEFAULT_NAME else
             "servers " + ", ".join(f"{sv.name} (streams {', '.join(map(str, sv.streams))})" for sv in servers))
    print(f"replaying {args.file}: {len(capture.batches)} batches from {capture.header.get('source')!r}, "
          f"{where}", file=out)
    replayer = CaptureReplay(capture)
    mirrors = replayer.state(0).mirrors
    errors: list[str] = []
    previous = None
    jump_waited = 0.0  # seconds waited in all for clock jumps, at most MAX_WAIT_S in all
    applied, interrupted = 0, False
    try:
        for b in capture.batches:
            if args.speed and previous is not None:
                wait = replay_gap(previous, b) / args.speed
                if wait > MAX_WAIT_S:  # e.g. a server idle for hours, or a bogus ts: say it, do not hang
                    allowed = max(0.0, MAX_WAIT_S - jump_waited)
                    print(f"(the server's clock jumps {wait * args.speed:,.0f} s before batch {b.seq}: waiting "
                          f"{allowed:g} s instead of {wait:,.0f} s; jumps wait at most {MAX_WAIT_S:g} s in all)",
                          file=out, flush=True)
                    wait = allowed
                    jump_waited += allowed
                time.sleep(wait)
            previous = b
            _replay_one(mirrors, errors, b, out, replayer.infer_gaps, label)
            applied += 1
    except KeyboardInterrupt:  # Ctrl-C: stop replaying and print the state so far, as watch does
        interrupted = True
        print(f"(interrupted: the state below is after {applied:,} of the capture's {len(capture.batches):,} "
              f"batches)", file=out, flush=True)
    n_errors = len(errors)
    for m in ([] if interrupted else capture.trailing):
        CaptureReplay.apply_marker(mirrors, errors, m, replayer.infer_gaps)
    for e in errors[n_errors:]:
        print(e, file=out)
    for sv in servers:
        scrapes = server_scrapes(capture, sv.name)
        if not (single and sv.name == DEFAULT_NAME):
            print(server_line(sv, scrapes[-1]["values"] if scrapes else None), file=out)
        pool = server_pool(capture, sv.name)
        for stream in sv.streams:
            m = mirrors.get(stream)
            if m is None:
                continue
            for line in state_lines(m, decode, label=label.get(stream), num_gpu_blocks=pool):
                print(line, file=out)
            print(counts_line(m.num_batches, m.num_replayed, m.malformed, m.duplicates, m.jumps, m.gaps,
                              m.lost_batches, m.before_watch, m), file=out)
    return 0


def _replay_one(mirrors: dict, errors: list[str], b, out, infer_gaps: bool = True, label: dict | None = None) -> None:
    """Apply one capture batch (after its markers) and print what the watch printed for them: notes, skipped
    messages and the batch's line, in order."""
    n_errors = len(errors)
    notes = {r: m.num_notes for r, m in mirrors.items()}
    applied = CaptureReplay.apply_batch(mirrors, errors, b, infer_gaps)
    for r, m in mirrors.items():
        new = m.num_notes - notes.get(r, 0)
        for n in (m.notes[-new:] if new > 0 else []):
            print(f"{(label or {}).get(r, f'rank {r}')}  note: {n}", file=out)
    for e in errors[n_errors:]:
        print(e, file=out)
    if applied:
        print(summary_line((label or {}).get(b.rank, b.rank), mirrors[b.rank].history[-1]), file=out, flush=True)
