"""Lesson 4's practice stages frame the blocks each operation touched (``lessons.l4_sharing.touched_blocks``):
deliberately not ``engine.records.changed_blocks`` (the stages' definition, which leaves plain appends out),
because a practice stage is one operation and a plain append's block is then the one thing that changed
(issue 24's review asked whether the lesson's own definition was a copy: it is a different number, named so)."""

from __future__ import annotations

from engine.records import changed_blocks
from lessons.l4_sharing import MAIN, V1, V2, V3, practice, touched_blocks


def test_b_writing_in_place_frames_the_block_it_wrote_into():
    """MAIN's stage 3 (the reveal of whether B copies): A has copied block 1 away, so B writes its token in
    place into block 1: that block is framed (``changed_blocks`` of the same events frames nothing)."""
    stage = practice(*MAIN)[3]
    assert stage.label == "B writes one token" and [str(e.kind) for e in stage.events] == ["append"]
    assert stage.tables["B"][-1] == 1 and stage.counts[1] == 1  # B alone on block 1 now
    assert touched_blocks(stage) == [1]
    assert changed_blocks(stage.events) == []


def test_the_framed_blocks_are_the_changed_ones_plus_a_plain_appends_block():
    seen_append = 0
    for ops in (MAIN, V1, V2, V3):
        for stage in practice(*ops):
            appended = {b for e in stage.events if e.kind == "append" for b in e.blocks}
            seen_append += bool(appended)
            assert touched_blocks(stage) == sorted(set(changed_blocks(stage.events)) | appended), stage.label
    assert seen_append == 3  # MAIN's, V2's and V3's in-place writes
