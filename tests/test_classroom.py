"""A class at once (issue 16): join codes, the class registry, tallies, expiry and bounds, the reveal read from
a real engine step, the Class page with a presenter and a student, and the load bench kept alive."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from ui.class_room_state import (CODE_ALPHABET, CODE_LENGTH, NOBODY, NONE, ClassRegistry, answer_from_record,
                                 make_question, new_code, normalize_code, tally)

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ codes
def test_codes_are_short_unambiguous_and_fresh():
    rng = random.Random(0)
    codes = [new_code(rng=rng) for _ in range(500)]
    assert all(len(c) == CODE_LENGTH and set(c) <= set(CODE_ALPHABET) for c in codes)
    assert not set("01OIL") & set(CODE_ALPHABET)  # none that a projector makes ambiguous
    taken = set(codes[:-1])
    rng = random.Random(0)  # the same draws again: every one taken but the last
    assert new_code(taken, rng) == codes[-1]


def test_typed_codes_are_normalised():
    assert normalize_code(" ab-c 2d ") == "ABC2D"


# --------------------------------------------------------------------------------------------- questions
def test_questions_offer_the_right_choices_and_refuse_bad_input():
    q = make_question("next_block", 4, ["R1", "R2"], "R2")
    assert q.choices == ("0", "1", "2", "3", NONE) and "R2" in q.text
    assert make_question("free_after", 3, ["R1"]).choices == ("0", "1", "2", "3")
    assert make_question("preempted", 3, ["R1", "R2"]).choices == ("R1", "R2", NOBODY)
    with pytest.raises(ValueError, match="'R9'"):
        make_question("next_block", 4, ["R1"], "R9")
    with pytest.raises(ValueError, match="'whatever'"):
        make_question("whatever", 4, ["R1"])
    with pytest.raises(ValueError, match="num_blocks"):
        make_question("free_after", 0, ["R1"])


def _event(kind, rid, blocks=()):
    return NS(kind=kind, request_id=rid, blocks=list(blocks))


def test_answers_read_from_a_record():
    q = make_question("next_block", 8, ["R1", "R3"], "R3")
    record = NS(events=[_event("new_block", "R1", [2]), _event("new_block", "R3.1", [5]),
                        _event("new_block", "R3", [6])], snapshot=NS(num_free_blocks=3))
    assert answer_from_record(q, record) == "5"  # R3's sample R3.1 took block 5 first
    assert answer_from_record(q, NS(events=[_event("cow", "R3", [1, 7])], snapshot=None)) == "7"  # the copy
    assert answer_from_record(q, NS(events=[_event("append", "R3", [1])], snapshot=None)) == NONE
    admitted = NS(events=[NS(kind="allocate", request_id="R3", blocks=[4, 0, 6], data={})], snapshot=None)
    before = NS(sequences=[NS(seq_id="R3", status="running", block_table=[4])])
    assert answer_from_record(q, admitted, before) == "0"  # block 4 was R3's already
    assert answer_from_record(q, admitted) == "4"
    assert answer_from_record(make_question("free_after", 8, ["R1"]), record) == "3"
    p = make_question("preempted", 8, ["R1", "R3"])
    assert answer_from_record(p, NS(events=[_event("preempt", "R3", [4]), _event("preempt", "R1")])) == "R3"
    assert answer_from_record(p, NS(events=[_event("preempt", "R1.0")])) == "R1"  # a V1 child request
    assert answer_from_record(p, record) == NOBODY
    with pytest.raises(ValueError, match="'9'"):  # the pool changed under the question
        answer_from_record(make_question("free_after", 8, ["R1"]), NS(events=[], snapshot=NS(num_free_blocks=9)))


# ---------------------------------------------------------------------------------------------- registry
def test_one_prediction_per_student_changeable_until_the_reveal():
    reg = ClassRegistry()
    code = reg.open_class(now=0)
    with pytest.raises(ValueError, match="no question"):
        reg.submit(code, "s1", "1", now=1)
    q = make_question("free_after", 4, ["R1"])
    number = reg.ask(code, q, now=1)
    reg.submit(code, "s1", "1", number, now=2)
    reg.submit(code, "s2", "3", number, now=2)
    reg.submit(code, "s1", "3", number, now=3)  # changed: still one prediction
    view = reg.view(code.lower(), student="s1", now=4)  # a code typed in lower case works
    assert view.counts == {"3": 2} and view.answered == 2 and view.mine == "3" and not view.revealed
    with pytest.raises(ValueError, match="'7'"):
        reg.submit(code, "s3", "7", number, now=4)
    with pytest.raises(ValueError, match="question 0 is over"):
        reg.submit(code, "s3", "1", 0, now=4)
    with pytest.raises(ValueError, match="'9'"):
        reg.reveal(code, "9", now=5)
    reg.reveal(code, "1", now=5)
    view = reg.view(code, now=6)
    assert view.answer == "1" and view.counts == {"1": 0, "3": 2}  # the right bar shown even when nobody chose it
    with pytest.raises(ValueError, match="revealed"):
        reg.submit(code, "s1", "1", number, now=6)
    assert reg.ask(code, make_question("preempted", 4, ["R1"]), now=7) == 2  # a new question: no predictions
    assert reg.view(code, now=7).answered == 0


def _submit_many(path: str, code: str, number: int, first: int) -> None:
    reg = ClassRegistry(path=path)  # a worker process of its own
    for i in range(first, first + 25):
        reg.submit(code, f"s{i}", str(i % 5), number)


def test_a_class_spans_processes_sharing_a_file(tmp_path):
    """A class server with several workers (scripts/class_server.py): the presenter's process and the
    students' processes share the classes through one file."""
    import multiprocessing

    path = str(tmp_path / "classes.json")
    presenter, student = ClassRegistry(path=path), ClassRegistry(path=path)
    code = presenter.open_class()
    assert student.exists(code)
    number = presenter.ask(code, make_question("free_after", 4, ["R1"]))
    student.submit(code, "s1", "3", number)
    with pytest.raises(ValueError, match="'7'"):
        student.submit(code, "s2", "7", number)  # refused, and nothing of it written
    assert presenter.view(code, presenter=True).counts == {"3": 1}
    # four processes submitting at once: every prediction counted once (one writer at a time: flock)
    procs = [multiprocessing.get_context("fork").Process(target=_submit_many, args=(path, code, number, 100 + 25 * k))
             for k in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    view = presenter.view(code, presenter=True)
    assert view.answered == 101 and sum(view.counts.values()) == 101
    presenter.reveal(code, "3")
    assert student.view(code, student="s1").answer == "3" and student.view(code, student="s1").mine == "3"
    presenter.close(code)
    assert not student.exists(code)


def test_a_damaged_class_file_is_moved_aside_and_reads_are_not_written(tmp_path):
    path = tmp_path / "classes.json"
    reg = ClassRegistry(path=str(path))
    code = reg.open_class()
    stamp = path.stat().st_mtime_ns
    for _ in range(3):
        reg.view(code)  # a student's page reading the class: nothing changed, nothing written
    assert path.stat().st_mtime_ns == stamp
    path.write_text('{"AB')  # cut short (a full disk)
    assert not reg.exists(code)  # read as no classes, not an error on every page
    assert (tmp_path / "classes.json.bad").read_text() == '{"AB'
    assert reg.exists(reg.open_class())


def test_tally_keeps_the_choices_order():
    q = make_question("free_after", 12, ["R1"])
    assert list(tally(q, ["10", "2", "10", "9"])) == ["2", "9", "10"]
    assert tally(None, ["1"]) == {}


def test_bounds_and_expiry():
    reg = ClassRegistry(max_classes=2, max_students=2, ttl_s=100)
    a = reg.open_class(now=0)
    reg.open_class(now=0)
    with pytest.raises(RuntimeError, match="at most 2"):
        reg.open_class(now=1)
    number = reg.ask(a, make_question("free_after", 4, ["R1"]), now=50)
    reg.submit(a, "s1", "1", number, now=51)
    reg.submit(a, "s2", "1", number, now=51)
    with pytest.raises(ValueError, match="full"):
        reg.submit(a, "s3", "1", number, now=52)
    reg.submit(a, "s1", "2", number, now=52)  # a student already in may still change
    # the other class was never touched after 0: gone after 100 s; a is kept alive by the presenter's view
    reg.view(a, presenter=True, now=120)
    assert len(reg) == 1 and reg.open_class(now=121)  # the untouched class has expired: room again
    assert reg.exists(a, now=219) and not reg.exists(a, now=221)
    with pytest.raises(KeyError, match=a):
        reg.view(a, now=221)


def test_students_see_no_ids():
    reg = ClassRegistry()
    code = reg.open_class(now=0)
    n = reg.ask(code, make_question("free_after", 4, ["R1"]), now=0)
    reg.submit(code, "secret-id-1", "1", n, now=0)
    view = reg.view(code, student="s2", now=0)
    assert "secret-id-1" not in repr(view) and view.mine is None


# ----------------------------------------------------------------------------------- a real engine's step
@pytest.fixture(scope="module")
def batch_lab():
    from engine import EMBEDDED_MODEL
    from engine.model_loader import load_shared
    from ui.lab import Lab
    from ui.state import default_settings

    return Lab.create(default_settings(), load_shared(EMBEDDED_MODEL))


def _added_blocks(before, after, request) -> set[int]:
    """Blocks in the request's GPU block tables after the step that none of them held before it."""
    def tables(snap):
        return {b for s in snap.sequences if s.request_id == request and s.status != "swapped" for b in s.block_table}
    return tables(after) - (tables(before) if before is not None else set())


def test_the_reveal_reads_a_real_steps_answers(batch_lab):
    """Step the default "batch" preset (12 blocks: preemption early) and check each answer against what the
    snapshots show, independently of the events: a block added to the target's block tables, the free
    blocks, a request that ran before the step and does not after it."""
    lab = batch_lab
    seen = {"block": 0, "none": 0, "preempted": 0}
    before = None
    while lab.has_work() and lab.step_count < 300:
        questions = [make_question("next_block", 12, lab.run.order, r) for r in lab.run.order]
        questions.append(make_question("preempted", 12, lab.run.order))
        record = lab.step()[0]
        assert answer_from_record(make_question("free_after", 12, lab.run.order), record) == \
            str(record.snapshot.num_free_blocks)
        for q in questions:
            answer = answer_from_record(q, record, before)
            if q.kind == "preempted":
                if answer != NOBODY:
                    seen["preempted"] += 1
                    assert answer in before.running and answer not in record.snapshot.running
                continue
            added = _added_blocks(before, record.snapshot, q.target)
            if answer == NONE:
                seen["none"] += 1
                assert not added, (q.target, record.step, added)
            else:
                seen["block"] += 1
                assert int(answer) in added, (q.target, record.step, answer, added)
        before = record.snapshot
    assert all(seen.values()), seen


# ------------------------------------------------------------------------------------------- the page
def test_class_page_presenter_and_student():
    """A presenter and a student in two sessions of one process (AppTest shares st.cache_resource): the
    student joins with the code and predicts; the presenter steps and reveals; the answer is the number of
    free blocks in the presenter's next step, and the student sees it."""
    from streamlit.testing.v1 import AppTest

    def class_page():
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=240)
        at.run()
        at.switch_page("ui/classroom.py").run()
        assert not at.exception, [e.value for e in at.exception]
        return at

    presenter, student = class_page(), class_page()
    presenter.radio(key="class_role").set_value("Presenter").run()
    next(b for b in presenter.button if b.label == "Start a class").click().run()
    code = presenter.session_state["class_code_presenting"]
    assert code and any(code in m.value for m in presenter.markdown)
    presenter.selectbox(key="class_kind").set_value("free_after")
    next(b for b in presenter.button if b.label == "Open the question").click().run()
    assert not presenter.exception, [e.value for e in presenter.exception]

    student.text_input(key="class_code_typed").set_value(code.lower())
    next(b for b in student.button if b.label == "Join").click().run()
    assert student.session_state["class_code_joined"] == code
    next(b for b in student.button if b.label == "Submit").click().run()  # nothing chosen yet
    student.run()  # the page's 1 s refresh: the refusal is still said
    assert [e.value for e in student.error] == ["Not submitted: choose a prediction first"]
    student.selectbox(key="class_pick_1").set_value("5")
    next(b for b in student.button if b.label == "Submit").click().run()
    assert any("Your prediction: **5**" in c.value for c in student.caption) and not student.error

    presenter.run()
    assert any("1 prediction so far" in c.value for c in presenter.caption)
    next(b for b in presenter.button if b.label == "Step and reveal").click().run()
    assert not presenter.exception, [e.value for e in presenter.exception]
    lab = presenter.session_state["lab"]
    right = str(lab.run.history[0][0].snapshot.num_free_blocks)  # asked before step 1: step 1's record
    assert lab.step_count == 1
    assert any(f"right answer: **{right}**" in c.value for c in presenter.caption)
    student.run()
    assert any(f"Right answer: **{right}**" in s.value for s in student.success)
    mine = student.session_state["lab"]  # the student's own Playground run (the app opened on the Playground)
    assert mine is not lab and mine.protocol.token != lab.protocol.token and mine.step_count == 0  # the presenter's step is not in it


# ------------------------------------------------------------------------------------------- the bench
def test_isolation_check_finds_a_leak():
    from bench.class_load import Student, isolation

    a, b = Student(0, "http://x", marker="BCDFG"), Student(1, "http://x", marker="HJKLM")
    a.text, a.tokens = [b"... BCDFG ..."], {"aaaaaaaaaaaa"}
    b.text, b.tokens = [b"HJKLM"], {"bbbbbbbbbbbb"}
    assert isolation([a, b]) == ([], 2)
    b.text.append(b"R7 BCDFG")  # b saw a's marker
    b.tokens.add("aaaaaaaaaaaa")
    leaks, own = isolation([a, b])
    assert own == 1 and any("student 1 saw student 0's marker" in x for x in leaks) and len(leaks) == 3


@pytest.mark.slow
def test_class_load_bench_runs(tmp_path):
    """bench/class_load.py with 2 students and 2 rounds against a real server: it writes its section and
    finds no leak (a bench, not a timed test: no time is asserted)."""
    from bench.class_load import main

    doc = tmp_path / "bench.md"
    assert main(["--students", "2", "--rounds", "2", "--workers", "1", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "<!-- class-load:start -->" in text and "| 2 | 1 process | 4 |" in text and "ok: no leak; 2/2" in text


def test_histogram_type_for_the_projector():
    """The projector view's histogram (issue 23, item 19): every text at least the font asked for (18 px at 720
    lines, 27 at 1080), the figure grown to hold it; a bad size is refused by name."""
    from viz.classroom import predictions_figure
    from viz.presenter import smallest_font

    counts = {"2": 3, "3": 5, "4": 1}
    assert smallest_font(predictions_figure(counts, "3")) < 18  # the page's own view: Plotly's 12 px
    for px in (18, 27):
        fig = predictions_figure(counts, "3", font_px=px)
        assert smallest_font(fig) >= px
        assert fig.data[0].textfont.size >= px and fig.layout.yaxis.title.font.size >= px
        assert fig.layout.height >= 16 * px
    with pytest.raises(ValueError, match="'big'"):
        predictions_figure(counts, font_px="big")
