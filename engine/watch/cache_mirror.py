"""A server's prefix cache rebuilt from its KV events: which blocks it holds, how they chain, and when.

A KV-aware router keeps exactly this view (vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events, ``engine/kv_events.py``); the lab keeps it to draw. Pure Python: no sockets, no torch, so the
figures, the CLI, a test and a replay all use the same class.

State (one ``PrefixCacheMirror`` per data-parallel rank):

    blocks   hash -> CachedBlock(hash, parent, token_ids, block_size, medium, copies, stored_batch, stored_ts)
             ``copies``: how many physical blocks hold this hash. vLLM can cache the same content twice
             (two requests filling the same prefix in one step before either is cached), each sends a
             BlockStored and each eviction a BlockRemoved, so a hash leaves the view only when its last
             copy is removed.
    history  one BatchSummary per applied batch (stored, removed, cleared, blocks and tokens after),
             bounded (``max_history``), oldest dropped first: what the per-batch figures draw.
    notes    what could not be applied as sent (a removal of a hash never stored, a store whose parent is
             unknown, a gap in sequence numbers), counted and described, never fatal: a watcher that joined
             late sees blocks it never saw stored.
    stale    None, or why the blocks shown are no longer the server's (``mark_stale``: the publisher restarted
             and its first batch has not arrived yet; the next ``restart`` clears the view and this).
    starts_at  the sequence number the view starts at when it joined a running publisher without the
             batches before (None: it saw the stream from batch 0, or replayed it).

Memory is bounded: at most ``max_blocks`` distinct hashes are held (a block is about 1 KB with 16 token
ids; measured 391 MB for 400,000 blocks before the cap), holding at most ``max_token_ids`` token ids in all
(``MAX_TOKEN_IDS``: the block count alone does not bound the size, measured ~1 GB for 26 blocks of 3,000,000
tokens before this cap and ``kv_events.MAX_BLOCK_SIZE``). A store past either cap drops the oldest-stored
hashes from the view (a dict keeps insertion order), counts them in ``capped_out`` and says so once in the
notes: a well-behaved server never holds more cached blocks than its pool, so only a server with a larger
pool than the cap, or a misbehaving publisher, reaches it.

Units: blocks are physical KV blocks of ``block_size`` tokens; ``num_tokens`` = sum over distinct hashes of
block_size x copies (what the pool holds, vLLM's accounting); batches are numbered by the publisher's
sequence number (``seq``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from dataclasses import dataclass, field

from ..records import plural

MAX_BLOCKS = 100_000  # distinct hashes a mirror holds (about 100 MB); see the module docstring
# token ids a mirror keeps over all its blocks (a list slot plus an int object: about 36 bytes each, so about
# 150 MB): the block cap alone counts blocks, not their size; with block sizes bounded by
# ``kv_events.MAX_BLOCK_SIZE`` (4,096) 100,000 blocks could still hold 409,600,000 ids. 4,000,000 is 100,000
# blocks of 40 tokens, more than any real server's pool of 16-token blocks that the block cap allows.
MAX_TOKEN_IDS = 4_000_000
# A hot prefix: a cached block that at least HOT_MIN_EXTENSIONS stores extended (a BlockStored whose parent it
# was, while it was cached: a request whose cached prefix ended at this block and went on past it) within the
# last HOT_WINDOW_S seconds of the server's clock. The events never say what was hit, only what was stored, so
# this is the events' own sign of reuse; its eviction is noted (``notes``) and counted (``hot_evicted``).
HOT_MIN_EXTENSIONS = 3
HOT_WINDOW_S = 60.0


@dataclass(slots=True)
class CachedBlock:
    """One cached hash. Never changed in place once in a mirror's ``blocks`` (copies share it)."""

    hash: str
    parent: str | None
    token_ids: list[int]
    block_size: int
    medium: str | None
    copies: int
    stored_seq: int          # sequence number of the batch that first stored it
    stored_ts: float         # the publisher's timestamp of that batch (seconds since the epoch)
    media: tuple = ()        # the storage tier of each copy (``medium`` of its BlockStored: "GPU", "CPU", ...)

    def tier_counts(self) -> dict:
        """medium -> copies held there (a block without ``media``: all its copies in ``medium``)."""
        out: dict = {}
        for m in self.media or (self.medium,) * self.copies:
            out[m] = out.get(m, 0) + 1
        return out


@dataclass
class BatchSummary:
    """What one batch did: ``seq`` (publisher's sequence number), ``ts`` (publisher's clock, s),
    ``stored`` / ``removed`` (blocks, counting copies), ``cleared`` (an AllBlocksCleared came),
    ``num_blocks`` / ``num_tokens`` / ``num_hashes`` (the cache after the batch)."""
    seq: int
    ts: float
    stored: int
    removed: int
    cleared: bool
    num_blocks: int
    num_tokens: int
    num_hashes: int
    replayed: bool = False
    restarted: bool = False  # the view was reset because the publisher restarted (``cleared`` is then true too)
    evicted_ages: tuple = ()  # seconds each removed block had been cached (batch ts - its stored_ts), one per block
    hot_evicted: int = 0      # hot prefixes among the blocks that left the view (see ``HOT_MIN_EXTENSIONS``)


@dataclass
class PrefixCacheMirror:
    rank: int = 0
    max_history: int = 100_000
    max_blocks: int = MAX_BLOCKS
    max_token_ids: int = MAX_TOKEN_IDS
    blocks: dict[str, CachedBlock] = field(default_factory=dict)
    history: deque = field(default_factory=deque)
    notes: list[str] = field(default_factory=list)
    unknown_removals: int = 0
    orphan_stores: int = 0
    total_stored: int = 0
    total_removed: int = 0
    num_batches: int = 0
    last_seq: int | None = None
    block_size: int | None = None
    gaps: int = 0            # jumps in the sequence numbers (``note_gap``)
    lost_batches: int = 0    # batches in those jumps that did not come back
    capped_out: int = 0      # hashes dropped from the view because it held ``max_blocks`` (see above)
    num_notes: int = 0       # notes written so far (``notes`` keeps the last 200): a reader prints the new ones
    stale: str | None = None
    starts_at: int | None = None
    first_seq: int | None = None  # the first batch applied (since the last restart)
    _num_blocks: int = 0
    _kept_tokens: int = 0  # token ids held over all distinct blocks (for ``max_token_ids``)
    _order: deque = field(default_factory=deque, repr=False)  # hashes by first store, for the cap (may hold gone ones)
    _restarted: bool = False
    version: int = 0  # +1 on every change (a batch applied, a note): readers copy only when it moved
    num_replayed: int = 0    # batches applied that came from the replay socket
    # counted by a capture replay from the capture's marker lines (``capture.py``); a live watch counts these
    # in its subscriber (``kv_subscriber.SubscriberView``), which writes the markers
    malformed: int = 0
    duplicates: int = 0
    jumps: int = 0
    before_watch: int = 0
    refused_pending: int = 0  # messages ZMQ refused unread (seq unknown): the next gap's first batch is one
    join_note: str | None = None  # the note saying where the view joined the stream (kept in the final state)
    # hash -> the server times (ts) of the last 16 stores that extended it (a tuple, replaced, never changed in
    # place: copies of the mirror share it)
    extended: dict = field(default_factory=dict)
    extensions: dict = field(default_factory=dict)  # hash -> stores that extended it while cached, in all
    hot_evicted: int = 0

    # --- applying events ---------------------------------------------------------------------------------

    def apply(self, seq: int, ts: float, events: list[dict], replayed: bool = False) -> BatchSummary:
        """Apply one decoded batch (``kv_events.DecodedBatch.events``) in order; returns its summary.
        Never raises on content: what cannot be applied is counted in ``notes``."""
        stored = removed = 0
        cleared = False
        ages: list[float] = []
        hot = 0
        for e in events:
            kind = e["type"]
            if kind == "BlockStored":
                stored += self._store(seq, ts, e)
            elif kind == "BlockRemoved":
                n, h = self._remove(e["block_hashes"], seq, ts, ages, e.get("medium"))
                removed += n
                hot += h
            elif kind == "AllBlocksCleared":
                removed += self._num_blocks
                self.blocks.clear()
                self.extended.clear()
                self.extensions.clear()
                self._order.clear()
                self._num_blocks = self._kept_tokens = 0
                cleared = True
        self.version += 1
        self.total_stored += stored
        self.total_removed += removed
        self.num_batches += 1
        self.num_replayed += replayed
        if self.first_seq is None:
            self.first_seq = seq
        self.last_seq = seq
        restarted, self._restarted = self._restarted, False
        summary = BatchSummary(seq=seq, ts=ts, stored=stored, removed=removed, cleared=cleared or restarted,
                               num_blocks=self._num_blocks, num_tokens=self.num_tokens,
                               num_hashes=len(self.blocks), replayed=replayed, restarted=restarted,
                               evicted_ages=tuple(ages), hot_evicted=hot)
        self.history.append(summary)
        while len(self.history) > self.max_history:
            self.history.popleft()
        return summary

    def _store(self, seq: int, ts: float, e: dict) -> int:
        size = e["block_size"]
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            self.note(f"batch {seq}: BlockStored with block_size {size}, earlier blocks had {self.block_size}")
        parent = e.get("parent_block_hash")
        if parent is not None and parent not in self.blocks:
            self.orphan_stores += 1  # its parent was stored before we joined, or already evicted
        elif parent is not None:  # a request went on past a cached block: see HOT_MIN_EXTENSIONS
            self.extended[parent] = (self.extended.get(parent, ()) + (ts,))[-16:]
            self.extensions[parent] = self.extensions.get(parent, 0) + 1
        tokens = e["token_ids"]
        for i, h in enumerate(e["block_hashes"]):
            block = self.blocks.get(h)
            if block is None:
                while self.blocks and (len(self.blocks) >= self.max_blocks
                                       or self._kept_tokens + size > self.max_token_ids):
                    self._drop_oldest(seq)
                self._kept_tokens += size
                self.blocks[h] = CachedBlock(hash=h, parent=parent, token_ids=list(tokens[i * size:(i + 1) * size]),
                                             block_size=size, medium=e.get("medium"), copies=1, stored_seq=seq,
                                             stored_ts=ts, media=(e.get("medium"),))
                self._order.append(h)
                if len(self._order) > 2 * len(self.blocks) + 1024:  # removed hashes pile up: rebuild (dict order)
                    self._order = deque(self.blocks)
            else:  # a new object, never changed in place: copies of the mirror share blocks (``copy``)
                self.blocks[h] = dataclasses.replace(block, copies=block.copies + 1,
                                                     media=(block.media or (block.medium,)) + (e.get("medium"),))
            parent = h  # a BlockStored chains its blocks: each one's parent is the previous
        self._num_blocks += len(e["block_hashes"])
        return len(e["block_hashes"])

    def _drop_oldest(self, seq: int) -> None:
        """The view is full (``max_blocks`` hashes): forget the oldest-stored hash and its copies. The order
        is a deque beside the dict, not ``next(iter(blocks))``: a dict's first live entry is found by scanning
        past the deleted ones, measured 5.3 s for 60,000 drops from a 100,000-entry dict."""
        while True:
            oldest = self._order.popleft()
            if oldest in self.blocks:
                break
        gone = self.blocks.pop(oldest)
        self.extended.pop(oldest, None)
        self.extensions.pop(oldest, None)
        self._num_blocks -= gone.copies
        self._kept_tokens -= len(gone.token_ids)
        self.capped_out += 1
        if self.capped_out == 1:
            self.note(f"batch {seq}: the view holds at most {self.max_blocks:,} distinct blocks and "
                      f"{self.max_token_ids:,} token ids (its memory cap); "
                      f"from here on the oldest-stored blocks are dropped from the view to make room, so it "
                      f"shows fewer blocks than the server holds, and removals of dropped blocks count as "
                      f"unknown")

    def _remove(self, hashes: list[str], seq: int = 0, ts: float = 0.0, ages: list | None = None,
                medium: str | None = None) -> tuple[int, int]:
        """Remove one copy of each hash (the copy in ``medium``, the removal's tier, when one is there);
        returns (blocks removed, hot prefixes that left the view). ``ages`` gets each removed block's age
        (seconds cached, the server's clock)."""
        done = hot = 0
        for h in hashes:
            block = self.blocks.get(h)
            if block is None:
                self.unknown_removals += 1  # stored before we joined (or a gap): nothing to take away
                continue
            if ages is not None:
                ages.append(max(0.0, ts - block.stored_ts))
            if block.copies == 1:
                del self.blocks[h]
                self._kept_tokens -= len(block.token_ids)
                self.extensions.pop(h, None)
                recent = [t for t in self.extended.pop(h, ()) if ts - t <= HOT_WINDOW_S]
                if len(recent) >= HOT_MIN_EXTENSIONS:
                    hot += 1
                    self.hot_evicted += 1
                    self.note(f"batch {seq}: hot prefix evicted: block {h[-16:]} ({len(block.token_ids)} tokens "
                              f"from {block.token_ids[:4]}...), {len(recent)} requests extended it in the last "
                              f"{HOT_WINDOW_S:.0f} s; it had been cached {max(0.0, ts - block.stored_ts):.0f} s")
            else:  # a new object, never changed in place (``copy``)
                media = list(block.media or (block.medium,) * block.copies)
                media.remove(medium if medium in media else media[-1])
                self.blocks[h] = dataclasses.replace(block, copies=block.copies - 1, media=tuple(media),
                                                     medium=media[0])
            self._num_blocks -= 1
            done += 1
        return done, hot

    def restart(self, seq: int) -> None:
        """The publisher restarted (its sequence numbers began again, at ``seq``): a restarted server's
        cache is empty, so the view forgets every block (not counted as removed: the server evicted
        nothing) and the next batch's summary is marked ``cleared``."""
        if self.stale:  # seen when the connection came back (kv_subscriber): this is the new one's first batch
            n = self._num_blocks
            self.note(f"batch {seq}, the restarted publisher's first: the {plural(n, 'block')} shown from before "
                      f"the restart {'is' if n == 1 else 'are'} dropped from the view")
        else:
            self.note(f"the publisher restarted (sequence numbers began again at {seq} after {self.last_seq}): "
                      f"its cache starts empty, so the {plural(self._num_blocks, 'block')} held before "
                      f"{'is' if self._num_blocks == 1 else 'are'} dropped from the view")
        self.blocks.clear()
        self.extended.clear()
        self.extensions.clear()
        self._order.clear()
        self._num_blocks = self._kept_tokens = 0
        self.last_seq = None
        self._restarted = True
        self.stale = None
        self.starts_at = None
        self.first_seq = None

    def mark_stale(self, text: str) -> None:
        """Keep the blocks on screen but say they are no longer the server's (e.g. it restarted: its cache is
        empty, and its first batch, which ``restart`` clears the view for, has not come yet)."""
        self.stale = text
        self.note(text)

    def take_refused(self, expected: int) -> bool:
        """A gap begins at ``expected`` after a message ZMQ refused unread (too big: its number was never read):
        take ``expected`` for that message, counted once, as malformed, and not as lost. True if so."""
        if not self.refused_pending:
            return False
        self.refused_pending -= 1
        self.last_seq = expected
        self.note(f"batch {expected:,}: taken for the message ZMQ refused unread (counted once, as malformed, not "
                  f"as a gap or lost)")
        return True

    def note_gap(self, expected: int, got: int, recovered: int) -> None:
        """Sequence numbers ``expected`` .. ``got - 1`` did not arrive live; ``recovered`` of them came back
        from the replay socket."""
        lost = got - expected - recovered
        self.gaps += 1
        self.lost_batches += lost
        what = f"batches {expected}-{got - 1}" if got - expected > 1 else f"batch {expected}"
        self.note(f"gap: {what} missed live; {recovered:,} replayed" + (f", {lost:,} lost (the view may lack "
                                                                            f"{'their' if lost > 1 else 'its'} "
                                                                            f"blocks)" if lost else ""))

    def note(self, text: str) -> None:
        self.version += 1
        self.num_notes += 1
        self.notes.append(text)
        del self.notes[:-200]  # the last 200 are plenty to read

    # --- reading -----------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Physical blocks the server holds with a hash (copies counted)."""
        return self._num_blocks

    @property
    def num_tokens(self) -> int:
        """Tokens in those blocks: blocks x block_size (cached blocks are always full)."""
        return self._num_blocks * (self.block_size or 0)

    def children(self) -> dict[str | None, list[str]]:
        """parent hash -> hashes of the cached blocks that extend it (None: blocks that start a prompt,
        plus blocks whose parent is no longer, or never was, in the view)."""
        out: dict[str | None, list[str]] = {}
        for h, b in self.blocks.items():
            parent = b.parent if b.parent in self.blocks else None
            out.setdefault(parent, []).append(h)
        return out

    def prefix_tokens(self, h: str) -> list[int]:
        """The tokens from the root of ``h``'s chain (as far as the view knows it) through ``h``."""
        chain: list[list[int]] = []
        seen = set()
        while h in self.blocks and h not in seen:
            seen.add(h)
            chain.append(self.blocks[h].token_ids)
            h = self.blocks[h].parent
        return [t for part in reversed(chain) for t in part]

    def prefixes(self) -> set[tuple[int, ...]]:
        """Every cached block as the full token prefix it ends (a content key that does not depend on the
        hash function, so two servers, or a server and the lab's engine, can be compared)."""
        return {tuple(self.prefix_tokens(h)) for h in self.blocks}

    def copy(self) -> PrefixCacheMirror:
        """A snapshot for a reader in another thread: fresh containers, the blocks themselves shared. A
        CachedBlock is never changed once in ``blocks`` (a change of ``copies`` puts a new one in its place),
        so sharing is safe, and the copy is cheap: measured 0.01-0.02 s for 100,000 blocks, against 0.6-1.1 s
        when every block was copied (on the loaded 2-core test machine), time the subscriber's thread waited
        for the lock while a page or ``watch`` read the view."""
        clone = copy.copy(self)  # every scalar field, then fresh containers
        clone.blocks = dict(self.blocks)
        clone.history = deque(self.history)
        clone._order = deque(self._order)
        clone.notes = list(self.notes)
        clone.extended = dict(self.extended)
        clone.extensions = dict(self.extensions)
        return clone


def hash_labels(hashes, min_len: int = 12) -> dict[str, str]:
    """How to print each of ``hashes`` (hex strings, ``kv_events.hash_key``) so that distinct hashes read
    distinctly: a 16-digit one (vLLM's default int hash, 64 bits) in full, since a prefix of a small int
    is all zeros (hashes 1 and 2 both read "000000000000"); a longer one (a bytes hash's hex) by its first
    ``min_len`` digits, or as many more as it takes to differ from every other hash given. Returns
    {hash: label}."""
    ordered = sorted(set(hashes))
    labels: dict[str, str] = {}
    for i, h in enumerate(ordered):
        if len(h) <= 16:
            labels[h] = h
            continue
        need = min_len
        for j in (i - 1, i + 1):  # in sorted order the longest common prefix is with a neighbour
            if 0 <= j < len(ordered):
                other = ordered[j]
                same = next((k for k, (a, b) in enumerate(zip(h, other)) if a != b), min(len(h), len(other)))
                need = max(need, same + 1)
        labels[h] = h[:need]
    return labels


def by_content(batches: list[list[dict]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Each batch of decoded events as ``[(what, prefix tokens)]``, what = "stored" | "removed" |
    "cleared", one entry per block: the content key that lets two publishers with different hash
    functions (vLLM's and the lab's) be compared batch by batch. Read from a mirror that follows the
    batches, so a removed block is named by the prefix it ended while it was cached."""
    mirror = PrefixCacheMirror()
    out = []
    for seq, events in enumerate(batches):
        described: list[tuple[str, tuple[int, ...]]] = []
        for e in events:
            if e["type"] == "BlockStored":
                prefix = mirror.prefix_tokens(e["parent_block_hash"]) if e["parent_block_hash"] else []
                size = e["block_size"]
                for i in range(len(e["block_hashes"])):
                    prefix = prefix + list(e["token_ids"][i * size:(i + 1) * size])
                    described.append(("stored", tuple(prefix)))
            elif e["type"] == "BlockRemoved":
                described += [("removed", tuple(mirror.prefix_tokens(h))) for h in e["block_hashes"]]
            else:
                described.append(("cleared", ()))
        mirror.apply(seq, 0.0, events)
        out.append(described)
    return out
