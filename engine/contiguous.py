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

The class offers the interface the scheduler uses with ``BlockManager`` (allocate, append_slot, free,
slot_mapping, events, ...), so the same scheduler and model runner drive both allocators.
"""

from __future__ import annotations

from .records import Event


class ContiguousAllocator:
    """First-fit contiguous reservations in a region of ``capacity_tokens`` slots.

    Args:
        capacity_tokens: slots in the region (tokens).
        reservation: slots every request reserves at admission (tokens), 1..capacity_tokens.

    Raises:
        ValueError: a size that is not a positive integer, or a reservation larger than the region.
    """

    block_size = 1  # a slot is its own "block": there is no paging here
    block_tables: dict = {}  # none: attention reads each request's range directly

    def __init__(self, capacity_tokens: int, reservation: int) -> None:
        for name, value in (("capacity_tokens", capacity_tokens), ("reservation_tokens", reservation)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if reservation > capacity_tokens:
            raise ValueError(f"reservation_tokens {reservation} is larger than the region of {capacity_tokens} "
                             f"slots; no request could ever be admitted")
        self.capacity = capacity_tokens
        self.reservation = reservation
        self.regions: dict[str, tuple[int, int]] = {}  # seq -> (start, length)
        self.num_tokens: dict[str, int] = {}
        # cumulative: reserved slots finished requests never wrote. A request's last sampled token is never
        # written (nothing computes it), so this counts one slot more per request than the CLI's summary,
        # which measures each request at its final length (prompt + generated tokens).
        self.internal_frag_slots = 0
        self.finished_reserved_slots = 0
        self.finished_used_slots = 0
        self.events: list[Event] = []

    # ----------------------------------------------------------------------------------------- queries
    def gaps(self) -> list[tuple[int, int]]:
        """Free gaps as (start, length), by address."""
        gaps, cursor = [], 0
        for start, length in sorted(self.regions.values()):
            if start > cursor:
                gaps.append((cursor, start - cursor))
            cursor = start + length
        if cursor < self.capacity:
            gaps.append((cursor, self.capacity - cursor))
        return gaps

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
        return sum(length for _, length in self.regions.values())

    def external_frag(self, need: int | None = None) -> int:
        """Free slots in gaps smaller than ``need`` slots (default: one reservation), counted only when the
        free slots together would hold ``need``: then the gaps, not a lack of memory, keep a request out.
        (A region with fewer free slots than ``need`` in total is simply full.)"""
        if need is not None and (isinstance(need, bool) or not isinstance(need, int) or need <= 0):
            raise ValueError(f"need must be a positive integer, got {need!r}")
        need = need or self.reservation
        if self.free_slots < need:
            return 0
        return sum(length for _, length in self.gaps() if length < need)

    @property
    def external_frag_slots(self) -> int:
        """Free slots in gaps too small for one reservation."""
        return self.external_frag()

    def admission_refusal(self, token_lists: list[list[int]], reservation: int | None = None) -> str | None:
        """Why a request (one sequence) reserving ``reservation`` slots (default: the allocator's) cannot be
        admitted now (None if it can)."""
        need = reservation or self.reservation
        if self.largest_gap >= need:
            return None
        return f"refused: largest gap {self.largest_gap:,} < {need:,} needed, {self.free_slots:,} free in total"

    def needs_new_block(self, seq_id: str) -> bool:
        return False  # everything was reserved at admission

    def slot(self, seq_id: str, position: int) -> int:
        start, length = self.regions[seq_id]
        if not 0 <= position < self.num_tokens[seq_id]:
            raise ValueError(f"position {position} is not held by sequence {seq_id!r}")
        return start + position

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slots of tokens ``start .. end-1``; raises ValueError outside the tokens the sequence holds."""
        base = self.regions[seq_id][0]
        if not 0 <= start <= end <= self.num_tokens[seq_id]:
            raise ValueError(f"tokens {start}..{end - 1} are not held by sequence {seq_id!r} "
                             f"({self.num_tokens[seq_id]} tokens)")
        return list(range(base + start, base + end))

    def start_of(self, seq_id: str) -> int:
        return self.regions[seq_id][0]

    # ----------------------------------------------------------------------------------------- changes
    def allocate(self, seq_id: str, num_tokens: int, reservation: int | None = None) -> int:
        """Reserve ``reservation`` slots (default: the allocator's) first-fit for a new request holding
        ``num_tokens`` tokens now. The engine reserves the same size for every request; other sizes exist
        for lessons and tests of external fragmentation.

        Returns the start slot. Raises ValueError (bad sizes, more tokens than the reservation) or
        RuntimeError when no gap is large enough (nothing is changed).
        """
        if reservation is not None and (isinstance(reservation, bool) or not isinstance(reservation, int)
                                        or reservation <= 0):
            raise ValueError(f"reservation must be a positive integer, got {reservation!r}")
        size = reservation or self.reservation
        if seq_id in self.regions:
            raise ValueError(f"sequence {seq_id!r} already holds a reservation")
        if not 1 <= num_tokens <= size:
            raise ValueError(f"{num_tokens} tokens do not fit a reservation of {size}")
        fit = next((start for start, length in self.gaps() if length >= size), None)
        if fit is None:
            raise RuntimeError(self.admission_refusal([[0] * num_tokens], size))
        self.regions[seq_id] = (fit, size)
        self.num_tokens[seq_id] = num_tokens
        self.events.append(Event(
            "allocate", seq_id, [],
            f"{seq_id}: reserves slots {fit:,}..{fit + size - 1:,} ({size:,}) for {num_tokens} tokens now",
            {"start": fit, "length": size, "num_tokens": num_tokens},
        ))
        return fit

    def allocate_with_prefix(self, seq_id: str, num_tokens: int, token_ids=None) -> tuple[list[int], int]:
        """Scheduler interface: reserve like ``allocate``; there is no prefix cache, so nothing is cached."""
        self.allocate(seq_id, num_tokens)
        return [], 0

    def match_prefix(self, token_ids) -> list[int]:
        return []

    def append_slot(self, seq_id: str, token_id: int | None = None) -> int:
        n = self.num_tokens[seq_id]
        start, length = self.regions[seq_id]
        if n >= length:
            raise ValueError(f"sequence {seq_id!r} has used all {length} reserved slots")
        self.num_tokens[seq_id] = n + 1
        return start + n

    def free(self, seq_id: str) -> list[int]:
        start, length = self.regions.pop(seq_id)
        used = self.num_tokens.pop(seq_id)
        self.internal_frag_slots += length - used
        self.finished_reserved_slots += length
        self.finished_used_slots += used
        self.events.append(Event(
            "free", seq_id, [],
            f"{seq_id}: releases slots {start:,}..{start + length - 1:,}; it used {used:,} of {length:,} "
            f"({length - used:,} never used: internal fragmentation)",
            {"start": start, "length": length, "used": used},
        ))
        return []

    def drain_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def drain_ops(self) -> list:
        return []

    def layout(self) -> dict:
        """The region for viewers: each reservation (start, length, used) and the gaps, plus accounting."""
        return {
            "capacity_slots": self.capacity,
            "reservation": self.reservation,
            "regions": [{"seq_id": s, "start": st, "length": ln, "used": self.num_tokens[s]}
                        for s, (st, ln) in sorted(self.regions.items(), key=lambda kv: kv[1][0])],
            "gaps": [{"start": s, "length": n} for s, n in self.gaps()],
            "used_slots": self.used_slots,
            "reserved_unused_slots": self.reserved_slots - self.used_slots,
            "internal_frag_slots": self.internal_frag_slots,
            "external_frag_slots": self.external_frag_slots,
            "free_slots": self.free_slots,
            "largest_gap": self.largest_gap,
        }
