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
import time
from pathlib import Path

from .cache_mirror import BatchSummary, PrefixCacheMirror, hash_labels
from .capture import CaptureReplay, CaptureWriter, new_header, read_capture, replay_gap
from ..config import check_endpoint
from .kv_subscriber import KVEventSubscriber
from ..records import plural

MIN_SPEED, MAX_SPEED = 0.01, 10_000.0  # replay --speed: 100x slower .. 10,000x faster than recorded (or 0)
MAX_WAIT_S = 60.0  # replay waits at most this long between two batches


def add_parsers(sub) -> None:
    w = sub.add_parser("watch", help="print a server's KV cache events live (vLLM, SGLang or the lab)")
    w.add_argument("endpoints", nargs="+", metavar="ENDPOINT",
                   help="KV events PUB endpoint(s), one per data-parallel rank, e.g. tcp://127.0.0.1:5557")
    w.add_argument("--replay-endpoint", action="append", default=[],
                   help="the replay (ROUTER) endpoint of each ENDPOINT, in the same order (repeat the flag)")
    w.add_argument("--topic", default="", help="subscribe to this topic (default: all, vLLM's default '')")
    w.add_argument("--record", help="append every batch received to this capture file (JSON lines)")
    w.add_argument("--duration", type=float, help="stop after this many seconds")
    w.add_argument("--max-batches", type=int, help="stop after this many batches (all ranks together)")
    w.add_argument("--tokenizer", help="model folder whose tokenizer decodes block text in the final state")
    r = sub.add_parser("replay", help="print a KV event capture as `watch` would have, and its final state")
    r.add_argument("file", help="a capture written by `watch --record` or the Server page")
    r.add_argument("--speed", type=float, default=0.0,
                   help=f"replay at this multiple of the server's pace (the batches' own timestamps), from "
                        f"{MIN_SPEED:g} to {MAX_SPEED:g} (default 0: as fast as possible)")
    r.add_argument("--tokenizer", help="model folder whose tokenizer decodes block text in the final state")


def summary_line(rank: int, s: BatchSummary) -> str:
    tag = "  (replayed)" if s.replayed else ""
    clear = ("  view reset: the publisher restarted" if s.restarted else
             "  all blocks cleared" if s.cleared else "")
    return (f"rank {rank}  #{s.seq:<6} +{s.stored:<4} stored  -{s.removed:<4} removed{clear}  "
            f"cache {s.num_blocks:,} blocks = {s.num_tokens:,} tokens{tag}")


def state_lines(mirror: PrefixCacheMirror, decode=None, max_roots: int = 8) -> list[str]:
    """The cache's state in a few lines: totals, roots of the prefix tree, the longest chain."""
    kids = mirror.children()
    roots = kids.get(None, [])
    depth: dict[str, int] = {}
    stack = [(h, 1) for h in roots]
    while stack:  # iterative: a chain can be thousands of blocks long
        h, d = stack.pop()
        depth[h] = d
        stack.extend((c, d + 1) for c in kids.get(h, []))
    lines = [f"rank {mirror.rank}: {mirror.num_blocks:,} cached blocks ({len(mirror.blocks):,} distinct) = "
             f"{mirror.num_tokens:,} tokens, {len(roots)} prefix roots, longest chain "
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
    for e in args.endpoints:
        check_endpoint(e, "ENDPOINT")
    for e in args.replay_endpoint:
        check_endpoint(e, "--replay-endpoint")
    if args.replay_endpoint and len(args.replay_endpoint) != len(args.endpoints):
        raise ValueError(f"{len(args.replay_endpoint)} --replay-endpoint for {len(args.endpoints)} endpoints: "
                         f"give one per endpoint, in the same order")
    decode = _decoder(args.tokenizer)
    # markers: the stream's counts are in marker lines (``capture.py``), so a replay counts what this watch did
    writer = (CaptureWriter(args.record, {**new_header("python -m engine watch", args.endpoints,
                                                       model=args.tokenizer), "markers": True})
              if args.record else None)
    on_raw = writer.add if writer else None  # batches and markers (what a replay counts)
    replays = args.replay_endpoint or [None] * len(args.endpoints)
    subs = [KVEventSubscriber(e, r, topic=args.topic, rank=i, on_raw=on_raw)
            for i, (e, r) in enumerate(zip(args.endpoints, replays))]
    stop = {"now": False}
    previous = signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    start = time.monotonic()
    logged = {s.rank: 0 for s in subs}    # log entries printed per rank (``KVEventSubscriber.log``)
    states = {s.rank: None for s in subs}
    print(f"watching {', '.join(args.endpoints)} (Ctrl-C to stop)", file=out, flush=True)
    try:
        while not stop["now"]:
            total = 0
            for s in subs:
                state, applied = s.progress()  # never ``view()`` here: it copies the whole mirror
                if state != states[s.rank]:
                    states[s.rank] = state
                    said = {"not_publisher": "not a KV event publisher"}.get(state, state)
                    print(f"rank {s.rank}  {s.endpoint}: {said}", file=out, flush=True)
                # notes, errors and batches in the order they happened (a join, a gap or a restart is
                # noted before the batch that showed it is applied)
                entries, logged[s.rank] = s.log_since(logged[s.rank])
                for kind, item in entries:
                    print(summary_line(s.rank, item) if kind == "batch" else
                          f"rank {s.rank}  note: {item}" if kind == "note" else f"rank {s.rank}  {item}",
                          file=out, flush=True)
                total += applied
            if args.max_batches is not None and total >= args.max_batches:
                break
            if args.duration is not None and time.monotonic() - start >= args.duration:
                break
            time.sleep(0.1)
    finally:
        signal.signal(signal.SIGINT, previous)
        for s in subs:
            s.stop()
        if writer:
            sizes = {s.view().mirror.block_size for s in subs} - {None}
            writer.close(block_size=sizes.pop() if len(sizes) == 1 else None)
    for s in subs:
        v = s.view()
        for line in state_lines(v.mirror, decode):
            print(line, file=out)
        print(stream_line(v, states[s.rank]), file=out)
    if args.record:
        print(f"capture written to {args.record}", file=out)
    return 0


def replay(args, out=None) -> int:
    out = sys.stdout if out is None else out
    _check_args(args)
    capture = read_capture(args.file)
    decode = _decoder(args.tokenizer)
    print(f"replaying {args.file}: {len(capture.batches)} batches from {capture.header.get('source')!r}, "
          f"ranks {capture.ranks}", file=out)
    replayer = CaptureReplay(capture)
    mirrors = replayer.state(0).mirrors
    errors: list[str] = []
    previous = None
    jump_waited = 0.0  # seconds waited in all for clock jumps, at most MAX_WAIT_S in all
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
        _replay_one(mirrors, errors, b, out, replayer.infer_gaps)
    n_errors = len(errors)
    for m in capture.trailing:
        CaptureReplay.apply_marker(mirrors, errors, m, replayer.infer_gaps)
    for e in errors[n_errors:]:
        print(e, file=out)
    for m in mirrors.values():
        for line in state_lines(m, decode):
            print(line, file=out)
        print(counts_line(m.num_batches, m.num_replayed, m.malformed, m.duplicates, m.jumps, m.gaps,
                          m.lost_batches, m.before_watch, m), file=out)
    return 0


def _replay_one(mirrors: dict, errors: list[str], b, out, infer_gaps: bool = True) -> None:
    """Apply one capture batch (after its markers) and print what the watch printed for them: notes, skipped
    messages and the batch's line, in order."""
    n_errors = len(errors)
    notes = {r: m.num_notes for r, m in mirrors.items()}
    applied = CaptureReplay.apply_batch(mirrors, errors, b, infer_gaps)
    for r, m in mirrors.items():
        new = m.num_notes - notes.get(r, 0)
        for n in (m.notes[-new:] if new > 0 else []):
            print(f"rank {r}  note: {n}", file=out)
    for e in errors[n_errors:]:
        print(e, file=out)
    if applied:
        print(summary_line(b.rank, mirrors[b.rank].history[-1]), file=out, flush=True)
