"""Worded answers stay in the lessons: no page a learner may read first (the README, docs/*.md) and no lesson
text above a question says a question's answer in words ("the cache keeps both", "block size barely
matters"). Each exercise names its own answer phrases next to itself (``Exercise.answer_phrases``); the
numeric check in tests/test_lessons_standard.py covers answers written as figures."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from engine import EMBEDDED_MODEL
from engine.model_loader import load_model
from lessons import catalog
from lessons.common import LessonContext
from lessons.exercise import Exercise
from lessons.text import fill, split_body

ROOT = Path(__file__).resolve().parent.parent
LESSONS = catalog()


@pytest.fixture(scope="module")
def built():
    """slug -> (facts, exercises), computed once for the module's tests."""
    ctx = LessonContext(loaded=load_model(EMBEDDED_MODEL, torch.device("cpu"), "float32"))
    out = {}
    for lesson in LESSONS:
        mod = importlib.import_module(lesson.module_name)
        out[lesson.slug] = (mod.facts(ctx), mod.exercises(ctx))
    return out


def plain(text: str) -> str:
    """Text as a reader sees it: lower case, Markdown emphasis and code marks dropped, any run of spaces and
    line breaks one space, typographic apostrophes and dashes as ASCII."""
    text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u2013", "-").replace("\u2014", "-")
    text = re.sub(r"[*`]", "", text)
    return re.sub(r"\s+", " ", text).strip().lower()


def stated(text: str, phrase: str) -> bool:
    """Whether ``text`` contains ``phrase`` as whole words (so "at step 14" is not found in "at step 140")."""
    return _stated_in_plain(plain(text), phrase)


def _stated_in_plain(plain_text: str, phrase: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(plain(phrase)) + r"(?!\w)", plain_text) is not None


def documents() -> list[Path]:
    """The pages a learner may read before a lesson: the whole README and every page under docs/."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


from test_lessons_standard import _needles as _numeric_needles  # noqa: E402  (the numeric leak check's rule)


def test_every_question_the_numeric_check_cannot_see_has_answer_phrases(built):
    """A choice, a small number (3, 14, 53) or a one-block set has no figure specific enough to look for in a
    document, so it names its answer in words."""
    missing = [f"lesson {lesson.number} {ex.id}" for lesson in LESSONS
               for ex in built[lesson.slug][1].values() if not _numeric_needles(ex) and not ex.answer_phrases]
    assert not missing, f"questions with neither a figure to check nor answer phrases: {missing}"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.name)
def test_no_readme_or_docs_page_states_a_worded_answer(built, doc):
    text = plain(doc.read_text(encoding="utf-8"))
    found = [f"{phrase!r} (lesson {lesson.number}, {ex.id})" for lesson in LESSONS
             for ex in built[lesson.slug][1].values() for phrase in ex.answer_phrases
             if _stated_in_plain(text, phrase)]
    assert not found, f"{doc.name} gives lesson answers away in words: {found}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.slug)
def test_no_lesson_text_above_a_question_states_its_worded_answer(built, lesson):
    facts, exs = built[lesson.slug]
    above = ""
    for kind, value in split_body(lesson.body):
        if kind == "text":
            above += "\n" + fill(value, facts)
        elif kind == "exercise":
            ex = exs[value]
            for phrase in ex.answer_phrases:
                assert not stated(above + "\n" + ex.question, phrase), \
                    f"lesson {lesson.number}, {ex.id}: {phrase!r} is stated above it"


def test_the_answer_phrases_are_said_by_the_lesson_itself(built):
    """A phrase is an answer, not a random string: each exercise's reveal (its explanation) or the lesson's
    text after the question says at least one of its phrases, or the phrase is the engine's answer itself."""
    for lesson in LESSONS:
        facts, exs = built[lesson.slug]
        body = fill(lesson.body, facts)
        for ex in exs.values():
            if not ex.answer_phrases:
                continue
            after = body.split(f"<!-- exercise: {ex.id} -->", 1)[1]
            said = after + "\n" + ex.explanation + "\n" + str(ex.expected)
            assert any(stated(said, p) for p in ex.answer_phrases), \
                f"lesson {lesson.number}, {ex.id}: none of {ex.answer_phrases} is said by its reveal or the text after it"


def test_the_check_catches_the_worded_leaks_the_trial_found(built):
    """The README's old shared-prefix row and docs/benchmarks.md's old kernel line are caught, and by the
    questions they answer."""
    old_row = "| `shared-prefix` | eight chats with one long system prompt: automatic prefix caching stores its full blocks once |"
    old_kernel = ("- **Block size barely matters to the kernel**: 1 to 128 tokens per block all read at 4.18-4.28 TB/s\n"
                  "  (batch 64 x 4k). Block size is a memory-waste trade-off, not a speed one, for this kernel.")
    by = {(lesson.number, ex.id): ex for lesson in LESSONS for ex in built[lesson.slug][1].values()}
    assert any(stated(old_row, p) for p in by[(8, "duplicate")].answer_phrases)
    assert any(stated(old_kernel, p) for p in by[(3, "kernel_speed")].answer_phrases)
    assert not stated("it barely mattersome", "barely matters some")
    assert stated("Block size **barely\nmatters** here", "block size barely matters")


def test_an_answer_phrase_is_two_words_or_more():
    with pytest.raises(ValueError, match="'keeps'"):
        Exercise("e", "q", "choice", "a", options=["a", "b"], answer_phrases=["keeps"])
    with pytest.raises(ValueError, match="one string"):
        Exercise("e", "q", "choice", "a", options=["a", "b"], answer_phrases="keeps both")


# ------------------------------------- the README's lesson screenshot (issue 23, second learner trial)
SHOT_ACTIONS = {"fill", "press", "click", "dblclick", "type", "check", "set_checked", "select_option", "tap",
                "press_sequentially", "set_input_files", "dispatch_event"}


def _screenshot_script():
    import ast

    source = (ROOT / "scripts" / "screenshots.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "lesson_shot")
    shot = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "LESSON_SHOT")
    return fn, ast.literal_eval(shot.value)


def test_the_lesson_screenshot_answers_nothing(built):
    """The learning guide (docs/learning.md) shows docs/screenshot_lesson.png: the script that takes it only
    opens and scrolls the lesson (typing an answer or pressing a button would put the engine's answer in the
    guide), and the question it frames is the lesson's first after its heading, so no earlier reveal is
    needed to reach it."""
    import ast

    fn, shot = _screenshot_script()
    acts = sorted({n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
                  & SHOT_ACTIONS)
    assert not acts, f"the lesson screenshot {', '.join(acts)}s something, which may reveal an answer"
    lesson = next(l for l in LESSONS if l.url_path == shot["page"] or f"lesson-{l.number}" == shot["page"])
    facts, exs = built[lesson.slug]
    section = lesson.body.split(f"### {shot['heading']}", 1)[1]
    first = next(v for k, v in split_body(section) if k == "exercise")
    assert exs[first].question.startswith(shot["question"]), (first, exs[first].question)
    assert (ROOT / shot["path"]).exists()
    # the README's lessons moved to the learning guide (issue 28): it shows the screenshot, linked from docs/
    guide = (ROOT / "docs" / "learning.md").read_text(encoding="utf-8")
    assert f"]({Path(shot['path']).relative_to('docs')})" in guide


def test_the_screenshot_check_sees_a_script_that_answers(tmp_path):
    import ast

    bad = ast.parse("def lesson_shot(page, url):\n    box = page.get_by_placeholder('x')\n    box.fill('2, 2')\n"
                    "    box.press('Enter')\n")
    acts = {n.func.attr for n in ast.walk(bad) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert acts & SHOT_ACTIONS == {"fill", "press"}
