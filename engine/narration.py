"""The block pool's decisions in plain sentences, written from its typed events.

The pool and the KV cache managers emit typed events only (``engine.records.EventKind`` with the payload
of ``records.EVENT_DATA``); ``EventLog.emit`` asks ``sentence`` for the one-line text a person reads
("R2: block 7 is shared (count 3) and partly filled, so it is copied to block 12 before writing token
9"). ``facts`` carries the few figures a sentence names that the recorded payload does not (the block
size, a shared block's count, the blocks just taken), so they are not written into traces twice.
The scheduler and the contiguous baseline still pass their own sentences.
"""

from __future__ import annotations

from .records import EventKind


def _n(count: int, noun: str) -> str:
    """'1 block', '3 blocks'."""
    return f"{count} {noun}{'s' * (count != 1)}"


def _by_group(data, facts) -> str:
    """Every KV cache group's blocks of an event, in group order: "full [4, 5], window 48 [0, 1]"."""
    return ", ".join(f"{name} {b}" for name, b in zip(facts["groups"], data["group_blocks"]))


def _new_blocks(fresh, data, facts) -> str:
    """'2 new blocks [4, 5]'; over KV cache groups every group's: '4 new blocks: full [4, 5], window 48 [0, 1]'."""
    if "group_blocks" in data:
        return f"{_n(sum(map(len, data['group_blocks'])), 'new block')}: {_by_group(data, facts)}"
    return f"{_n(len(fresh), 'new block')} {fresh}"


def _allocate(rid, blocks, data, facts) -> str:
    if "chunk" in facts:  # vLLM V1: one more prefill chunk of a sequence that already holds blocks
        fresh, start = facts["fresh"], facts["start"]
        took = (f"takes {_new_blocks(fresh, data, facts)}" if fresh or any(data.get("group_blocks", ()))
                else "fits in its last block")
        return f"{rid}: prefill chunk of {facts['chunk']} tokens (positions {start}..{data['num_tokens'] - 1}) {took}"
    num_tokens, cached, B = data["num_tokens"], data["cached_tokens"], facts["block_size"]
    hits = cached // B
    fresh = blocks[hits:]
    taken = f"take {_new_blocks(fresh, data, facts)}"
    if hits:
        msg = (f"{rid}: prefix cache hit, {cached} tokens in blocks {blocks[:hits]} reused; "
               f"{_n(num_tokens - cached, 'more token')} {taken}")
    else:
        msg = f"{rid}: {_n(num_tokens, 'token')} {taken}"
    return msg + f" (last block holds {num_tokens - (len(blocks) - 1) * B}/{B})"


def _free(rid, blocks, data, facts) -> str:
    if "released" not in data:
        return f"{rid}: released its swapped-out blocks"
    table = data["released"]
    msg = f"{rid}: released {_n(len(table), 'block')}, {len(blocks)} free again {blocks}"
    kept = [b for b in table if b not in blocks]
    if kept:
        msg += f", {len(kept)} still in use by other sequences {kept}"
    if facts.get("cached"):
        msg += f"; {facts['cached']} keep their prefix-cache hash until evicted"
    return msg


def _evict(rid, blocks, data, facts) -> str:
    copies = data["still_cached"]
    also = (f"; {_n(copies, 'other block')} with the same prefix {'stays' if copies == 1 else 'stay'} cached"
            if copies else "")
    return f"block {blocks[0]} evicted from the prefix cache (hash {data['hash']}) to be reused{also}"


def _swap(rid, blocks, data, facts, out: bool) -> str:
    pairs = data["pairs"]
    if out:
        what = (f"copied to the CPU swap pool ({', '.join(f'{g}->cpu{c}' for g, c in pairs)}) and "
                f"released on the GPU")
    else:
        what = f"copied back from the CPU swap pool ({', '.join(f'cpu{c}->{g}' for c, g in pairs)})"
    return f"{', '.join(data['seqs'])}: {_n(len(pairs), 'block')} {what}"


_WRITERS = {
    EventKind.ALLOCATE: _allocate,
    EventKind.FREE: _free,
    EventKind.EVICT: _evict,
    EventKind.PREFIX_HIT: lambda rid, blocks, data, facts: (
        f"{rid}: reused {_n(len(blocks), 'cached block')} ({data['num_tokens']} tokens)"
        + (" on re-admission" if data["readmission"] else "")),
    EventKind.NEW_BLOCK: lambda rid, blocks, data, facts: (
        f"{rid}: token {data['position']} starts logical block {data['logical_block']}, "
        + (f"takes {_new_blocks(blocks, data, facts)}" if "group_blocks" in data else f"takes block {blocks[0]}")),
    EventKind.APPEND: lambda rid, blocks, data, facts: (
        f"{rid}: token {data['position']} written into "
        + (f"blocks {_by_group(data, facts)}" if "group_blocks" in data else f"block {blocks[0]}")
        + f" ({facts['fill']}/{facts['block_size']})"),
    EventKind.COW: lambda rid, blocks, data, facts: (
        f"{rid}: block {data['src']} is shared (count {facts['count']}) and partly filled, so it is copied "
        f"to block {data['dst']} before writing token {data['position']}"),
    EventKind.FORK: lambda rid, blocks, data, facts: f"{rid} forked from {data['parent']}: shares blocks {blocks}",
    EventKind.SWAP_OUT: lambda rid, blocks, data, facts: _swap(rid, blocks, data, facts, out=True),
    EventKind.SWAP_IN: lambda rid, blocks, data, facts: _swap(rid, blocks, data, facts, out=False),
    EventKind.RESET_PREFIX_CACHE: lambda rid, blocks, data, facts: (
        f"prefix cache reset: {_n(data['num_blocks'], 'cached block')} forgotten"),
    EventKind.LEAVE_WINDOW: lambda rid, blocks, data, facts: (
        f"{rid}: {_n(len(blocks), 'block')} {blocks} left the {facts['window']}-token sliding window of KV cache "
        f"group {data['group']} (token {data['position']} attends to {max(0, data['position'] - facts['window'] + 1)}.."
        f"{data['position']} only): given back, the null block in that table now"),
}


def sentence(kind: EventKind, request_id: str | None, blocks: list[int], data: dict, facts: dict) -> str:
    """The event in one plain sentence. Raises KeyError for a kind the pool never emits (the scheduler and
    the contiguous baseline pass their own sentences)."""
    return _WRITERS[kind](request_id, blocks, data, facts)  # an EventKind is its str
