"""The allocator protocol: what the scheduler and the engine ask of a KV allocator, whichever it is.

``BlockManager`` (paging: blocks taken as tokens arrive, shared, copied on write, swapped; built from
``BlockPool``, ``KVCacheManager`` and ``SwapSpace``) and
``ContiguousAllocator`` (the baseline: one reserved row per sequence in a flat region) both implement it;
the engine and the scheduler only ever call these methods, never ask which allocator they hold.
Units: ``block_size`` is 1 for the contiguous allocator, whose "blocks" are slots.

``reservation`` (what ``reservation_for`` returns and ``Request.reservation`` holds; slots): None on the
paged allocator (blocks come as tokens arrive), an int for a request of one sequence, or a tuple of ints,
one row per sample (``n``) or beam (``beam_width``), all reserved at the request's admission
(``engine.contiguous``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .records import EventLog


@runtime_checkable
class KVAllocator(Protocol):
    block_size: int
    num_swap_blocks: int
    max_seqs_per_request: int | None  # None: any number of samples / beams
    peak_used_blocks: int
    log: EventLog

    @property
    def num_free_blocks(self) -> int: ...

    def reservation_for(self, prompt_len: int, max_len: int, final_len: int | None = None) -> int | None:
        """Slots a request reserves at admission (None: none ahead, blocks come as tokens arrive)."""

    def admission_refusal(self, token_lists: list[list[int]], reservation: int | tuple[int, ...] | None = None
                          ) -> str | None:
        """Why sequences with these tokens cannot be allocated now (None if they can)."""

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks of the longest cached prefix (empty without a prefix cache)."""

    def allocate_with_prefix(self, seq_id: str, num_tokens: int, token_ids: list[int] | None = None,
                             reservation: int | tuple[int, ...] | None = None, preempted: bool = False
                             ) -> tuple[list[int], int]:
        """Room for a new sequence's first tokens; returns (table, tokens already cached)."""

    def append_blocks_needed(self, seq_ids: list[str]) -> int:
        """Free blocks one more token for each of these sequences takes."""

    def append_slot(self, seq_id: str, token_id: int | None = None) -> int:
        """The slot of ``seq_id``'s next token."""

    def fork(self, parent_id: str, child_id: str) -> list[int]:
        """``child_id`` continues ``parent_id``: shares its blocks (paged), or gets a row of its own holding a
        copy of the parent's slots (contiguous). Returns the blocks shared."""

    def free(self, seq_id: str, final_len: int | None = None) -> list[int]:
        """Release ``seq_id``'s memory; returns the blocks that became free."""

    def can_swap_out(self, seq_ids: list[str]) -> bool: ...

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Slots of tokens ``start .. end-1``."""

    def attention_view(self, seq_id: str) -> tuple[list[int], int]:
        """(block table, first slot of a contiguous range) for attention."""

    def group_views(self, seq_id: str, start: int, end: int) -> tuple[tuple[list[int], ...], tuple[list[int], ...]]:
        """(block table, slot mapping of tokens ``start .. end-1``) of each KV cache group, in group order."""

    def table_of(self, seq_id: str) -> tuple[list[int], int] | None:
        """(table, tokens held), or None if ``seq_id`` holds nothing."""

    def snapshot_fields(self) -> dict:
        """The allocator's fields of a ``records.Snapshot``."""

    def snapshot_taken(self, snapshot) -> None:
        """The snapshot built from the last ``snapshot_fields`` (the paged allocator records the next one
        relative to it)."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while blocks are in use."""

    def drain_ops(self) -> list[tuple[str, int, int]]:
        """Data movement queued for the KV tensors: ("copy" | "swap_out" | "swap_in", src, dst)."""

    def drain_kv_events(self) -> list[dict]:
        """KV cache events in vLLM's schema since the last drain (one step's batch), in order."""
