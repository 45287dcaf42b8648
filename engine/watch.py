"""``python -m engine watch ENDPOINT...`` and ``python -m engine replay FILE``: a server's prefix cache in
the terminal, one line per KV event batch, from a live ZMQ stream or a capture.

Each line: ``rank 0  #12  +3 stored  -1 removed  cache 40 blocks = 1,280 tokens`` (blocks count physical
copies, ``cache_mirror.py``); a replayed batch says so; gaps, malformed messages and connection changes get
their own lines. At the end (Ctrl-C, ``--duration`` or ``--max-batches``) the cache's state per rank: blocks,
tokens, distinct prefixes, the roots of the prefix tree and the longest chain; with ``--tokenizer DIR``
the text of each root's first block.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from .cache_mirror import BatchSummary, PrefixCacheMirror
from .capture import CaptureReplay, CaptureWriter, new_header, read_capture
from .config import check_endpoint
from .kv_subscriber import KVEventSubscriber


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
                   help="replay at this multiple of the recorded pace (default 0: as fast as possible)")
    r.add_argument("--tokenizer", help="model folder whose tokenizer decodes block text in the final state")


def summary_line(rank: int, s: BatchSummary) -> str:
    tag = "  (replayed)" if s.replayed else ""
    clear = "  all blocks cleared" if s.cleared else ""
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
    for h in sorted(roots, key=lambda r: mirror.blocks[r].stored_seq)[:max_roots]:
        b = mirror.blocks[h]
        subtree = _subtree_size(h, kids)
        text = f"  {decode(b.token_ids)!r}" if decode else ""
        lines.append(f"  root {h[:12]} stored in batch {b.stored_seq}: a tree of {subtree} block{'s' * (subtree != 1)}"
                     f"{text}")
    if len(roots) > max_roots:
        lines.append(f"  ... {len(roots) - max_roots} more roots")
    lines += [f"  note: {n}" for n in mirror.notes[-5:]]
    if mirror.unknown_removals:
        lines.append(f"  note: {mirror.unknown_removals} removals of blocks stored before the watch began")
    return lines


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
    if getattr(args, "record", None):
        folder = Path(args.record).resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--record {args.record!r}: the folder {str(folder)!r} does not exist")


def watch(args, out=sys.stdout) -> int:
    _check_args(args)
    for e in args.endpoints:
        check_endpoint(e, "ENDPOINT")
    for e in args.replay_endpoint:
        check_endpoint(e, "--replay-endpoint")
    if args.replay_endpoint and len(args.replay_endpoint) != len(args.endpoints):
        raise ValueError(f"{len(args.replay_endpoint)} --replay-endpoint for {len(args.endpoints)} endpoints: "
                         f"give one per endpoint, in the same order")
    decode = _decoder(args.tokenizer)
    writer = (CaptureWriter(args.record, new_header("python -m engine watch", args.endpoints, model=args.tokenizer))
              if args.record else None)
    on_raw = (lambda raw: writer.write(raw.rank, raw.seq, raw.recv_ts, raw.payload, raw.replayed)) if writer else None
    replays = args.replay_endpoint or [None] * len(args.endpoints)
    subs = [KVEventSubscriber(e, r, topic=args.topic, rank=i, on_raw=on_raw)
            for i, (e, r) in enumerate(zip(args.endpoints, replays))]
    stop = {"now": False}
    previous = signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    start = time.monotonic()
    shown = {s.rank: 0 for s in subs}     # batches printed per rank
    errors = {s.rank: 0 for s in subs}
    states = {s.rank: None for s in subs}
    print(f"watching {', '.join(args.endpoints)} (Ctrl-C to stop)", file=out, flush=True)
    try:
        while not stop["now"]:
            total = 0
            for s in subs:
                v = s.view()
                if v.state != states[s.rank]:
                    states[s.rank] = v.state
                    print(f"rank {s.rank}  {s.endpoint}: {v.state}", file=out, flush=True)
                fresh = v.mirror.num_batches - shown[s.rank]
                for h in (list(v.mirror.history)[-fresh:] if fresh > 0 else []):
                    print(summary_line(s.rank, h), file=out, flush=True)
                shown[s.rank] = v.mirror.num_batches
                for e in v.errors[errors[s.rank]:]:
                    print(f"rank {s.rank}  {e}", file=out, flush=True)
                errors[s.rank] = len(v.errors)
                total += v.mirror.num_batches
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
        for line in state_lines(s.view().mirror, decode):
            print(line, file=out)
    if args.record:
        print(f"capture written to {args.record}", file=out)
    return 0


def replay(args, out=sys.stdout) -> int:
    capture = read_capture(args.file)
    if args.speed < 0:
        raise ValueError(f"--speed must be >= 0, got {args.speed}")
    decode = _decoder(args.tokenizer)
    print(f"replaying {args.file}: {len(capture.batches)} batches from {capture.header.get('source')!r}, "
          f"ranks {capture.ranks}", file=out)
    replayer = CaptureReplay(capture)
    mirrors = replayer.state(0).mirrors
    errors: list[str] = []
    previous_t = None
    for b in capture.batches:
        if args.speed and previous_t is not None:
            time.sleep(max(0.0, (b.t - previous_t) / args.speed))
        previous_t = b.t
        n_errors = len(errors)
        CaptureReplay.apply_batch(mirrors, errors, b)
        for e in errors[n_errors:]:
            print(e, file=out)
        if len(errors) == n_errors:
            print(summary_line(b.rank, mirrors[b.rank].history[-1]), file=out, flush=True)
    for m in mirrors.values():
        for line in state_lines(m, decode):
            print(line, file=out)
    return 0
