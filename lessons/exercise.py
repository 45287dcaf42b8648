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


@dataclass(frozen=True)
class Verdict:
    correct: bool
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

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"exercise {self.id!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "choice" and self.expected not in self.options:
            raise ValueError(f"exercise {self.id!r}: the engine's answer {self.expected!r} is not among the options")

    # ------------------------------------------------------------------------------------------ checking
    def parse(self, answer: Any) -> Any:
        """The learner's answer as a value of this exercise's kind. Raises ValueError naming the bad input."""
        if self.kind == "number":
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                value = float(answer)
            else:
                value = parse_number(str(answer), self.unit)
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
        return parse_int_list(answer)

    def check(self, answer: Any) -> Verdict:
        """Compare a committed answer with the engine's. Raises ValueError if the answer cannot be read."""
        value = self.parse(answer)
        if self.kind == "number":
            slack = max(self.tolerance, self.rel_tolerance * abs(self.expected))
            ok = abs(value - self.expected) <= slack + 1e-9
        elif self.kind == "set":
            ok = sorted(set(value)) == sorted(set(self.expected)) and len(value) == len(set(value))
        else:
            ok = value == self.expected
        shown = format_value(self.expected, self.unit)
        if ok:
            return Verdict(True, f"Correct: the engine agrees, {shown}.")
        return Verdict(False, f"Not quite: the engine says {shown}.")


_NUMBER = re.compile(r"[+-]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?|[+-]?\.\d+")  # 512, 5,126, 68.7, .5


def parse_number(text: str, unit: str = "") -> float:
    """``"512"``, ``"5,126"``, ``"68.7%"``, ``"3 blocks"`` (this exercise's unit) -> a float.
    Raises ValueError naming the text when it is not one plain number (``"1,2,,3"``, ``"nan"``, ``"2x"``)."""
    t = text.strip()
    for suffix in sorted({unit, unit.rstrip("s")} - {""}, key=len, reverse=True):
        if t.lower().endswith(suffix.lower()):
            t = t[: -len(suffix)].strip()
            break
    if not _NUMBER.fullmatch(t):
        raise ValueError(f"{text!r} is not a number{f' of {unit}' if unit else ''}; write it in digits")
    return float(t.replace(",", ""))


def parse_int_list(answer: Any) -> list[int]:
    """``"0, 2"``, ``"[0 2]"``, ``[0, 2]`` -> ``[0, 2]``; ``""`` or ``"none"`` -> ``[]``.
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
        if not re.fullmatch(r"\d+", p.strip()):
            raise ValueError(f"{p!r} is not a whole number of 0 or more; write whole numbers separated by commas "
                             "(or none, where nothing is the answer)")
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
