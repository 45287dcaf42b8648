"""What every lesson must do ("Lessons 2.0"): transfer and act-as-the-allocator questions, feedback per
slip, takeaways for the recap, no answer given away above its question or in the README; and the lessons'
progress code (kept in the URL across a reload) and recap."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from lessons import catalog
from lessons.common import LessonContext
from lessons.exercise import Exercise, Slip, format_answer, format_value
from lessons.progress import MAX_CODE_CHARS, SavedProgress, decode, encode
from lessons.recap import answer_rows, recap_html, recap_markdown, takeaways
from lessons.text import fill, split_body

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
LESSONS = catalog()


@pytest.fixture(scope="module")
def ctx():
    return LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"))


@pytest.fixture(scope="module")
def built(ctx):
    """slug -> (module, facts, exercises), computed once for the module's tests."""
    out = {}
    for lesson in LESSONS:
        mod = importlib.import_module(lesson.module_name)
        out[lesson.slug] = (mod, mod.facts(ctx), mod.exercises(ctx))
    return out


# ------------------------------------------------------------------------------ questions and feedback
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_each_lesson_has_transfer_and_allocator_questions(built, lesson):
    _, _, exs = built[lesson.slug]
    transfer = [e.id for e in exs.values() if "transfer" in e.tags]
    allocator = [e.id for e in exs.values() if "allocator" in e.tags]
    assert len(transfer) >= 2, f"lesson {lesson.number}: transfer questions {transfer}"
    assert len(allocator) >= 1, f"lesson {lesson.number}: no act-as-the-allocator question"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_every_slip_gets_its_own_message_and_the_right_answer_is_accepted(built, lesson):
    _, _, exs = built[lesson.slug]
    with_slips = 0
    for ex in exs.values():
        assert ex.check(ex.expected).correct, ex.id
        answers = []
        for slip in ex.slips:
            verdict = ex.check(slip.answer)
            assert not verdict.correct and verdict.slip == slip.name, (ex.id, slip.name, verdict)
            assert verdict.message.startswith(slip.message), (ex.id, slip.name)
            answers.append(repr(ex.parse(slip.answer)))
        assert len(answers) == len(set(answers)), f"{ex.id}: two slips give the same answer"
        with_slips += bool(ex.slips)
    # Feedback per wrong answer: the questions that take a typed value name at least one usual slip.
    typed = [e.id for e in exs.values() if e.kind != "choice"]
    missing = [e for e in typed if not exs[e].slips]
    assert len(missing) <= len(typed) // 4, f"lesson {lesson.number}: no slips for {missing}"


def test_a_slip_that_is_the_right_answer_is_refused():
    with pytest.raises(ValueError, match="slip 'same'"):
        Exercise("e", "q", "number", 5, slips=[Slip("same", "5", "m")])
    with pytest.raises(ValueError, match="tags"):
        Exercise("e", "q", "number", 5, tags={"hard"})
    ex = Exercise("e", "q", "list", [3, 7], slips=[Slip("logical", [0, 1], "Those are the **logical** blocks.")])
    v = ex.check("0, 1")
    assert not v.correct and v.slip == "logical" and "logical" in v.message and "says 3, 7." in v.message
    v = ex.check("7, 3")
    assert not v.correct and v.slip is None and v.message.startswith("Not quite")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_each_lesson_has_takeaways_for_its_recap(built, lesson):
    mod, facts, _ = built[lesson.slug]
    lines = takeaways(mod, facts)
    assert 3 <= len(lines) <= 6, f"lesson {lesson.number}: {len(lines)} takeaways"
    assert all("{{" not in line for line in lines)


# --------------------------------------------------------------------------------------- no answer leaks
_UNIT_FORMS = {"blocks": ("blocks", "block"), "tokens": ("tokens", "token")}


def _needles(ex: Exercise) -> list[str]:
    """Ways the answer would be written in a text that gives it away."""
    if ex.kind == "number":
        shown = format_value(ex.expected, ex.unit)
        number = format_value(ex.expected)
        needles = [shown] if ex.unit else []
        # A bare number leaks when it is specific enough to be the answer (not 2 or 16, which any text has).
        if len(number.replace(",", "").replace(".", "")) >= 3 or "." in number:
            needles.append(number)
        return needles
    if ex.kind in ("list", "set") and len(ex.expected) >= 2:
        return ["[" + ", ".join(map(str, ex.expected)) + "]"]
    return []


def _leaks(text: str, needle: str) -> bool:
    return re.search(r"(?<![\w.,])" + re.escape(needle) + r"(?![\w]|[.,]\d)", text) is not None


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_no_text_above_a_question_gives_its_answer_away(built, lesson):
    """The lesson's text up to each question, and the question itself, never states its answer."""
    _, facts, exs = built[lesson.slug]
    above = ""
    for kind, value in split_body(lesson.body):
        if kind == "text":
            above += fill(value, facts)
        elif kind == "exercise":
            ex = exs[value]
            seen = above + "\n" + ex.question
            for needle in _needles(ex):
                assert not _leaks(seen, needle), f"lesson {lesson.number}, {ex.id}: {needle!r} is stated above it"


def lesson_sections() -> dict[str, str]:
    """The text that presents the lessons before a learner takes them: the README's "Who it is for" (its
    "Lessons" section moved to docs/learning.md, issue 28) and the learning guide's "The lessons" section."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    guide = (ROOT / "docs" / "learning.md").read_text(encoding="utf-8")
    return {"README": readme.split("\n## Who it is for", 1)[1].split("\n## ", 1)[0],
            "docs/learning.md": guide.split("\n## The lessons", 1)[1].split("\n## ", 1)[0]}


def test_the_readme_gives_no_lesson_answer_away(built):
    for where, section in lesson_sections().items():
        for lesson in LESSONS:
            for ex in built[lesson.slug][2].values():
                for needle in _needles(ex):
                    assert not _leaks(section, needle), f"{where} states {needle!r}, lesson {lesson.number}'s {ex.id}"
                if ex.kind == "choice" and len(ex.expected) >= 12:
                    assert ex.expected not in section, f"{where} states lesson {lesson.number}'s {ex.id}"


def answer_free_documents() -> list[Path]:
    """The documents a learner may read before a lesson: the whole README and every page under docs/."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _units(text: str):
    """A document's paragraphs, each table row on its own."""
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        rows = [line for line in lines if line.lstrip().startswith("|")]
        yield "\n".join(line for line in lines if not line.lstrip().startswith("|"))
        yield from rows


def _about_the_lessons(unit: str) -> bool:
    """Whether a paragraph speaks of the lessons ("lesson 3", "the lesson's lengths", "lesson tests")."""
    return re.search(r"\blessons?\b", unit, re.IGNORECASE) is not None


@pytest.mark.parametrize("doc", answer_free_documents(), ids=lambda p: p.name)
def test_the_readme_and_docs_give_no_lesson_answer_away(built, doc):
    """The whole README and every page of docs/: a block table or a long choice answer anywhere, and a
    number in any paragraph or table row that speaks of the lessons (elsewhere, 128 or "3 blocks" is a
    benchmark's figure, not an answer)."""
    text = doc.read_text(encoding="utf-8")
    about = [u for u in _units(text) if _about_the_lessons(u)]
    for lesson in LESSONS:
        for ex in built[lesson.slug][2].values():
            for needle in _needles(ex):
                where = [text] if ex.kind in ("list", "set") else about
                assert not any(_leaks(u, needle) for u in where), \
                    f"{doc.name} states {needle!r}, lesson {lesson.number}'s {ex.id}"
            if ex.kind == "choice" and len(ex.expected) >= 12:
                assert ex.expected not in text, f"{doc.name} states lesson {lesson.number}'s {ex.id}"


def test_the_whole_document_check_catches_a_figure_next_to_a_lesson():
    ex = Exercise("e", "q", "number", 68.7, unit="%")
    leaking = "| `lesson-lengths` | contiguous reserves the maximum: 68.7% wasted |"
    about = [u for u in _units("Intro.\n\n" + leaking + "\n| `batch` | 68.7% of something else |")
             if _about_the_lessons(u)]
    assert about == [leaking] and any(_leaks(u, n) for u in about for n in _needles(ex))


def test_the_leak_check_catches_a_leak():
    ex = Exercise("e", "q", "number", 38, unit="blocks")
    assert _leaks("it takes 38 blocks in all", _needles(ex)[0])
    assert not _leaks("it takes 138 blocks in all", _needles(ex)[0])
    pct = Exercise("p", "q", "number", 68.7, unit="%")
    assert any(_leaks("wastes 68.7% of it", n) for n in _needles(pct))
    assert not any(_leaks("wastes 68.75% of it", n) for n in _needles(pct))


def test_true_false_quizzes_are_balanced(built):
    """A quiz whose answers are mostly "false" teaches guessing "false"; each lesson's true/false questions
    are between a third and two thirds true."""
    for lesson in LESSONS:
        tf = [e for e in built[lesson.slug][2].values()
              if e.kind == "choice" and {o.lower() for o in e.options} == {"true", "false"}]
        if len(tf) >= 3:
            true = sum(e.expected.lower() == "true" for e in tf)
            assert len(tf) / 3 <= true <= 2 * len(tf) / 3, f"lesson {lesson.number}: {true} of {len(tf)} true"
        body = lesson.body.lower()
        assert body.count("common belief") <= 1, f"lesson {lesson.number} frames its statements as beliefs"


# ------------------------------------------------------------------------------------- progress code
def _saved():
    return SavedProgress({"l3_block_tables:where_block": {"raw": "7", "correct": False},
                          "l1_kv_cache:bytes_per_token": {"raw": "512 KiB", "correct": True},
                          "l4_sharing:fork": {"raw": [0, 2], "correct": True}},
                         {"l3_block_tables:where_block": False, "l1_kv_cache:bytes_per_token": True,
                          "l4_sharing:fork": True},
                         {"l6_when_paging_matters"})


def test_progress_code_round_trips_and_stays_short():
    saved = _saved()
    code = encode(saved)
    assert decode(code) == saved and re.fullmatch(r"[A-Za-z0-9_-]+", code)
    assert not SavedProgress() and saved


@pytest.mark.parametrize("bad, says", [
    ("", "empty"), ("abc", "damaged"), ("a b", "characters"), ("x" * (MAX_CODE_CHARS + 1), "8,001 characters, more than 8,000"),
])
def test_a_bad_progress_code_is_refused_with_a_reason(bad, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        decode(bad)


def test_a_progress_code_with_bad_entries_is_refused():
    import base64
    import json
    import zlib

    def code(payload):
        return base64.urlsafe_b64encode(zlib.compress(json.dumps(payload).encode())).decode().rstrip("=")
    with pytest.raises(ValueError, match="version"):
        decode(code({"v": 99}))
    with pytest.raises(ValueError, match="not 'lesson:question'"):
        decode(code({"v": 1, "a": {"../etc": ["1", True]}}))
    with pytest.raises(ValueError, match="malformed"):
        decode(code({"v": 1, "a": {"l1_kv_cache:q": {"x": 1}}}))
    with pytest.raises(ValueError, match="more than"):  # a small code that inflates to megabytes
        decode(code({"v": 1, "pad": "x" * 200_000}))


def _app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=180)
    return at


def test_progress_survives_a_reload_through_the_url(built):
    """Answer in one session; a new session (a reload) opened with the URL's code has the same answers."""
    at = _app()
    at.run()
    at.switch_page("lessons/l1_kv_cache.py").run()
    first = LESSONS[0].exercise_ids[0]
    ex = built[LESSONS[0].slug][2][first]
    key = f"{LESSONS[0].slug}:{first}"
    answer = ex.options[0] if ex.kind == "choice" else "1"
    if ex.kind == "choice":
        at.radio(key=f"in-{key}").set_value(answer)
    else:
        at.text_input(key=f"in-{key}").input(answer)
    next(b for b in at.button if b.label.startswith("Commit my answer")).click().run()
    assert not at.exception
    code = at.query_params.get("progress")
    code = code[0] if isinstance(code, list) else code
    assert code and key in decode(code).answers

    again = _app()
    again.query_params["progress"] = code
    again.run()
    again.switch_page("lessons/l1_kv_cache.py").run()
    assert not again.exception
    assert again.session_state["lesson_progress"][key]["raw"] == answer
    assert "1 of" in again.caption[0].value  # the lesson counts the restored answer


def test_a_damaged_code_in_the_url_keeps_the_app_running():
    at = _app()
    at.query_params["progress"] = "not-a-code"
    at.run()
    assert not at.exception
    assert at.session_state["lesson_progress"] == {} if "lesson_progress" in at.session_state else True


# ------------------------------------------------------------------------------------------------ recap
def test_recap_lists_takeaways_and_both_answers(built):
    lesson = LESSONS[2]
    mod, facts, exs = built[lesson.slug]
    order = lesson.exercise_ids
    some = order[0]
    ex = exs[some]
    wrong = ex.slips[0].answer if ex.slips else None
    answers = {f"{lesson.slug}:{some}": {"raw": wrong if wrong is not None else ex.expected, "correct": False}}
    rows = answer_rows(lesson.slug, exs, order, answers)
    assert [r["n"] for r in rows] == list(range(1, len(order) + 1))
    assert rows[0]["engine"] == format_answer(ex.expected, ex.unit)
    if wrong is not None:
        assert rows[0]["verdict"] == f"wrong: {ex.slips[0].name}"
    assert all(r["yours"] == "not answered" for r in rows[1:])
    text = recap_markdown(lesson, takeaways(mod, facts), rows)
    assert takeaways(mod, facts)[0] in text and f"Lesson {lesson.number}" in text
    page = recap_html(text, "t")
    assert page.startswith("<!doctype html>") and "<script" not in page and "http" not in page.split("<footer>")[0]
    evil = recap_html("1. <script>alert(1)</script>", "t")
    assert "<script>" not in evil


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_a_finished_lesson_shows_its_recap_and_offers_it_to_save(built, lesson):
    exs = built[lesson.slug][2]
    at = _app()
    at.run()
    at.session_state["lesson_progress"] = {f"{lesson.slug}:{i}": {"raw": ex.expected, "correct": True}
                                           for i, ex in exs.items()}
    at.switch_page(lesson.page_path).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(h.value == "Recap" for h in at.subheader)
    mod, facts, _ = built[lesson.slug]
    shown = "\n".join(m.value for m in at.markdown)
    assert all(line in shown for line in takeaways(mod, facts))


def test_hand_made_codes_that_once_crashed_a_page_are_refused_with_a_reason():
    """From a break-it trial: a code nested 60,000 deep (RecursionError) and an answer of 330 digits
    (OverflowError in the checker) each put a traceback on every page; both are now refused when read."""
    import base64
    import json
    import zlib

    def code(raw: bytes):
        return base64.urlsafe_b64encode(zlib.compress(raw)).decode().rstrip("=")
    with pytest.raises(ValueError, match="nested too deep"):
        decode(code(b"[" * 60_000))
    with pytest.raises(ValueError, match="not a plain answer"):
        decode(code(json.dumps({"v": 1, "a": {"l1_kv_cache:q": [10**330, False]}}).encode()))
    with pytest.raises(ValueError, match="not a plain answer"):
        decode(code(json.dumps({"v": 1, "a": {"l1_kv_cache:q": [[[1]], False]}}).encode()))
    with pytest.raises(ValueError, match="too large"):
        Exercise("e", "q", "number", 5).parse(10**330)
    with pytest.raises(ValueError, match="not a number"):
        Exercise("e", "q", "number", 3).parse("٣")  # an Arabic-Indic 3: answers are written in ASCII digits
    # an answer longer than a code may hold is left out of the code, not made to poison it
    long = SavedProgress({"l1_kv_cache:a": {"raw": "1" * 1000, "correct": False},
                          "l1_kv_cache:b": {"raw": "2", "correct": True}}, {}, set())
    assert set(decode(encode(long)).answers) == {"l1_kv_cache:b"}


def test_a_committed_answer_is_stored_stripped_and_a_stored_verdict_is_rechecked(built):
    lesson = LESSONS[0]
    first = lesson.exercise_ids[0]
    ex = built[lesson.slug][2][first]
    key = f"{lesson.slug}:{first}"
    if ex.kind == "choice":
        pytest.skip("lesson 1's first question takes a typed answer in this test")
    at = _app()
    at.run()
    at.switch_page(lesson.page_path).run()
    at.text_input(key=f"in-{key}").input(" " * 450 + str(ex.expected))
    next(b for b in at.button if b.label.startswith("Commit my answer")).click().run()
    assert not at.exception
    assert at.session_state["lesson_progress"][key] == {"raw": str(ex.expected), "correct": True}
    code = at.query_params.get("progress")
    code = code[0] if isinstance(code, list) else code
    assert key in decode(code).answers  # the reload keeps it
    # a code claiming a wrong answer was right: the page checks it again and counts it wrong
    wrong = ex.slips[0].answer if ex.slips else ex.expected + 1
    forged = encode(SavedProgress({key: {"raw": str(wrong), "correct": True}}, {key: True}, set()))
    again = _app()
    again.query_params["progress"] = forged
    again.run()
    again.switch_page(lesson.page_path).run()
    assert not again.exception
    assert ", 0 right" in again.caption[0].value and "1 of" in again.caption[0].value
