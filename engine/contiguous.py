"""The contiguous-allocation baseline: how servers managed the KV cache before PagedAttention.

One flat KV region per layer, ``[capacity_tokens, num_kv_heads, head_dim]``, with the same byte budget as
the paged pool. At admission a request reserves ``reservation`` contiguous slots, placed first-fit (the
lowest-addressed free gap that is large enough), and keeps them until it finishes, used or not. Token ``t``
of a request whose range starts at ``start`` lives at slot ``start + t``; attention reads the range
directly, no block table.

Its three kinds of waste (Kwon et al., SOSP 2023, section 3; LESSON_BRIEF section 2):
- reserved but not yet used: slots a running request reserved for tokens it has not produced yet;
- internal fragmentation: reserved slots a finished request never used (its reply ended early);
- external fragmentation: free slots in gaps smaller than one reservation, which no new request can use
  although the free space in total would suffice.

How much a request reserves is the policy (the vLLM paper's baselines, Kwon et al., SOSP 2023, section 6,
"Orca (Max)", "Orca (Pow2)", "Orca (Oracle)"; ``reservation_for``):
- "max": every request reserves ``reservation_tokens`` (default the maximum model length);
- "max_tokens": prompt + ``max_tokens`` (capped at the maximum length), what a server knows at admission;
- "pow2": the next power of two of the request's true final length (over-reserves by up to 2x);
- "oracle": exactly the true final length (prompt + the tokens it will really generate).
"pow2" and "oracle" need the final length in advance: the caller learns it from a paged run of the same
requests (``engine.scenarios.workloads.run_workload(..., final_lens=...)``).

Several sequences per request (parallel sampling ``n``, beam search ``beam_width``): nothing is shared, so
each sequence has a row of its own, the policy's reservation, and a fork copies. This is how servers
without paging run them: Hugging Face transformers' ``generate`` expands the batch to ``batch x n`` (or
``batch x num_beams``) rows before the prompt's prefill (``_expand_inputs_for_generation``) and reorders
whole rows of its KV cache every beam step (``Cache.reorder_cache``: ``index_select`` on the beam axis);
FasterTransformer keeps ``[batch x beam, max_seq_len]`` caches and copies rows the same way. Here:
- admission reserves every row at once (all or nothing, each row placed first-fit): a request whose rows do
  not all fit now waits at the door with the reason, as a single-sequence request does (Orca and vLLM V0
  admit a whole sequence group or none of it: ``BlockSpaceManager.can_allocate(seq_group)``). The first
  sequence gets the first row; the others are the request's spare rows, reserved but not yet used.
  The engine passes the rows as ``reservation`` (a tuple, one size per sequence: ``LLMEngine`` builds it).
- ``fork(parent, child)`` gives the child a spare row and queues a copy of the parent's written slots
  into it (``drain_ops``: ("copy", src slot, dst slot) pairs, which the model runner's ``KVCache.apply``
  executes before the next step computes anything, as the paged side's copy-on-write copies). For n
  samples that is n separate copies of the prompt.
- beam search: the engine forks every beam that continues a parent before it frees the beams nobody
  continues. A fork finding no spare row waits (``pending``) for the next row of its request to be freed
  in the same step: the pruned beam's row passes to it and the parent's whole row is copied in
  (transformers' reorder). A request holds its ``beam_width`` rows from admission to its end.
- a freed sequence's row returns to the region at once (its internal fragmentation is counted then),
  unless a fork of the same request is waiting for it; the spare rows a request never used are released
  with its last sequence and count as internal fragmentation whole (reserved, never used).
The contiguous allocator never preempts (every slot was reserved at admission), so a request's rows are
only ever reserved together, at its one admission.
"""

from __future__ import annotations

from .config import CONTIGUOUS_POLICIES
from .metrics import external_fragmentation, internal_fragmentation
from .records import EventKind, EventLog


class ContiguousAllocator:
    """First-fit contiguous reservations in a region of ``capacity_tokens`` slots.

    Args:
        capacity_tokens: slots in the region (tokens).
        reservation: slots a request reserves under the "max" policy (tokens), 1..capacity_tokens.
        policy: one of ``CONTIGUOUS_POLICIES`` (see the module docstring).
        max_model_len: the longest a request may be (tokens), the cap of a "pow2" reservation; default
            the region.
        event_log: where decisions are logged (the engine's); default a log of the allocator's own.

    Raises:
        ValueError: a size that is not a positive integer, a reservation larger than the region, or an
            unknown policy.
    """

    block_size = 1  # a slot is its own unit: there is no paging here
    num_swap_blocks = 0  # no swap pool: a preempted request can only be recomputed
    max_seqs_per_request = None  # n samples and beams: one row each, a fork copies (module docstring)

    def __init__(self, capacity_tokens: int, reservation: int, policy: str = "max",
                 event_log: EventLog | None = None, max_model_len: int | None = None) -> None:
        for name, value in (("capacity_tokens", capacity_tokens), ("reservation_tokens", reservation)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if reservation > capacity_tokens:
            raise ValueError(f"reservation_tokens {reservation} is larger than the region of {capacity_tokens} "
                             f"slots; no request could ever be admitted")
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"contiguous_policy must be one of {CONTIGUOUS_POLICIES}, got {policy!r}")
        self.capacity = capacity_tokens
        self.reservation = reservation
        self.policy = policy
        self.max_model_len = min(max_model_len or capacity_tokens, capacity_tokens)
        # what the request waiting at the door needs (slots), set when it is refused, cleared on admission:
        # external fragmentation is measured against it
        self.door_need: int | None = None
        self.regions: dict[str, tuple[int, int]] = {}  # seq -> (start, length)
        self.num_tokens: dict[str, int] = {}  # slots written (holding K/V)
        # several sequences per request: seq -> its group (the id of the request's first sequence), the
        # group's spare rows (reserved, no sequence yet), forks waiting for a row (child -> parent, in order)
        self.group_of: dict[str, str] = {}
        self.spares: dict[str, list[tuple[int, int]]] = {}
        self.pending: dict[str, str] = {}
        self.pending_ops: list[tuple[str, tuple[str, int, int]]] = []  # (child, ("copy", src, dst)) to run
        # (reserved slots, final length) of every released reservation, for the accounting
        self.finished: list[tuple[int, int]] = []
        self.log = event_log if event_log is not None else EventLog()
        self.peak_used_blocks = 0  # most slots reserved at any moment

    @property
    def events(self) -> list:
        """Events logged and not yet drained."""
        return self.log.events

    @property
    def internal_frag_slots(self) -> int:
        """Reserved slots released reservations never needed (``metrics.internal_fragmentation``)."""
        return sum(internal_fragmentation(r, n) for r, n in self.finished)

    def reservation_for(self, prompt_len: int, max_len: int, final_len: int | None = None) -> int:
        """Slots a request reserves under this allocator's policy (tokens).

        Args:
            prompt_len: the prompt's tokens. max_len: the most it may reach (prompt + max_tokens, capped
            at the maximum model length). final_len: its true final length, if known in advance.

        Raises:
            ValueError: "pow2" or "oracle" without ``final_len``, or a reservation larger than the region.
        """
        if self.policy == "max":
            return self.reservation
        if self.policy == "max_tokens":
            size = max_len
        elif final_len is None:
            raise ValueError(f"contiguous_policy {self.policy!r} needs each request's final length in advance "
                             f"(learn it from a paged run of the same requests)")
        elif self.policy == "oracle":
            size = final_len
        else:  # pow2: the next power of two of the true length, never past the maximum length
            size = min(1 << (final_len - 1).bit_length(), max(self.max_model_len, final_len))
        if size > self.capacity:
            raise ValueError(f"a reservation of {size:,} slots ({self.policy}) is larger than the region of "
                             f"{self.capacity:,} slots")
        return size

    # ----------------------------------------------------------------------------------------- queries
    def gaps(self) -> list[tuple[int, int]]:
        """Free gaps as (start, length), by address."""
        gaps, cursor = [], 0
        for start, length in sorted(self._occupied()):
            if start > cursor:
                gaps.append((cursor, start - cursor))
            cursor = start + length
        if cursor < self.capacity:
            gaps.append((cursor, self.capacity - cursor))
        return gaps

    def _occupied(self) -> list[tuple[int, int]]:
        """Every reserved row as (start, length): the sequences' and the spare ones."""
        return list(self.regions.values()) + [row for rows in self.spares.values() for row in rows]

    @property
    def spare_slots(self) -> int:
        """Slots of spare rows: reserved for a request's samples or beams not forked yet (slots)."""
        return sum(length for rows in self.spares.values() for _, length in rows)

    @property
    def free_slots(self) -> int:
        return self.capacity - self.reserved_slots

    @property
    def largest_gap(self) -> int:
        return max((length for _, length in self.gaps()), default=0)

    @property
    def used_slots(self) -> int:
        return sum(self.num_tokens.values())

    @property
    def reserved_slots(self) -> int:
        """Slots of every live reservation: the sequences' rows and the spare rows."""
        return sum(length for _, length in self._occupied())

    def external_frag(self, need: int | None = None) -> int:
        """Free slots in gaps smaller than ``need`` slots, counted only when the free slots together would
        hold ``need``: then the gaps, not a lack of memory, keep a request out. (A region with fewer free
        slots than ``need`` in total is simply full.) Default ``need``: what the request waiting at the door
        needs, or, with nobody waiting, one "max" reservation under the "max" policy (every request reserves
        that) and nothing under the others (no request is kept out, and the next one's size is unknown)."""
        if need is not None and (isinstance(need, bool) or not isinstance(need, int) or need <= 0):
            raise ValueError(f"need must be a positive integer, got {need!r}")
        need = need or self.default_need
        if need is None:
            return 0
        return external_fragmentation([length for _, length in self.gaps()], self.free_slots, need)

    @property
    def default_need(self) -> int | None:
        """The reservation external fragmentation is measured against: the request waiting at the door's,
        or with nobody waiting the "max" reservation under "max" (None under the others)."""
        return self.door_need or (self.reservation if self.policy == "max" else None)

    @property
    def external_frag_slots(self) -> int:
        """``external_frag()`` with its default need (``metrics.external_fragmentation``)."""
        return self.external_frag()

    def rows_for(self, token_lists: list[list[int]], reservation: int | tuple[int, ...] | None = None) -> list[int]:
        """The rows (slots each) a request reserves at admission: ``reservation`` as a tuple (one size per
        sequence, what ``LLMEngine`` passes for n samples or beams), or one row of ``reservation`` (default
        the "max" reservation) per sequence in ``token_lists``.

        Raises ValueError: a size that is not a positive integer."""
        if isinstance(reservation, tuple):
            rows = list(reservation)
        else:
            rows = [reservation or self.reservation] * max(1, len(token_lists))
        for size in rows:
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"reservation must be a positive integer, got {size!r}")
        return rows

    def _first_fit(self, rows: list[int]) -> list[int] | None:
        """Start slot of each row placed first-fit one after another, or None if one does not fit."""
        gaps = [list(g) for g in self.gaps()]
        starts = []
        for size in rows:
            gap = next((g for g in gaps if g[1] >= size), None)
            if gap is None:
                return None
            starts.append(gap[0])
            gap[0] += size
            gap[1] -= size
        return starts

    def admission_refusal(self, token_lists: list[list[int]], reservation: int | tuple[int, ...] | None = None
                          ) -> str | None:
        """Why a request cannot reserve its rows now (None if it can): one row of ``reservation`` slots
        (default: the "max" reservation), or with a tuple one row per size, all at once (``rows_for``).
        A refusal sets ``door_need`` (one row's size), which external fragmentation is measured against."""
        rows = self.rows_for(token_lists, reservation)
        if self._first_fit(rows) is not None:
            return None
        self.door_need = max(rows)
        if len(rows) == 1:
            return (f"refused: largest gap {self.largest_gap:,} < {rows[0]:,} needed, {self.free_slots:,} free "
                    f"in total")
        return (f"refused: {len(rows)} rows of {max(rows):,} slots (one per sample or beam, {sum(rows):,} in all) "
                f"do not all fit: largest gap {self.largest_gap:,}, {self.free_slots:,} free in total")

    def append_blocks_needed(self, seq_ids: list[str]) -> int:
        """None: every slot was reserved at admission."""
        return 0

    def can_swap_out(self, seq_ids: list[str]) -> bool:
        """Never: there is no swap pool."""
        return False

    def match_prefix(self, token_ids) -> list[int]:
        """No prefix cache: nothing is ever shared."""
        return []

    def table_of(self, seq_id: str) -> tuple[list[int], int] | None:
        """(no table, tokens held) of ``seq_id``; None if it holds no reservation."""
        return ([], self.num_tokens[seq_id]) if seq_id in self.regions else None

    def attention_view(self, seq_id: str) -> tuple[list[int], int]:
        """What attention needs to read ``seq_id``'s K/V: (no block table, the first slot of its range)."""
        self._settle()
        return [], self.regions[seq_id][0]

    def group_views(self, seq_id: str, start: int, end: int) -> tuple[tuple[list[int], ...], tuple[list[int], ...]]:
        """One group (every layer keeps the whole context): (no block table,), (its slots,)."""
        return ([],), (self.slot_mapping(seq_id, start, end),)

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Give ``child_id`` a row of its own holding a copy of ``parent_id``'s written slots: a spare row
        of the request, else (beam search) the next row a sequence of the request frees in this step
        (``pending`` until then). The copy is queued for ``drain_ops``. Returns [] (no blocks are shared).

        Raises:
            KeyError: unknown parent. ValueError: the child already holds a row or waits for one.
        """
        if parent_id not in self.regions:
            raise KeyError(parent_id)
        if child_id in self.regions or child_id in self.pending:
            raise ValueError(f"sequence {child_id!r} already holds a reservation")
        group = self.group_of[parent_id]
        self.group_of[child_id] = group
        if self.spares.get(group):
            self._place_fork(child_id, parent_id, self.spares[group].pop(0))
        else:
            self.pending[child_id] = parent_id
        return []

    def _place_fork(self, child_id: str, parent_id: str, row: tuple[int, int]) -> None:
        """``child_id`` takes ``row``; queue the copy of every slot ``parent_id`` has written into it."""
        start, length = row
        src, n = self.regions[parent_id][0], self.num_tokens[parent_id]
        if n > length:
            raise ValueError(f"{parent_id}'s {n} tokens do not fit the row of {length} slots for {child_id}")
        self.regions[child_id] = row
        self.num_tokens[child_id] = n
        self.pending_ops += [(child_id, ("copy", src + i, start + i)) for i in range(n)]
        self.peak_used_blocks = max(self.peak_used_blocks, self.reserved_slots)
        self.log.emit(EventKind.FORK, child_id, [],
                      f"{child_id} forked from {parent_id}: copied {parent_id}'s {n:,} written slots "
                      f"({src:,}..{src + n - 1:,}) into its own reservation at {start:,}..{start + length - 1:,} "
                      f"(nothing is shared without paging)", parent=parent_id, start=start, length=length, copied=n)

    def _settle(self) -> None:
        """Forks still waiting once the step's frees are done take a row first-fit from the free space
        (the engine's beam search frees as many rows as it forks, so none is left in practice).

        Raises RuntimeError: no gap holds the row (the request cannot go on)."""
        for child, parent in list(self.pending.items()):
            size = self.regions[parent][1]
            start = self._first_fit([size])
            if start is None:
                raise RuntimeError(f"{child} (forked from {parent}) needs a row of {size:,} slots: "
                                   f"{self.admission_refusal([[0]], size)}")
            del self.pending[child]
            self._place_fork(child, parent, (start[0], size))

    def reset_prefix_cache(self) -> bool:
        """Nothing to reset: there is no prefix cache."""
        return True

    def slot(self, seq_id: str, position: int) -> int:
        start, length = self.regions[seq_id]
        if not 0 <= position < self.num_tokens[seq_id]:
            raise ValueError(f"position {position} is not held by sequence {seq_id!r}")
        return start + position

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slots of tokens ``start .. end-1``; raises ValueError outside the tokens the sequence holds."""
        self._settle()
        base = self.regions[seq_id][0]
        if not 0 <= start <= end <= self.num_tokens[seq_id]:
            raise ValueError(f"tokens {start}..{end - 1} are not held by sequence {seq_id!r} "
                             f"({self.num_tokens[seq_id]} tokens)")
        return list(range(base + start, base + end))

    def start_of(self, seq_id: str) -> int:
        return self.regions[seq_id][0]

    # ----------------------------------------------------------------------------------------- changes
    def allocate(self, seq_id: str, num_tokens: int, reservation: int | tuple[int, ...] | None = None) -> int:
        """Reserve ``reservation`` slots (default: the "max" reservation) first-fit for a new request
        holding ``num_tokens`` tokens now; with a tuple (one size per sample or beam) every row at once:
        ``seq_id`` takes the first, the others are kept as the request's spare rows for ``fork``.

        Returns the start slot of ``seq_id``'s row. Raises ValueError (bad sizes, more tokens than the
        reservation) or RuntimeError when the rows do not all fit (nothing is changed).
        """
        rows = self.rows_for([[0]], reservation)
        size = rows[0]
        if seq_id in self.regions or seq_id in self.pending:
            raise ValueError(f"sequence {seq_id!r} already holds a reservation")
        if not 1 <= num_tokens <= size:
            raise ValueError(f"{num_tokens} tokens do not fit a reservation of {size}")
        starts = self._first_fit(rows)
        if starts is None:
            raise RuntimeError(self.admission_refusal([[0] * num_tokens], reservation))
        fit = starts[0]
        self.regions[seq_id] = (fit, size)
        self.num_tokens[seq_id] = num_tokens
        self.group_of[seq_id] = seq_id
        spare = list(zip(starts[1:], rows[1:]))
        if spare:
            self.spares[seq_id] = spare
        self.door_need = None  # the request at the door got in; the next one is measured when refused
        self.peak_used_blocks = max(self.peak_used_blocks, self.reserved_slots)
        more = "".join(f", {s:,}..{s + n - 1:,}" for s, n in spare)
        also = f"; and {len(spare)} more row{'s' * (len(spare) != 1)} for its samples or beams{more}" if spare else ""
        self.log.emit(EventKind.ALLOCATE, seq_id, [],
                      f"{seq_id}: reserves slots {fit:,}..{fit + size - 1:,} ({size:,}) for {num_tokens} tokens now"
                      f"{also}", start=fit, length=size, num_tokens=num_tokens, cached_tokens=0)
        return fit

    def allocate_with_prefix(self, seq_id: str, num_tokens: int, token_ids=None, reservation: int | None = None,
                             preempted: bool = False) -> tuple[list[int], int]:
        """The allocator protocol's allocation: reserve like ``allocate``; no prefix cache, nothing cached."""
        self.allocate(seq_id, num_tokens, reservation)
        return [], 0

    def append_slot(self, seq_id: str, token_id: int | None = None) -> int:
        self._settle()
        n = self.num_tokens[seq_id]
        start, length = self.regions[seq_id]
        if n >= length:
            raise ValueError(f"sequence {seq_id!r} has used all {length} reserved slots")
        self.num_tokens[seq_id] = n + 1
        return start + n

    def free(self, seq_id: str, final_len: int | None = None) -> list[int]:
        """Release ``seq_id``'s reservation. ``final_len``: its final length (prompt + generated tokens;
        default the slots written), the measure of internal fragmentation: a request's last sampled token
        is never written (nothing computes it), but it is part of what the request needed.

        A row a fork of the same request waits for (beam search: a pruned beam's) passes to it instead of
        returning to the region; with the request's last sequence its unused spare rows are released too.
        Raises KeyError: unknown ``seq_id``."""
        group = self.group_of.pop(seq_id)
        if self.pending.pop(seq_id, None) is not None:  # a fork that never got its row
            self._release_group_if_done(group)
            return []
        self.pending_ops = [op for op in self.pending_ops if op[0] != seq_id]  # its row is never read now
        start, length = self.regions.pop(seq_id)
        used = self.num_tokens.pop(seq_id)
        final = min(final_len if final_len is not None else used, length)
        heir = next((c for c in self.pending if self.group_of[c] == group), None)
        if heir is not None:
            parent = self.pending.pop(heir)
            self.log.emit(EventKind.FREE, seq_id, [],
                          f"{seq_id}: its row {start:,}..{start + length - 1:,} passes to {heir}, forked from {parent}",
                          start=start, length=length, used=used, final_len=final)
            self._place_fork(heir, parent, (start, length))
            return []
        self.finished.append((length, final))
        never = internal_fragmentation(length, final)
        self.log.emit(EventKind.FREE, seq_id, [],
                      f"{seq_id}: releases slots {start:,}..{start + length - 1:,}; its final length is {final:,} "
                      f"of {length:,} ({never:,} never needed: internal fragmentation)",
                      start=start, length=length, used=used, final_len=final)
        self._release_group_if_done(group)
        return []

    def _release_group_if_done(self, group: str) -> None:
        """With no sequence of ``group`` left, release its spare rows: reserved, never used (internal
        fragmentation whole)."""
        if any(g == group for g in self.group_of.values()):
            return
        for start, length in self.spares.pop(group, []):
            self.finished.append((length, 0))
            self.log.emit(EventKind.FREE, group, [],
                          f"{group}'s request releases its unused spare row {start:,}..{start + length - 1:,} "
                          f"({length:,} never used: internal fragmentation)",
                          start=start, length=length, used=0, final_len=0)

    def drain_events(self) -> list:
        return self.log.drain()

    def snapshot_fields(self) -> dict:
        """The allocator's part of a ``records.Snapshot``: slots as the pool, the region's layout."""
        return dict(num_blocks=self.capacity, block_size=1, num_free_blocks=self.free_slots, ref_counts=[],
                    fills=[], owners=[], allocator="contiguous", contiguous=self.layout())

    def snapshot_taken(self, snapshot) -> None:
        """Each snapshot is whole here (the layout is small): nothing to remember."""

    def drain_ops(self) -> list[tuple[str, int, int]]:
        """The forks' copies queued since the last drain, ("copy", src slot, dst slot) each, in order:
        ``KVCache.apply`` runs them (its "blocks" are slots here) before the next step computes."""
        self._settle()
        ops, self.pending_ops = [op for _, op in self.pending_ops], []
        return ops

    def drain_kv_events(self) -> list[dict]:
        """No prefix cache, so no KV cache events (``BlockManager.drain_kv_events`` has vLLM's)."""
        return []

    def layout(self) -> dict:
        """The region for viewers: each sequence's reservation (start, length, used), each spare row (its
        request's first sequence as ``seq_id``, ``spare`` True, used 0) and the gaps, plus accounting."""
        self._settle()
        rows = [{"seq_id": s, "start": st, "length": ln, "used": self.num_tokens[s]}
                for s, (st, ln) in self.regions.items()]
        rows += [{"seq_id": g, "start": st, "length": ln, "used": 0, "spare": True}
                 for g, spare in self.spares.items() for st, ln in spare]
        return {
            "capacity_slots": self.capacity,
            "reservation": self.reservation,
            "policy": self.policy,
            "regions": sorted(rows, key=lambda r: r["start"]),
            "gaps": [{"start": s, "length": n} for s, n in self.gaps()],
            "used_slots": self.used_slots,
            "reserved_unused_slots": self.reserved_slots - self.used_slots,
            "internal_frag_slots": self.internal_frag_slots,
            "external_frag_slots": self.external_frag_slots,
            # the reservation external fragmentation was measured against (None: nobody is kept out)
            "external_frag_need": self.default_need,
            "free_slots": self.free_slots,
            "largest_gap": self.largest_gap,
        }
