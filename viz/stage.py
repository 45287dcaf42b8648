"""The stage: what one recorded step shows, assembled once for the Playground, the presenter view and the
exports (pure: plotly only, no Streamlit, no torch).

``stage_step(record, contiguous, previous, order=..., phase=...)`` reads a step once: the moment shown (a
beam-search step has two, ``viz.block_table.selection_phases``: the copies, then the beam selection; ``phase``
picks one, None the step as recorded), that moment's snapshot and events, the blocks it changed
(``engine.records.changed_blocks``) and the words. The ``StageStep`` it returns draws every view of the step
from that one reading:

- ``pool_figure``: the paged block pool (``viz.pool.block_pool_figure``), the changed blocks outlined;
- ``slots_figure``: the same memory slot by slot (``viz.region.paged_slots_figure``);
- ``tables_figure``: the block-table picture (``viz.block_table.block_table_figure``), outlining the blocks
  the tables took anew (``engine.records.blocks_new_in_tables``);
- ``region_figure``: the contiguous baseline's strip (``viz.region.contiguous_region_figure``), with the
  final lengths known in advance when given;
- ``sentences``: the step in words (``viz.steps.step_sentences``);
- ``hybrid_line``: a hybrid model's KV cache groups and the memory its sliding windows save against its
  all-full-attention twin (``engine.metrics.hybrid_saving``), or None for a model of one group.

Each page chooses only the look: the Playground its titles, the highlighted request, the slot view and the
token pick; the presenter view the projector's type and sizes (``viz.presenter``); the exports the plain
figures stacked into frames (``viz.export``). So a step's pool, tables and strip show the same moment and
outline the same blocks on every stage (tests/test_stage_assembly.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import plotly.graph_objects as go

from engine.metrics import hybrid_saving
from engine.records import changed_blocks

from .block_table import block_table_figure
from .pool import block_pool_figure
from .block_table import group_label
from .presenter import phase_moment
from .region import contiguous_region_figure, paged_slots_figure
from .steps import SEMANTICS_SHORT, step_label, step_sentences

# The pool's title, a ``str.format`` template: ``used`` / ``blocks`` (of the moment shown), ``label`` (" (1/2
# the copies)" on a beam step's phase, else ""), ``step``, ``semantics`` (short), ``kind`` (``step_label``).
POOL_TITLE = "Paged block pool: {used}/{blocks} blocks in use"


@dataclass(frozen=True)
class StageStep:
    """One recorded step as the stage shows it (``stage_step``): the records, and the moment shown.

    ``record`` / ``contiguous``: the paged engine's StepRecord and the baseline's of the same step (or None);
    ``previous``: the paged record before (a beam step's pruned beams' tokens; may be None); ``order``: request
    ids in first-seen order (each request's colour); ``decode``: token ids -> text for the hovers (or None);
    ``budget``: vLLM V1's token budget per step (None: the paper's semantics); ``final_lengths``: the
    baseline's sequences' final lengths known in advance (tokens, by sequence id; or None); ``phase``: the beam
    step's moment shown (0 the copies, 1 the selection), None for the step as recorded. ``snapshot`` /
    ``events`` / ``label``: that moment's (``viz.presenter.phase_moment``; ``label`` "" outside a beam step's
    phases); ``changed``: the physical blocks it changed (``engine.records.changed_blocks`` of its events)."""

    record: object
    contiguous: object | None
    previous: object | None
    order: tuple[str, ...]
    decode: Callable[[list[int]], str] | None
    budget: int | None
    final_lengths: dict | None
    phase: int | None
    snapshot: object
    events: list
    label: str
    changed: tuple[int, ...]

    @property
    def moment(self) -> dict:
        """The moment shown as ``viz.presenter.phase_moment`` gives it: ``snapshot``, ``events``, ``label``
        (what the numbers beside the pictures read)."""
        return {"snapshot": self.snapshot, "events": self.events, "label": self.label}

    def at(self, snapshot, events, label: str = "") -> "StageStep":
        """The same step at another moment (``viz.presenter.phased`` draws each phase of a beam step)."""
        return replace(self, snapshot=snapshot, events=list(events), label=label,
                       changed=tuple(changed_blocks(events)))

    def pool_figure(self, title: str = POOL_TITLE, selected: str | None = None,
                    slot_mode: bool = False) -> go.Figure:
        """The paged pool of the moment shown, its changed blocks outlined; ``title`` a ``POOL_TITLE``-like
        template; ``selected`` a request whose blocks are outlined too; ``slot_mode`` a cell per slot."""
        s = self.snapshot
        text = title.format(used=s.num_blocks - s.num_free_blocks, blocks=s.num_blocks,
                            label=f" ({self.label})" if self.label else "", step=self.record.step,
                            semantics=SEMANTICS_SHORT[self.record.semantics], kind=step_label(self.record))
        return block_pool_figure(s, list(self.order), decode=self.decode, highlight=list(self.changed),
                                 selected=selected, slot_mode=slot_mode, title=text)

    def slots_figure(self) -> go.Figure:
        """The paged memory of the moment shown, slot by slot."""
        return paged_slots_figure(self.snapshot, list(self.order))

    def tables_figure(self, title: str | None = None, token: tuple[str, int] | None = None, **style) -> go.Figure:
        """The block-table picture of the moment shown (default title "Block tables after step N: logical ->
        physical"). ``token``: a (sequence id, position) pick, dropped when that sequence holds no table at
        this moment; ``style``: ``block_table_figure``'s look (selected, compact, font_px, height_px,
        width_px, captions, max_rows, max_blocks)."""
        s = self.snapshot
        if token and not any(q.seq_id == token[0] and q.block_table for q in s.sequences):
            token = None
        step = self.record.step
        title = title or f"Block tables{f' after step {step}' if step else ''}: logical -> physical"
        return block_table_figure(s, list(self.order), events=self.events, decode=self.decode, token=token,
                                  title=title, **style)

    def hybrid_line(self, bytes_per_block: int | None = None) -> str | None:
        """The KV cache groups of the moment shown and what their windows save (``hybrid_line``)."""
        return hybrid_line(self.snapshot, bytes_per_block)

    def region_figure(self) -> go.Figure | None:
        """The contiguous baseline's strip of this step, or None without a baseline."""
        if self.contiguous is None:
            return None
        return contiguous_region_figure(self.contiguous.snapshot.contiguous, list(self.order), self.final_lengths)

    def sentences(self, of_moment: bool = False, **options) -> list[str]:
        """The step in words (``viz.steps.step_sentences``, ``options`` its keyword arguments).

        ``of_moment`` (the presenter's words): a beam step's sentences of the moment shown. In a phase
        (``label`` set), 0 the copies says the copies and writes, not yet the beam selection (the next press
        shows it); 1 the selection says it first. A beam step as recorded (``phase`` None) says its selection
        second, after the key sentence (the order the picture's two phases come in)."""
        said = step_sentences(self.record, self.contiguous, self.budget, **options)
        beam = next((i for i, x in enumerate(said) if x.startswith("beam selection")), None) if of_moment else None
        if beam is not None and self.label:  # the sentences of the moment the pictures show
            selection = said.pop(beam)
            if self.phase >= 1:
                said.insert(0, selection)
        elif beam:
            said.insert(1, said.pop(beam))
        return said


def stage_step(record, contiguous=None, previous=None, *, order, decode: Callable | None = None,
               budget: int | None = None, final_lengths: dict | None = None, phase: int | None = None) -> StageStep:
    """Read recorded step ``record`` (the paged engine's StepRecord) for the stage: see ``StageStep``.

    ``phase``: a beam step's moment (``viz.presenter.phase_moment``: 0 the copies, 1 after the selection; a
    step without phases has only 0); None: the step as recorded (its snapshot, all its events). Raises
    ValueError naming ``phase`` when the step has no such phase."""
    if phase is None:
        snapshot, events, label = record.snapshot, list(record.events), ""
    else:
        moment = phase_moment(record, previous, phase)
        snapshot, events, label = moment["snapshot"], list(moment["events"]), moment["label"]
    return StageStep(record, contiguous, previous, tuple(order), decode, budget, final_lengths, phase, snapshot,
                     events, label, tuple(changed_blocks(events)))


def hybrid_line(snapshot, bytes_per_block: int | None = None) -> str | None:
    """One line for a hybrid model's snapshot (None without KV cache groups): its groups, then what the
    sliding windows gave back against the all-full-attention twin (``engine.metrics.hybrid_saving``: blocks,
    and bytes with ``bytes_per_block``; a pool count, a shared prefix once; with several sequences, each
    one's own count beside it, said to differ where they share a block), e.g. "KV cache groups: window 48 (layers 0, 2), full (layers 1,
    3), one pool. The windows gave back 1 block (24,576 bytes): 8 blocks held where every layer full would
    hold 9 (blocks of 24,576 bytes, one KV cache group's layers each: ...)." (``block_unit``)"""
    saving = hybrid_saving(snapshot, bytes_per_block)
    if saving is None:
        return None
    groups = ", ".join(f"{group_label(d)} (layers {', '.join(map(str, d['layers']))})"
                       for d in snapshot.kv_cache_groups)
    n = saving["blocks"]
    size = f" ({saving['bytes']:,} bytes)" if saving["bytes"] is not None else ""
    who = ", ".join(f"{k}: {v}" for k, v in saving["by_sequence"].items() if v)
    if who and sum(saving["by_sequence"].values()) != n:  # a shared prefix left the window: the pool gains it once
        who = f" (per request {who}; a block they share is given back once in the pool)"
    elif who:
        who = f" ({who})"
    return (f"KV cache groups: {groups}, one pool. The sliding windows gave back {n} block{'s' * (n != 1)}{size}"
            + (who if len(saving["by_sequence"]) > 1 else "")
            + f": {saving['held']} blocks held where every layer full would hold {saving['twin']}"
            + block_unit(saving, bytes_per_block) + ".")


def block_unit(saving: dict, bytes_per_block: int | None) -> str:
    """The unit of ``hybrid_saving``'s block counts, with the bytes: a hybrid pool's block holds one KV cache
    group's layers, so "10 with every layer full" counts in those blocks (vLLM would run the all-full twin as one
    group of blocks holding every layer: fewer blocks, the same bytes). "" without ``bytes_per_block``."""
    if bytes_per_block is None:
        return ""
    return (f" (blocks of {bytes_per_block:,} bytes, one KV cache group's layers each: {saving['held'] * bytes_per_block:,}"
            f" bytes held, {saving['twin'] * bytes_per_block:,} with every layer full)")


def hybrid_short(snapshot, bytes_per_block: int | None = None) -> str | None:
    """``hybrid_line`` in a few words, for the presenter's numbers: "windows gave back 1 block (24,576 bytes):
    7 held, 8 with every layer full (blocks of 24,576 bytes: one group's layers)"; None without KV cache
    groups."""
    saving = hybrid_saving(snapshot, bytes_per_block)
    if saving is None:
        return None
    n = saving["blocks"]
    size = f" ({saving['bytes']:,} bytes)" if saving["bytes"] is not None else ""
    unit = f" (blocks of {bytes_per_block:,} bytes: one group's layers)" if bytes_per_block is not None else ""
    return (f"windows gave back {n} block{'s' * (n != 1)}{size}: {saving['held']} held, {saving['twin']} with "
            f"every layer full{unit}")
