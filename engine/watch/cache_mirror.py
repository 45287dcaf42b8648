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

KV cache groups (a hybrid model: vLLM V1's hybrid KV cache manager, sliding-window and full-attention layers
in groups that share one pool): vLLM 0.32's events carry ``group_idx`` (and, on BlockStored, the group's
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``); vLLM's ``BlockStored`` docstring says a consumer
keys blocks by (hash, group). A hash is the request's whatever the group, so two groups store the same hashes
for the same content: ``blocks`` keeps one entry per hash, and ``CachedBlock.groups`` the group of each
copy (parallel to ``media``); ``group_blocks()`` counts physical blocks per group, ``group_specs`` holds each
group's (kind, window) as its events said. An event without ``group_idx`` (vLLM before 0.32, SGLang) is
group 0, so a single-group server reads exactly as before.

A group whose kind may skip blocks (a sliding window: ``kv_events.WHOLE_RANGE_KINDS`` lists the kinds that do
not) sends fewer hashes than the blocks of tokens it carries, possibly none, with the parent of the range's
first block; it does not say which blocks its hashes are. vLLM sends it *before* the full group's event for
the same range (the groups in order), so reading its hashes as the range's first blocks gives them the wrong
tokens and parent. A hash's content is therefore taken from the view (the hash already cached in a group) or
from a whole-range BlockStored of the same batch that carries it (``apply`` reads the batch's whole-range
events first); only a hash found in neither (a uniform sliding-window model: no full group says it) is
taken as one of the range's last blocks, counted in ``inferred_blocks`` and noted once.

Units: blocks are physical KV blocks of ``block_size`` tokens; ``num_tokens`` = sum over distinct hashes of
block_size x copies (what the pool holds, vLLM's accounting); batches are numbered by the publisher's
sequence number (``seq``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from dataclasses import dataclass, field

from ..kv_events import WHOLE_RANGE_KINDS
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
    groups: tuple = ()       # the KV cache group of each copy (``group_idx``; () : every copy in group 0)

    def tier_counts(self) -> dict:
        """medium -> copies held there (a block without ``media``: all its copies in ``medium``)."""
        out: dict = {}
        for m in self.media or (self.medium,) * self.copies:
            out[m] = out.get(m, 0) + 1
        return out

    def copy_groups(self) -> tuple:
        """The KV cache group of each copy, one entry per copy."""
        return self.groups or (0,) * self.copies


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
    # KV cache groups (see the module docstring): group -> {"kind": spec kind or None, "sliding_window": tokens
    # or None}, as its BlockStored events said; group -> physical blocks held in it
    group_specs: dict = field(default_factory=dict)
    _group_blocks: dict = field(default_factory=dict)
    inferred_blocks: int = 0  # a masked BlockStored's hashes whose content no event said: taken as the range's tail

    # --- applying events ---------------------------------------------------------------------------------

    def apply(self, seq: int, ts: float, events: list[dict], replayed: bool = False) -> BatchSummary:
        """Apply one decoded batch (``kv_events.DecodedBatch.events``) in order; returns its summary.
        Never raises on content: what cannot be applied is counted in ``notes``."""
        stored = removed = 0
        cleared = False
        ages: list[float] = []
        hot = 0
        content = _batch_content(events)  # hash -> (parent, tokens) from the batch's whole-range stores
        for e in events:
            kind = e["type"]
            if kind == "BlockStored":
                stored += self._store(seq, ts, e, content)
            elif kind == "BlockRemoved":
                n, h = self._remove(e["block_hashes"], seq, ts, ages, e.get("medium"), e.get("group_idx") or 0)
                removed += n
                hot += h
            elif kind == "AllBlocksCleared":
                removed += self._num_blocks
                self.blocks.clear()
                self.extended.clear()
                self.extensions.clear()
                self._order.clear()
                self._group_blocks.clear()
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

    def _store(self, seq: int, ts: float, e: dict, content: dict | None = None) -> int:
        size = e["block_size"]
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            self.note(f"batch {seq}: BlockStored with block_size {size}, earlier blocks had {self.block_size}")
        group = e.get("group_idx") or 0
        if e.get("kv_cache_spec_kind") is not None or group not in self.group_specs:
            self.group_specs[group] = {"kind": e.get("kv_cache_spec_kind"),
                                       "sliding_window": e.get("kv_cache_spec_sliding_window")}
        parent = e.get("parent_block_hash")
        tokens, hashes = e["token_ids"], e["block_hashes"]
        whole = len(tokens) == size * len(hashes)  # one block of tokens per hash, in order
        if whole:  # a masked store's range is the full group's too: counted once, from that one
            if parent is not None and parent not in self.blocks:
                self.orphan_stores += 1  # its parent was stored before we joined, or already evicted
            elif parent is not None:  # a request went on past a cached block: see HOT_MIN_EXTENSIONS
                self.extended[parent] = (self.extended.get(parent, ()) + (ts,))[-16:]
                self.extensions[parent] = self.extensions.get(parent, 0) + 1
        first_tail = len(tokens) // size - len(hashes)  # a masked hash no event explains: the range's tail
        for i, h in enumerate(hashes):
            block = self.blocks.get(h)
            if block is None:
                if whole:
                    block_parent, block_tokens = parent, tokens[i * size:(i + 1) * size]
                elif content and h in content:
                    block_parent, block_tokens = content[h]
                else:
                    j = first_tail + i
                    block_parent = (hashes[i - 1] if i else (parent if j == 0 else None))
                    block_tokens = tokens[j * size:(j + 1) * size]
                    self.inferred_blocks += 1
                    if self.inferred_blocks == 1:
                        self.note(f"batch {seq}: group {group}'s BlockStored has {len(hashes)} hashes for "
                                  f"{len(tokens) // size} blocks of tokens and no whole-range event says which "
                                  f"blocks they are: they are taken as the range's last blocks (their parent "
                                  f"unknown unless given)")
                while self.blocks and (len(self.blocks) >= self.max_blocks
                                       or self._kept_tokens + size > self.max_token_ids):
                    self._drop_oldest(seq)
                self._kept_tokens += size
                self.blocks[h] = CachedBlock(hash=h, parent=block_parent, token_ids=list(block_tokens),
                                             block_size=size, medium=e.get("medium"), copies=1, stored_seq=seq,
                                             stored_ts=ts, media=(e.get("medium"),), groups=(group,))
                self._order.append(h)
                if len(self._order) > 2 * len(self.blocks) + 1024:  # removed hashes pile up: rebuild (dict order)
                    self._order = deque(self.blocks)
            else:  # a new object, never changed in place: copies of the mirror share blocks (``copy``)
                self.blocks[h] = dataclasses.replace(block, copies=block.copies + 1,
                                                     media=(block.media or (block.medium,)) + (e.get("medium"),),
                                                     groups=block.copy_groups() + (group,))
            parent = h  # a BlockStored chains its blocks: each one's parent is the previous
        self._num_blocks += len(hashes)
        if hashes:
            self._group_blocks[group] = self._group_blocks.get(group, 0) + len(hashes)
        return len(hashes)

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
        for g in gone.copy_groups():
            self._group_blocks[g] -= 1
        self._kept_tokens -= len(gone.token_ids)
        self.capped_out += 1
        if self.capped_out == 1:
            self.note(f"batch {seq}: the view holds at most {self.max_blocks:,} distinct blocks and "
                      f"{self.max_token_ids:,} token ids (its memory cap); "
                      f"from here on the oldest-stored blocks are dropped from the view to make room, so it "
                      f"shows fewer blocks than the server holds, and removals of dropped blocks count as "
                      f"unknown")

    def _remove(self, hashes: list[str], seq: int = 0, ts: float = 0.0, ages: list | None = None,
                medium: str | None = None, group: int = 0) -> tuple[int, int]:
        """Remove one copy of each hash from KV cache group ``group`` (the copy in ``medium``, the removal's
        tier, when one is there); returns (blocks removed, hot prefixes that left the view). ``ages`` gets each
        removed block's age (seconds cached, the server's clock). A hash the group does not hold is an
        unknown removal (its other groups' copies stay)."""
        done = hot = 0
        for h in hashes:
            block = self.blocks.get(h)
            if block is None or group not in block.copy_groups():
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
                groups = list(block.copy_groups())
                mine = [k for k, g in enumerate(groups) if g == group]
                k = next((k for k in reversed(mine) if media[k] == medium), mine[-1])
                del media[k], groups[k]
                self.blocks[h] = dataclasses.replace(block, copies=block.copies - 1, media=tuple(media),
                                                     medium=media[0], groups=tuple(groups))
            self._num_blocks -= 1
            self._group_blocks[group] -= 1
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
        self._group_blocks.clear()
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

    @property
    def hybrid(self) -> bool:
        """True when the events named more than one KV cache group, or a group whose kind may skip blocks (a
        sliding window): then counts are shown per group and the router uses every group's hit rule."""
        return len(self.group_specs) > 1 or any(
            s["kind"] is not None and s["kind"] not in WHOLE_RANGE_KINDS for s in self.group_specs.values())

    def group_blocks(self) -> dict[int, int]:
        """KV cache group -> physical blocks it holds with a hash (copies counted), every group whose events
        were seen (0 included), in group order. Sums to ``num_blocks``."""
        return {g: self._group_blocks.get(g, 0) for g in sorted(set(self.group_specs) | set(self._group_blocks))}

    def group_label(self, group: int) -> str:
        """``group 0 (sliding window, 48 tokens)`` / ``group 1 (full attention)``: a group as its events named
        it."""
        spec = self.group_specs.get(group) or {}
        kind = spec.get("kind")
        if kind is None:
            return f"group {group}"
        words = kind.replace("_", " ")
        if spec.get("sliding_window"):
            words += f", {spec['sliding_window']:,} tokens"
        return f"group {group} ({words})"

    def group_hashes(self, group: int) -> set[str]:
        """The hashes KV cache group ``group`` holds (at least one copy)."""
        return {h for h, b in self.blocks.items() if group in b.copy_groups()}

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
        clone.group_specs = dict(self.group_specs)  # its values are replaced, never changed in place
        clone._group_blocks = dict(self._group_blocks)
        return clone


def _batch_content(events: list[dict]) -> dict[str, tuple[str | None, list[int]]]:
    """hash -> (its parent, its tokens) from the batch's BlockStored events that carry one block of tokens
    per hash (a full group's), so a sliding group's masked event sent first in the batch learns its hashes'
    blocks (module docstring)."""
    out: dict = {}
    for e in events:
        if e["type"] != "BlockStored":
            continue
        size, tokens, hashes = e["block_size"], e["token_ids"], e["block_hashes"]
        if len(tokens) != size * len(hashes):
            continue
        parent = e.get("parent_block_hash")
        for i, h in enumerate(hashes):
            out.setdefault(h, (parent, tokens[i * size:(i + 1) * size]))
            parent = h
    return out


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
    "cleared", one entry per block (per hash a group stored or removed: a hybrid server's blocks once per
    group): the content key that lets two publishers with different hash functions (vLLM's and the lab's) be
    compared batch by batch. Read from a mirror that follows the events one by one, so a stored block is
    named by the prefix its hash ends (a sliding group's masked store included: its hashes' blocks are
    learned as ``PrefixCacheMirror.apply`` learns them) and a removed block by the prefix it ended while it
    was cached."""
    mirror = PrefixCacheMirror()
    out = []
    for seq, events in enumerate(batches):
        described: list[tuple[str, tuple[int, ...]]] = []
        content = _batch_content(events)
        for e in events:
            if e["type"] == "BlockStored":
                mirror._store(seq, 0.0, e, content)
                described += [("stored", _prefix_known(mirror, content, h)) for h in e["block_hashes"]]
            elif e["type"] == "BlockRemoved":
                described += [("removed", tuple(mirror.prefix_tokens(h))) for h in e["block_hashes"]]
                mirror._remove(e["block_hashes"], seq, 0.0, None, e.get("medium"), e.get("group_idx") or 0)
            else:
                described.append(("cleared", ()))
                mirror.apply(seq, 0.0, [e])
        out.append(described)
    return out


def _prefix_known(mirror: PrefixCacheMirror, content: dict, h: str) -> tuple[int, ...]:
    """The tokens from the root of ``h``'s chain through ``h``, each block read from the mirror or, not yet
    there (a parent the batch's full group stores after a sliding group's event), from the batch's content."""
    chain: list[list[int]] = []
    seen = set()
    while h is not None and h not in seen:
        seen.add(h)
        if h in mirror.blocks:
            block = mirror.blocks[h]
            parent, tokens = block.parent, block.token_ids
        elif h in content:
            parent, tokens = content[h]
        else:
            break
        chain.append(list(tokens))
        h = parent
    return tuple(t for part in reversed(chain) for t in part)
