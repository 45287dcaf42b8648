"""A step in words and in numbers: what each scheduled sequence computed, and the step's token bars.

Pure functions of ``StepRecord``s (no Streamlit, no torch). A step's parts come from
``StepRecord.scheduled`` (each sequence's ``num_tokens`` at positions ``start_pos..start_pos+n-1``) and the
sequence's ``prompt_len`` in the step's snapshot:

- a **decode** token: one token at a position >= the prompt's length;
- a **prefill chunk** (vLLM V1's chunked prefill): positions ``a..b`` of the ``N`` tokens the sequence must
  compute before it samples, with more to come in later steps;
- the **last chunk** of such a prefill, or a **full prefill** (all ``N`` tokens, after any prefix-cache hit);
  ``N`` exceeds the prompt after a recompute preemption (prompt + generated tokens, computed again).

``N`` is read from the snapshot after the step: the sequence's tokens, less the one it sampled this step
(``StepRecord.new_tokens``). Step kinds are the engine's ``STEP_KINDS``: "prefill", "decode", "mixed" (V1:
decode tokens and prefill chunks in one step) and "idle".
"""

from __future__ import annotations

import re

import plotly.graph_objects as go

from .block_table import selection_events
from .colors import request_id_of
from .plain import figure

# one colour per part of a step (not request colours: this chart is about the step, not who ran)
PART_COLORS = {"decode": "#56B4E9", "prefill": "#332288"}
KIND_WORDS = {"prefill": "prefill step", "decode": "decode step", "mixed": "mixed step", "idle": "idle step"}
SEMANTICS_SHORT = {"paper": "paper (vLLM V0)", "v1": "vLLM V1"}


def step_parts(record) -> list[dict]:
    """One dict per scheduled sequence: seq_id, request_id, kind ("decode" | "prefill"), num_tokens, start,
    end (last position), total (tokens to compute before sampling; None if the snapshot lacks the sequence),
    prompt_len, cached (prefix-cache hit tokens it found this step), chunk ("first" | "middle" | "last" |
    "full": where this part sits in its prefill)."""
    seqs = {s.seq_id: s for s in record.snapshot.sequences}
    cached = {e.request_id: e.data.get("cached_tokens", 0) for e in record.events if e.kind == "allocate"}
    admitted = {e.request_id for e in record.events if e.kind == "admit"}
    parts = []
    for s in record.scheduled:
        seq = seqs.get(s.seq_id)
        prompt_len = seq.prompt_len if seq is not None else None
        end = s.start_pos + s.num_tokens - 1
        part = {"seq_id": s.seq_id, "request_id": s.request_id, "num_tokens": s.num_tokens, "start": s.start_pos,
                "end": end, "prompt_len": prompt_len, "total": None, "cached": 0, "chunk": "full"}
        # one new token of a request already running; a request admitted this step prefills, even one token
        if s.num_tokens == 1 and (prompt_len is None or s.start_pos >= prompt_len) and s.request_id not in admitted:
            part["kind"] = "decode"
        else:
            part["kind"] = "prefill"
            hit = cached.get(s.seq_id, cached.get(s.request_id, 0))
            part["cached"] = hit if hit == s.start_pos else 0
            if seq is not None:
                total = len(seq.token_ids) - (1 if s.seq_id in record.new_tokens else 0)
                part["total"] = total
                first = s.start_pos == part["cached"]
                done = end + 1 >= total
                part["chunk"] = "full" if first and done else "first" if first else "last" if done else "middle"
        parts.append(part)
    return parts


def _ids(ids: list[str], limit: int = 6) -> str:
    """``R1-R5`` for a run of consecutive request numbers, else a list (cut after ``limit``)."""
    nums = [re.fullmatch(r"R(\d+)", i) for i in ids]
    if len(ids) > 2 and all(nums):
        values = [int(m.group(1)) for m in nums]
        if values == list(range(values[0], values[0] + len(values))):
            return f"R{values[0]}-R{values[-1]}"
    shown = ", ".join(ids[:limit])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


def _a(n: int) -> str:
    """The article before a number said aloud: "an 8-token", "an 11-token", "a 16-token"."""
    s = str(n)
    return "an" if s.startswith("8") or (s[:2] in ("11", "18") and len(s) % 3 == 2) else "a"


def _prefill_words(p: dict) -> str:
    n, a, b, total = p["num_tokens"], p["start"], p["end"], p["total"]
    of = f" of {total}" if total is not None else ""
    where = f"position {a}{of}" if a == b else f"positions {a}-{b}{of}"
    if total is not None and p["prompt_len"] is not None and total > p["prompt_len"]:
        where += f": prompt {p['prompt_len']} + {total - p['prompt_len']} generated, recomputed"
    if p["cached"]:
        where += f"; positions 0-{p['cached'] - 1} from the prefix cache"
    what = {"full": f"{_a(n)} {n}-token prefill", "first": f"{_a(n)} {n}-token prefill chunk",
            "middle": f"{_a(n)} {n}-token prefill chunk", "last": f"the last {n}-token prefill chunk"}[p["chunk"]]
    rest = ""
    if p["chunk"] in ("first", "middle") and total is not None:
        rest = f", {total - b - 1} more in later steps"
    return f"{what} of {p['seq_id']} ({where}{rest})"


MAX_PREFILLS_SAID = 4  # a step with more prefills says them in one clause (``_prefills_words``)


def _prefills_words(prefills: list[dict]) -> str:
    """Several prefills in one clause: "8 prefills (R1-R8): 243 tokens, 560 more found in the prefix cache"."""
    ids = [p["seq_id"] for p in prefills]
    tokens = sum(p["num_tokens"] for p in prefills)
    cached = sum(p["cached"] or 0 for p in prefills)
    chunks = sum(p["chunk"] in ("first", "middle") for p in prefills)
    more = f", {cached:,} more found in the prefix cache" if cached else ""
    parts = f"; {chunks} of them chunks with more to come" if chunks else ""
    return f"{len(prefills)} prefills ({_ids(ids)}): {tokens:,} prompt tokens{more}{parts}"


def describe_step(record, budget: int | None = None) -> str:
    """The step by its parts, in one sentence, e.g. "mixed step: 5 decode tokens (R1-R5) + a 64-token
    prefill chunk of R6 (positions 128-191 of 300, 108 more in later steps)". ``budget``: the engine's
    token budget per step (V1's ``max_num_batched_tokens``), to say how much of it the step used."""
    kind = KIND_WORDS.get(record.kind, f"{record.kind} step")
    parts = step_parts(record)
    if not parts:
        snap = record.snapshot
        if not snap.waiting and not snap.running and not snap.swapped:
            return f"{kind}: nothing left to run on this engine, every request has finished"
        return f"{kind}: nothing ran (nothing waiting could be admitted)"
    decode = [p["seq_id"] for p in parts if p["kind"] == "decode"]
    pieces = []
    if decode:
        pieces.append(f"{len(decode)} decode token{'s' * (len(decode) != 1)} ({_ids(decode)})")
    prefills = [p for p in parts if p["kind"] == "prefill"]
    if len(prefills) > MAX_PREFILLS_SAID:  # one clause for many prompts, not one each
        pieces.append(_prefills_words(prefills))
    else:
        pieces += [_prefill_words(p) for p in prefills]
    used = sum(p["num_tokens"] for p in parts)
    tail = f"; {used:,} of the {budget:,}-token budget" if budget else f"; {used:,} tokens computed"
    return f"{kind}: " + " + ".join(pieces) + tail


def step_label(record) -> str:
    """The step kind for a caption: "decode", "prefill", or for a mixed step its parts in short, e.g.
    "mixed: 5 decode tokens + 1 prefill chunk (64 tokens)"."""
    if record.kind != "mixed":
        return record.kind
    parts = step_parts(record)
    decode = sum(p["kind"] == "decode" for p in parts)
    chunks = [p for p in parts if p["kind"] == "prefill"]
    tokens = sum(p["num_tokens"] for p in chunks)
    return (f"mixed: {decode} decode token{'s' * (decode != 1)} + {len(chunks)} prefill "
            f"{'chunks' if len(chunks) != 1 else 'chunk'} ({tokens} token{'s' * (tokens != 1)})")


def step_tokens_figure(records: list, budget: int | None = None, current_step: int | None = None,
                       semantics: str | None = None) -> go.Figure:
    """Tokens each step computed, stacked: decode tokens and prefill tokens (chunks included); a mixed step
    has both. ``budget`` draws V1's token budget per step as a line; the title names ``semantics``."""
    steps = [r.step for r in records]
    counts = {"decode": [], "prefill": []}
    hover = []
    for r in records:
        parts = step_parts(r)
        for kind in counts:
            counts[kind].append(sum(p["num_tokens"] for p in parts if p["kind"] == kind))
        hover.append(step_label(r))
    data = [{"type": "bar", "x": steps, "y": counts[kind], "name": label, "marker": {"color": PART_COLORS[kind]},
             "customdata": hover, "hovertemplate": f"step %{{x}} (%{{customdata}}): %{{y}} {label}<extra></extra>"}
            for kind, label in (("decode", "decode tokens"), ("prefill", "prefill tokens (chunks too)"))]
    tallest = max((d + p for d, p in zip(counts["decode"], counts["prefill"])), default=0)
    off_scale = bool(budget) and budget > 4 * max(tallest, 1)  # a line far above would flatten every bar
    shapes, annotations = [], []
    if budget and not off_scale:  # what ``fig.add_hline(..., annotation_position="top left")`` writes
        shapes.append({"type": "line", "x0": 0, "x1": 1, "xref": "x domain", "y0": budget, "y1": budget,
                       "yref": "y", "line": {"dash": "dash", "color": "#D55E00"}})
        annotations.append({"text": f"token budget {budget:,}", "showarrow": False, "x": 0, "xanchor": "left",
                            "xref": "x domain", "y": budget, "yanchor": "bottom", "yref": "y"})
    if current_step is not None:  # ``fig.add_vline``
        shapes.append({"type": "line", "x0": current_step, "x1": current_step, "xref": "x", "y0": 0, "y1": 1,
                       "yref": "y domain", "line": {"dash": "dot", "color": "#888888"}})
    title = "tokens computed per step"
    if semantics:
        title += f" ({SEMANTICS_SHORT.get(semantics, semantics)})"
    if off_scale:
        title += f"; token budget {budget:,} per step, far above every step"
    layout = {"barmode": "stack", "title": {"text": title, "font": {"size": 14}}, "height": 260,
              "margin": {"l": 10, "r": 10, "t": 60, "b": 10}, "plot_bgcolor": "white",
              "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
              "xaxis": {"title": {"text": "step"}, "tickformat": "d", **({"dtick": 1} if len(steps) <= 12 else {})},
              "yaxis": {"rangemode": "tozero"}, "shapes": shapes, "annotations": annotations}
    return figure(data, layout)


def sharing_counts(records: list) -> dict:
    """How the steps so far shared KV blocks, counted from their events: forks, copy-on-write copies,
    prefix-cache hit tokens of first admissions (re-admissions apart) and the sequences that found them."""
    counts = {"forks": 0, "cow": 0, "hit_tokens": 0, "hit_seqs": [], "readmission_hit_tokens": 0}
    for r in records:
        for e in r.events:
            if e.kind == "fork":
                counts["forks"] += 1
            elif e.kind == "cow":
                counts["cow"] += 1
            elif e.kind == "prefix_hit":
                if e.data.get("readmission"):
                    counts["readmission_hit_tokens"] += e.data.get("num_tokens", 0)
                else:
                    counts["hit_tokens"] += e.data.get("num_tokens", 0)
                    counts["hit_seqs"].append(e.request_id)
    return counts


# ------------------------------------------------------------------------------------- the step in words
# Events of one kind that many sequences share in a step are said once, grouped ("8 sequences found the same
# 5 cached blocks (R1-R8)"), so a big step reads as a few sentences instead of one bullet per sequence.
GROUPED_KINDS = ("cow", "prefix_hit", "allocate", "new_block", "admit", "finish", "fork", "free", "evict")
MAX_SENTENCES = 24  # a step says at most this many sentences (the rest summed up in one more)
GROUP_FROM = 5  # this many events of one kind in a step are said in one sentence (the presenter's view: 2)


def _plural(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


def _group_sentence(kind: str, events: list) -> str:
    """One sentence for several events of ``kind`` in a step (two or more sequences)."""
    who = _ids(list(dict.fromkeys(e.request_id for e in events if e.request_id)))
    n = len(events)
    blocks = sorted({b for e in events for b in e.blocks})
    if kind == "prefix_hit":
        tokens = sorted({e.data.get("num_tokens", 0) for e in events})
        same = len(blocks) and all(sorted(e.blocks) == sorted(events[0].blocks) for e in events)
        where = (f"the same {_plural(len(blocks), 'cached block')} ({', '.join(map(str, blocks[:8]))})"
                 if same else f"{_plural(len(blocks), 'cached block')} in all")
        amount = f"{tokens[0]:,} prompt tokens each" if len(tokens) == 1 else \
            f"{sum(e.data.get('num_tokens', 0) for e in events):,} prompt tokens in all"
        return f"{n} sequences found {where} in the prefix cache ({who}; {amount})"
    if kind == "cow":
        pairs = [(e.data.get("src"), e.data.get("dst")) for e in events]
        srcs = sorted({a for a, _ in pairs if a is not None})
        copies = ", ".join(f"{a}->{b}" for a, b in pairs[:8]) + (", ..." if n > 8 else "")
        src = f"shared block {srcs[0]}" if len(srcs) == 1 else f"{len(srcs)} shared blocks"
        return (f"copy-on-write: {n} sequences were about to write into {src} and each got its own copy first "
                f"({who}: {copies})")
    if kind == "allocate":  # over KV cache groups: every group's new blocks too (what the pool took)
        blocks = sorted(set(blocks) | {b for e in events for g in e.data.get("group_blocks", ()) for b in g})
        return f"{n} sequences took {_plural(len(blocks), 'block')} for their prompts ({who})"
    if kind == "new_block":
        return f"{n} sequences filled their last block and each took a fresh one ({who})"
    if kind == "admit":
        return f"{n} requests were admitted to the running batch ({who})"
    if kind == "finish":
        return f"{n} sequences finished ({who})"
    if kind == "fork":
        if not blocks:  # the contiguous baseline: no blocks to share, each child copies into its own row
            return f"{n} sequences were forked and each copied its parent's written slots into its own row ({who})"
        return f"{n} sequences were forked and share their parent's blocks ({who})"
    if kind == "free":
        return f"{n} sequences returned {_plural(len(blocks), 'block')} ({who})"
    if kind == "evict":
        owners = f" ({who})" if who else ""
        return f"{_plural(n, 'free cached block')} {'was' if n == 1 else 'were'} handed out again and lost their hashes{owners}"
    raise ValueError(f"no grouped sentence for event kind {kind!r}")


def _written(e) -> str:
    """The block an append wrote into: "7"; over KV cache groups each group's, in group order: "[3, 7]"."""
    if "group_blocks" in e.data:
        return str([b for g in e.data["group_blocks"] for b in g])
    return str(e.blocks[0])


def _append_sentence(appends: list) -> str:
    n = len(appends)
    shown = ", ".join(f"{e.request_id}->{_written(e)}" for e in appends[:6]) + (", ..." if n > 6 else "")
    return (f"{_plural(n, 'sequence')} wrote {'their' if n != 1 else 'its'} new token into a block with room "
            f"({shown})")


# What a talk is about comes first when a step is said in few words (``step_sentences(key_first=True)``).
KEY_KINDS = ("cow", "preempt", "swap_out", "swap_in", "prefix_hit", "fork", "wait")


def _beams(ids: list[str]) -> str:
    """Beam ids in short: "R1.b4-b6" for consecutive beams of one request, else a list ("R1.b0, R1.b3")."""
    m = [re.fullmatch(r"(.+\.b)(\d+)", i) for i in ids]
    if len(ids) > 2 and all(m) and len({x.group(1) for x in m}) == 1:
        nums = [int(x.group(2)) for x in m]
        if nums == list(range(nums[0], nums[0] + len(nums))):
            return f"{ids[0]}-b{nums[-1]}"
    return ", ".join(ids)


def _selection_sentence(forks: list, pruned: list) -> str:
    """A beam step's selection in one short sentence (``viz.block_table.selection_events``): the beams kept
    by forking (grouped by parent, with the blocks they share) and the pruned ones (with the blocks that went
    back to the free queue), e.g. "beam selection: R1.b4-b6 forked from R1.b0 on blocks [0, 2]; R1.b1-b3
    pruned, blocks [1, 3, 4] freed" (one line on the presenter's 1920 px screen)."""
    by_parent: dict[str, list] = {}
    for e in forks:
        by_parent.setdefault(e.data["parent"], []).append(e)
    kept = [f"{_beams([e.request_id for e in kids])} forked from {parent} on blocks {sorted(kids[0].blocks)}"
            for parent, kids in by_parent.items()]
    freed = sorted({b for e in pruned for b in e.blocks})
    back = f"blocks {freed} freed" if freed else "no block freed (all still shared)"
    gone = [f"{_beams([e.request_id for e in pruned])} pruned, {back}"] if pruned else []
    return "beam selection: " + "; ".join(kept + gone)


def _event_lines(events: list, key_first: bool = False, group_from: int = GROUP_FROM,
                 snapshot=None) -> list[tuple[str, str]]:
    """(kind, sentence) per decision of a step: see ``event_sentences``."""
    paged = snapshot is not None and getattr(snapshot, "allocator", "paged") == "paged"
    forks, pruned = selection_events(events, snapshot) if paged else ([], [])
    selection = set(map(id, forks + pruned)) if pruned else set()
    events = [e for e in events if id(e) not in selection]
    by_kind: dict[str, list] = {}
    for e in events:
        by_kind.setdefault(str(e.kind), []).append(e)
    lines, said = [], set()
    if selection:  # kind "fork": a key moment, said after a copy-on-write
        lines.append(("fork", _selection_sentence(forks, pruned)))
    for e in events:
        kind = str(e.kind)
        if kind == "append" or kind in said:
            continue
        group = by_kind[kind]
        if kind in GROUPED_KINDS and len(group) >= max(2, group_from):
            lines.append((kind, _group_sentence(kind, group)))
            said.add(kind)
        else:
            lines.append((kind, e.message))
    if key_first:
        rank = {k: i for i, k in enumerate(KEY_KINDS)}
        lines.sort(key=lambda ks: rank.get(ks[0], len(rank)))  # stable: same-kind order kept
    if "append" in by_kind:
        lines.append(("append", _append_sentence(by_kind["append"])))
    return lines


def event_sentences(events: list, key_first: bool = False, group_from: int = GROUP_FROM,
                    snapshot=None) -> list[str]:
    """The allocator's decisions of one step, in order of first appearance: each event's own sentence, or
    one sentence for ``group_from`` or more events of a ``GROUPED_KINDS`` kind; plain appends summed up
    last. A beam step's selection (its forks and the pruned beams' frees, ``snapshot``: the step's, to tell a
    pruned beam from a finished one) is one "beam selection" sentence. ``key_first``: the sentences of
    ``KEY_KINDS`` first, in that order (a stable sort)."""
    return [text for _, text in _event_lines(events, key_first, group_from, snapshot)]


def step_sentences(paged, contiguous=None, budget: int | None = None,
                   limit: int = MAX_SENTENCES, key_first: bool = False, group_from: int = GROUP_FROM) -> list[str]:
    """"This step, in words": the paged step by its parts (``describe_step``), its allocator decisions
    grouped (``event_sentences``), then the contiguous baseline's admissions, waits, frees and copies,
    prefixed "contiguous:". At most ``limit`` sentences: beyond, one more says how many were left out.
    ``key_first`` (the presenter's few lines): the paged step's copy-on-write, preemption, swap and hit
    sentences before the step's parts. ``group_from``: see ``event_sentences``."""
    events = _event_lines(paged.events, key_first=key_first, group_from=group_from, snapshot=paged.snapshot)
    lines = [describe_step(paged, budget)] + [text for _, text in events]
    if key_first and events and events[0][0] in KEY_KINDS:  # the moment first, then what the step computed
        lines = [events[0][1], describe_step(paged, budget)] + [text for _, text in events[1:]]
    if contiguous is not None:
        kept = [e for e in contiguous.events if e.kind in ("wait", "allocate", "free", "cow", "fork")]
        lines += [f"contiguous: {s}" for s in event_sentences(kept, key_first=key_first, group_from=group_from)]
    if len(lines) > limit:
        rest = len(lines) - (limit - 1)
        lines = lines[: limit - 1] + [f"... and {_plural(rest, 'more decision')} (see the block tables)"]
    return lines


def latest_sequences(records: list) -> list:
    """Every sequence seen in ``records`` (a run's StepRecords up to the step shown, oldest first) in its
    latest state, in order of first appearance: a step's snapshot lists only the sequences still running and
    those finished in that step, so a finished sequence's text is read from the step it finished in."""
    latest: dict[str, object] = {}
    first: dict[str, int] = {}
    for i, record in enumerate(records):
        for seq in record.snapshot.sequences:
            first.setdefault(seq.seq_id, i)
            latest[seq.seq_id] = seq
    return [latest[s] for s in sorted(latest, key=lambda s: first[s])]
