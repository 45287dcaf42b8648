"""A new lesson is its own two files: the number of lessons is ``len(lessons.catalog())`` wherever it is shown,
and the README, the guides and the lessons' own docstrings write no count that a new lesson would make wrong."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lessons import catalog, number_word

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app.py")
_WORDS = [number_word(n) for n in range(2, 100)]
# "ten lessons", "all ten lessons", "Ten self-paced lessons", "10 short lessons": a count of the lessons
COUNT = re.compile(r"\b(" + "|".join(sorted(_WORDS, key=len, reverse=True)) + r"|\d+)\s+(?:self-paced\s+|short\s+)?"
                   r"lessons\b", re.IGNORECASE)
PLACES = ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md"))),
          "lessons/__init__.py", "lessons/progress.py", "ui/lessons.py", "app.py"]


def test_number_word_spells_any_count():
    assert [number_word(n) for n in (0, 1, 9, 10, 11, 19, 20, 21, 40, 99)] == [
        "zero", "one", "nine", "ten", "eleven", "nineteen", "twenty", "twenty-one", "forty", "ninety-nine"]
    assert number_word(100) == "100" and number_word(1234) == "1,234"
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="a count must be a non-negative integer, got"):
            number_word(bad)


@pytest.mark.parametrize("place", PLACES)
def test_no_doc_writes_the_number_of_lessons(place):
    text = (ROOT / place).read_text(encoding="utf-8")
    found = [m.group(0) for m in COUNT.finditer(text)]
    assert not found, f"{place} writes a count of the lessons ({found}): a new lesson would make it wrong"


def test_the_count_pattern_finds_what_the_docs_used_to_write():
    for said in ("with ten lessons, a presenter", "all ten lessons answered", "Ten self-paced lessons",
                 "The ten lessons", "Eleven short lessons", "12 lessons"):
        assert COUNT.search(said), said
    for fine in ("the lessons", "lesson 10", "self-paced lessons of 8-16 minutes"):
        assert not COUNT.search(fine), fine


def test_the_overview_counts_the_catalog():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    at.switch_page("ui/lessons.py").run()
    assert not at.exception
    first = at.markdown[0].value if at.markdown else ""
    intro = next((m.value for m in at.markdown if "short lessons on how" in m.value), first)
    assert intro.startswith(f"{number_word(len(catalog())).capitalize()} short lessons on how"), intro
