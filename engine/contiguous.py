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
requests (``engine.workloads.run_workload(..., final_lens=...)``).

It implements the allocator protocol (``engine.allocator.KVAllocator``), so the same scheduler and model
runner drive both allocators.
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
    max_seqs_per_request = 1  # no sharing, so one sequence per request (no n > 1, no beams)

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

    def admission_refusal(self, token_lists: list[list[int]], reservation: int | None = None) -> str | None:
        """Why a request (one sequence) reserving ``reservation`` slots (default: the "max" reservation)
        cannot be admitted now (None if it can)."""
        need = reservation or self.reservation
        if self.largest_gap >= need:
            return None
        self.door_need = need
        return f"refused: largest gap {self.largest_gap:,} < {need:,} needed, {self.free_slots:,} free in total"

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
        return [], self.regions[seq_id][0]

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """Refused: one sequence per request, nothing is shared."""
        raise ValueError("the contiguous allocator cannot fork: it serves one sequence per request")

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
        base = self.regions[seq_id][0]
        if not 0 <= start <= end <= self.num_tokens[seq_id]:
            raise ValueError(f"tokens {start}..{end - 1} are not held by sequence {seq_id!r} "
                             f"({self.num_tokens[seq_id]} tokens)")
        return list(range(base + start, base + end))

    def start_of(self, seq_id: str) -> int:
        return self.regions[seq_id][0]

    # ----------------------------------------------------------------------------------------- changes
    def allocate(self, seq_id: str, num_tokens: int, reservation: int | None = None) -> int:
        """Reserve ``reservation`` slots (default: the "max" reservation) first-fit for a new request
        holding ``num_tokens`` tokens now.

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
        self.door_need = None  # the request at the door got in; the next one is measured when refused
        self.peak_used_blocks = max(self.peak_used_blocks, self.reserved_slots)
        self.log.emit(EventKind.ALLOCATE, seq_id, [],
                      f"{seq_id}: reserves slots {fit:,}..{fit + size - 1:,} ({size:,}) for {num_tokens} tokens now",
                      start=fit, length=size, num_tokens=num_tokens, cached_tokens=0)
        return fit

    def allocate_with_prefix(self, seq_id: str, num_tokens: int, token_ids=None, reservation: int | None = None,
                             preempted: bool = False) -> tuple[list[int], int]:
        """The allocator protocol's allocation: reserve like ``allocate``; no prefix cache, nothing cached."""
        self.allocate(seq_id, num_tokens, reservation)
        return [], 0

    def append_slot(self, seq_id: str, token_id: int | None = None) -> int:
        n = self.num_tokens[seq_id]
        start, length = self.regions[seq_id]
        if n >= length:
            raise ValueError(f"sequence {seq_id!r} has used all {length} reserved slots")
        self.num_tokens[seq_id] = n + 1
        return start + n

    def free(self, seq_id: str, final_len: int | None = None) -> list[int]:
        """Release ``seq_id``'s reservation. ``final_len``: its final length (prompt + generated tokens;
        default the slots written), the measure of internal fragmentation: a request's last sampled token
        is never written (nothing computes it), but it is part of what the request needed."""
        start, length = self.regions.pop(seq_id)
        used = self.num_tokens.pop(seq_id)
        final = min(final_len if final_len is not None else used, length)
        self.finished.append((length, final))
        never = internal_fragmentation(length, final)
        self.log.emit(EventKind.FREE, seq_id, [],
                      f"{seq_id}: releases slots {start:,}..{start + length - 1:,}; its final length is {final:,} "
                      f"of {length:,} ({never:,} never needed: internal fragmentation)",
                      start=start, length=length, used=used, final_len=final)
        return []

    def drain_events(self) -> list:
        return self.log.drain()

    def snapshot_fields(self) -> dict:
        """The allocator's part of a ``records.Snapshot``: slots as the pool, the region's layout."""
        return dict(num_blocks=self.capacity, block_size=1, num_free_blocks=self.free_slots, ref_counts=[],
                    fills=[], owners=[], allocator="contiguous", contiguous=self.layout())

    def drain_ops(self) -> list:
        return []

    def drain_kv_events(self) -> list[dict]:
        """No prefix cache, so no KV cache events (``BlockManager.drain_kv_events`` has vLLM's)."""
        return []

    def layout(self) -> dict:
        """The region for viewers: each reservation (start, length, used) and the gaps, plus accounting."""
        return {
            "capacity_slots": self.capacity,
            "reservation": self.reservation,
            "policy": self.policy,
            "regions": [{"seq_id": s, "start": st, "length": ln, "used": self.num_tokens[s]}
                        for s, (st, ln) in sorted(self.regions.items(), key=lambda kv: kv[1][0])],
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
