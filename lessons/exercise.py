"""Predict-then-reveal exercises: pure data and checkers (no Streamlit).

A lesson module builds each ``Exercise`` with ``expected`` taken from an engine or block-manager run made
at run time; nothing here knows the answers. The page asks the question, takes the learner's committed
answer, and only then shows the engine's answer and the explanation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

KINDS = ("number", "choice", "list", "set")
_UNSET = object()


TAGS = ("transfer", "allocator")  # what kind of thinking a question asks for (tests count them per lesson)


@dataclass(frozen=True)
class Verdict:
    """The outcome of one committed answer: right or not, the message to show, and the slip (a ``Slip.name``)
    the wrong answer revealed, if it matched one."""

    correct: bool
    message: str
    slip: str | None = None


@dataclass(frozen=True)
class Slip:
    """A usual mistake and the wrong answer it produces, computed from the same engine run as the right one.

    Attributes:
        name: a short id (e.g. ``"logical-block"``), tested per exercise.
        answer: the value a learner who makes this slip gives (same kind as the exercise's ``expected``).
        message: Markdown naming the slip, e.g. "That is the **logical** block number; the table maps it to
            the physical one." Shown before the engine's answer.
    """

    name: str
    answer: Any
    message: str


@dataclass
class Exercise:
    """One question.

    Attributes:
        id: unique within its lesson (progress is kept per id).
        question: Markdown.
        kind: "number" (a value, within ``tolerance`` absolute or ``rel_tolerance`` relative), "choice"
            (one of ``options``), "list" (integers in order, e.g. a block table) or "set" (integers, any
            order, e.g. the blocks that become free).
        expected: the engine's answer (a number, an option, or a list of integers).
        explanation: Markdown shown after the reveal, written with the engine's numbers.
        unit: shown next to a number input (e.g. "KiB").
        slips: the usual wrong answers with the mistake each reveals (``Slip``); a wrong answer equal to a
            slip's answer gets that slip's message. A slip whose answer equals ``expected`` is refused.
        tags: "transfer" (a situation the text has not worked through, answered by the engine running it)
            and/or "allocator" (the learner acts as the block manager or scheduler: picks blocks, writes a
            table, names a victim).
        source: who gave ``expected``, named in the verdict ("the engine says ..."); a measurement taken
            elsewhere (e.g. lesson 3's kernel timings from an H200) names itself instead.
        answer_phrases: the answer as a sentence would give it away in words (e.g. "the cache keeps both",
            "barely matters"), at least two words each, matched case-insensitively with Markdown emphasis and
            line breaks ignored. No page a learner may read before the lesson (the README, docs/*.md) may
            contain one (tests/test_lessons_answer_leaks.py); a question whose answer the numeric leak check
            cannot see (a choice, a small number) must have some.
        pool_blocks: for a list or set of physical block ids, the pool's size: an id outside 0 ..
            pool_blocks - 1 is refused, naming it and the pool's range (None: not checked).
    """

    id: str
    question: str
    kind: str
    expected: Any
    explanation: str = ""
    options: list[str] = field(default_factory=list)
    tolerance: float = 0.0
    rel_tolerance: float = 0.0
    unit: str = ""
    slips: list[Slip] = field(default_factory=list)
    tags: frozenset = frozenset()
    source: str = "the engine"
    answer_phrases: tuple = ()
    pool_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"exercise {self.id!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "choice" and self.expected not in self.options:
            raise ValueError(f"exercise {self.id!r}: the engine's answer {self.expected!r} is not among the options")
        self.tags = frozenset(self.tags)
        if not self.tags <= set(TAGS):
            raise ValueError(f"exercise {self.id!r}: tags {sorted(self.tags - set(TAGS))} are not among {TAGS}")
        if isinstance(self.answer_phrases, str):
            raise ValueError(f"exercise {self.id!r}: answer_phrases is one string {self.answer_phrases!r}; "
                             "give a list of phrases")
        self.answer_phrases = tuple(self.answer_phrases)
        for phrase in self.answer_phrases:
            if not isinstance(phrase, str) or len(phrase.split()) < 2:
                raise ValueError(f"exercise {self.id!r}: answer phrase {phrase!r} is not a phrase of two or more "
                                 "words (one word would match any text)")
        if self.pool_blocks is not None and self.kind in ("list", "set"):
            self.parse(self.expected)  # the engine's own blocks lie in the pool
        for slip in self.slips:
            if self._matches(self.parse(slip.answer)):
                raise ValueError(f"exercise {self.id!r}: slip {slip.name!r} gives the engine's own answer "
                                 f"{slip.answer!r}; a slip must be a wrong answer")

    # ------------------------------------------------------------------------------------------ checking
    def parse(self, answer: Any) -> Any:
        """The learner's answer as a value of this exercise's kind. Raises ValueError naming the bad input."""
        if self.kind == "number":
            try:
                if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                    value = float(answer)
                else:
                    value = parse_number(str(answer), self.unit)
            except OverflowError:  # a whole number too big for a float (e.g. from a hand-made progress code)
                raise ValueError(f"{str(answer)[:40]!r}... is too large a number") from None
            if not math.isfinite(value):
                raise ValueError(f"{answer!r} is not a finite number")
            if value < 0:
                raise ValueError(f"{answer!r} is negative; every answer here is 0 or more")
            if self.unit == "%" and value > 100:
                raise ValueError(f"{answer!r} is more than 100%")
            if isinstance(self.expected, int) and not value.is_integer():
                raise ValueError(f"{answer!r} is not a whole number; this answer counts whole "
                                 f"{self.unit or 'units'}")
            return value
        if self.kind == "choice":
            if answer not in self.options:
                raise ValueError(f"{answer!r} is not one of the options")
            return answer
        values = parse_int_list(answer)
        if self.pool_blocks is not None:
            for v in values:
                if v >= self.pool_blocks:
                    raise ValueError(f"{v} is not a block of this pool: its block ids run from 0 to "
                                     f"{self.pool_blocks - 1}")
        return values

    def check(self, answer: Any) -> Verdict:
        """Compare a committed answer with the engine's. Raises ValueError if the answer cannot be read."""
        value = self.parse(answer)
        shown = format_answer(self.expected, self.unit)
        if self._matches(value):
            return Verdict(True, f"Correct: {self.source} agrees, {shown}.")
        slip = self.slip_for(value)
        if slip is not None:
            return Verdict(False, f"{slip.message} {self.source[:1].upper()}{self.source[1:]} says {shown}.", slip.name)
        return Verdict(False, f"Not quite: {self.source} says {shown}.")

    def _matches(self, value: Any, target: Any = _UNSET) -> bool:
        """Whether a parsed answer equals ``target`` (default: the engine's answer), by this kind's rule."""
        target = self.expected if target is _UNSET else target
        if self.kind == "number":
            slack = max(self.tolerance, self.rel_tolerance * abs(target))
            return abs(value - target) <= slack + 1e-9
        if self.kind == "set":
            return sorted(set(value)) == sorted(set(target)) and len(value) == len(set(value))
        return value == target

    def slip_for(self, value: Any) -> Slip | None:
        """The slip whose answer a parsed wrong ``value`` equals (same rule as the right answer). When the
        tolerance lets a number match several slips, the nearest one is named (the first of equally near
        ones), so every slip's own answer gets its own message."""
        matching = [slip for slip in self.slips if self._matches(value, self.parse(slip.answer))]
        if self.kind == "number" and len(matching) > 1:
            return min(matching, key=lambda slip: abs(value - self.parse(slip.answer)))
        return matching[0] if matching else None


_NUMBER = re.compile(r"[+-]?([0-9]{1,3}(,[0-9]{3})+|[0-9]+)(\.[0-9]+)?|[+-]?\.[0-9]+")  # 512, 5,126, 68.7, .5 (ASCII digits)


def parse_number(text: str, unit: str = "") -> float:
    """``"512"``, ``"5,126"``, ``"68.7%"``, ``"3 blocks"`` (this exercise's unit) -> a float.
    Raises ValueError naming the text when it is not one plain number (``"1,2,,3"``, ``"nan"``, ``"2x"``)."""
    t = text.strip()
    for suffix in sorted({unit, unit.rstrip("s")} - {""}, key=len, reverse=True):
        if t.lower().endswith(suffix.lower()):
            t = t[: -len(suffix)].strip()
            break
    if not _NUMBER.fullmatch(t) and re.fullmatch(r"[0-9.]+([\s,;]+[0-9.]+)+", t):
        raise ValueError(f"{text!r} is not a single number: this question expects one number"
                         f"{f' of {unit}' if unit else ''}, not a list")
    if not _NUMBER.fullmatch(t):
        raise ValueError(f"{text!r} is not a number{f' of {unit}' if unit else ''}; write it in digits")
    return float(t.replace(",", ""))


def parse_int_list(answer: Any, allow_none: bool = True) -> list[int]:
    """``"0, 2"``, ``"[0 2]"``, ``[0, 2]`` -> ``[0, 2]``; ``""`` or ``"none"`` -> ``[]``.
    ``allow_none``: an answer may be "none" (an exercise's empty set); False for input that is not an answer
    (e.g. a widget's list of lengths), whose errors then do not suggest it.
    Raises ValueError naming the first piece that is not a whole number."""
    if isinstance(answer, (list, tuple)):
        pieces = [str(x) for x in answer]
    else:
        text = str(answer).strip().strip("[](){}").strip()
        if text.lower() in ("", "none", "-"):
            return []
        if re.search(r"[,;]\s*[,;]|^[,;]|[,;]$", text):
            raise ValueError(f"{answer!r} has an empty item; write whole numbers separated by commas")
        pieces = [p for p in re.split(r"[\s,;]+", text) if p]
    out = []
    for p in pieces:
        if not re.fullmatch(r"[0-9]+", p.strip()):
            raise ValueError(f"{p!r} is not a whole number of 0 or more; write whole numbers separated by commas"
                             + (" (or none, where nothing is the answer)" if allow_none else ""))
        out.append(int(p))
    return out


def format_value(value: Any, unit: str = "") -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(map(str, value)) + "]" if value else "none"
    else:
        text = str(value)
    return f"{text}{unit}" if unit == "%" else f"{text} {unit}".strip()


def format_answer(value: Any, unit: str = "") -> str:
    """An answer as a learner reads it in a verdict or a recap: like ``format_value``, but a list is written as
    typed ("1, 2, 3, 5", not "[1, 2, 3, 5]") and a count of one takes the singular unit ("1 token")."""
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) if value else "none"
    if (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1
            and re.fullmatch(r"[a-z]+s", unit)):
        unit = unit[:-1]
    return format_value(value, unit)
