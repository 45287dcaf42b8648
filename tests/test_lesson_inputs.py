"""Shared lesson input rules (lessons/exercise.py, the lessons' kept widgets): answers are parsed with
messages that say what was expected, and no kept widget takes a default of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lessons.exercise import Exercise, parse_number

LESSONS = Path(__file__).resolve().parent.parent / "lessons"


@pytest.mark.parametrize("text", ["0,1,2,3", "1 2", "3; 4", "12, 7"])
def test_several_numbers_in_a_number_answer_say_one_is_expected(text):
    with pytest.raises(ValueError) as err:
        parse_number(text, "tokens")
    msg = str(err.value)
    assert repr(text) in msg and "one number of tokens" in msg and "write it in digits" not in msg


@pytest.mark.parametrize("text", ["5,126", "68.7", "3 tokens", "1,024 tokens"])
def test_one_number_still_reads(text):
    assert parse_number(text, "tokens") == float(text.replace(" tokens", "").replace(",", ""))


def test_words_still_ask_for_digits():
    with pytest.raises(ValueError, match="'ten' is not a number of tokens; write it in digits"):
        parse_number("ten", "tokens")


def test_pool_blocks_refuses_ids_outside_the_pool_and_checks_the_engines_answer():
    ex = Exercise("x", "q", "set", [2, 5], pool_blocks=8)
    with pytest.raises(ValueError, match="8 is not a block of this pool: its block ids run from 0 to 7"):
        ex.check("2, 8")
    assert ex.check("5 2").correct
    assert Exercise("y", "q", "set", [2, 99]).check("2, 99").correct  # no pool given: not checked
    with pytest.raises(ValueError, match="9 is not a block of this pool"):
        Exercise("z", "q", "set", [9], pool_blocks=8)


def _kept_widget_defaults() -> list[str]:
    """``st.<widget>(..., key="keep_...", value=/index=...)`` calls in the lessons: render.keep_widget_state
    writes every keep_ key back each run, so such a widget both has a default and is set through the Session
    State API (Streamlit warns, and the value the browser is moving can be overwritten)."""
    found = []
    for path in sorted(LESSONS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            key = kw.get("key")
            text = (key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else
                    key.values[0].value if isinstance(key, ast.JoinedStr) and key.values
                    and isinstance(key.values[0], ast.Constant) else "")
            if text.startswith("keep_") and ({"value", "index"} & set(kw)):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_kept_widget_takes_a_default_of_its_own():
    assert _kept_widget_defaults() == []
