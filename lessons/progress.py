"""A learner's lesson progress as a short code (no Streamlit here).

The app keeps the code in the page's URL (``?progress=...``), so a reload or a bookmark resumes where the
learner was, and shows it on the lessons' overview, to carry to another browser. What it holds: each
committed answer as typed ("slug:exercise id" -> the raw answer and whether it was right), whether the first
answer was right, and the lessons shown whole. JSON, zlib-compressed, base64url: about 180 characters per lesson
with every question answered (measured: a choice stores its option's text), so the whole catalog's code stays
well under ``MAX_CODE_CHARS``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from engine.scenarios import url_codec
VERSION = 1
MAX_CODE_CHARS = 8000  # a URL stays well under browsers' and proxies' limits (about 8 KiB is safe)
MAX_PAYLOAD_BYTES = 65_536  # what a code may inflate to
MAX_ANSWER_CHARS = 400  # one typed answer; a longer one is not a lesson answer
MAX_NUMBER_DIGITS = 4300  # a number written with more digits is refused by name while parsing (Python's own
# int conversion refuses past its default limit, sys.int_info.default_max_str_digits, with its own message)
FIELDS = frozenset({"v", "a", "f", "t", "s"})  # a code's fields: version, answers, first tries right / not, shown
_KEY = re.compile(r"^l\d+_[a-z0-9_]+:[A-Za-z0-9_]+$")  # "slug:exercise id", as lessons/render.py keys them


@dataclass
class SavedProgress:
    """``answers``: "slug:id" -> {"raw": answer, "correct": bool}; ``first``: "slug:id" -> the first committed
    answer was right; ``shown``: slugs of lessons shown whole."""

    answers: dict[str, dict] = field(default_factory=dict)
    first: dict[str, bool] = field(default_factory=dict)
    shown: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.answers or self.first or self.shown)


def encode(saved: SavedProgress) -> str:
    """The code for ``saved`` (base64url text). Raises ValueError if it would exceed ``MAX_CODE_CHARS``."""
    payload = {"v": VERSION,
               "a": {k: [v["raw"], bool(v["correct"])] for k, v in sorted(saved.answers.items())
                     if len(json.dumps(v["raw"])) <= MAX_ANSWER_CHARS},  # decode refuses longer ones
               "f": sorted(k for k, ok in saved.first.items() if ok),
               "t": sorted(k for k, ok in saved.first.items() if not ok),
               "s": sorted(saved.shown)}
    raw = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    code = url_codec.pack(raw)
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"the progress code would be {len(code):,} characters (at most {MAX_CODE_CHARS:,})")
    return code


def decode(code: str) -> SavedProgress:
    """A code back to progress. Raises ValueError saying what is wrong with it (not text, not a code, too
    long, from another version: ``"v"`` must be the integer ``VERSION``, not true or 1.0; a number of more
    than ``MAX_NUMBER_DIGITS`` digits; a field this app does not write; a malformed entry); an unknown lesson
    or question in it is kept and simply never shown."""
    raw = url_codec.unpack(code, "the progress code", MAX_CODE_CHARS, MAX_PAYLOAD_BYTES)
    try:
        payload = json.loads(raw, parse_int=_parse_int)
    except _NumberTooLong as exc:
        raise ValueError(str(exc)) from None
    except RecursionError:  # "[[[[..." nested deeper than the JSON parser goes
        raise ValueError("the progress code is damaged (nested too deep)") from None
    except ValueError:  # not JSON (a UnicodeDecodeError is a ValueError too)
        raise ValueError("the progress code is damaged (cut short or mistyped?)") from None
    version = payload.get("v") if isinstance(payload, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version != VERSION:  # not true, not 1.0
        said = f" (its version is {json.dumps(version)[:40]})" if isinstance(payload, dict) and "v" in payload else ""
        raise ValueError(f"the progress code is not a version-{VERSION} code of this app{said}")
    if unknown := sorted(set(payload) - FIELDS):  # a code this app did not write: nothing of it would be restored
        names = ", ".join(repr(k[:40]) for k in unknown[:5])
        names += f" and {len(unknown) - 5:,} more" if len(unknown) > 5 else ""
        raise ValueError(f"the progress code holds field{'s' * (len(unknown) != 1)} {names} that this app does "
                         f"not write (its fields are {', '.join(sorted(FIELDS))}): it was not made by this app")
    answers, first = {}, {}
    for key, value in _items(payload.get("a"), dict, "answers"):
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], bool)
                and isinstance(value[0], (str, int, float, list))):
            raise ValueError(f"the progress code's answer to {key!r} is malformed")
        if not _plain_answer(value[0]):
            raise ValueError(f"the progress code's answer to {key!r} is not a plain answer")
        if len(json.dumps(value[0])) > MAX_ANSWER_CHARS:
            raise ValueError(f"the progress code's answer to {key!r} is longer than {MAX_ANSWER_CHARS} characters")
        answers[key] = {"raw": value[0], "correct": value[1]}
    for name, ok in (("f", True), ("t", False)):
        for key in _items(payload.get(name), list, "first tries"):
            first[key] = ok
    shown = set()
    for slug in payload.get("s", []) if isinstance(payload.get("s", []), list) else [None]:
        if not (isinstance(slug, str) and re.fullmatch(r"l\d+_[a-z0-9_]+", slug)):
            raise ValueError(f"the progress code names a lesson {slug!r} that is not a lesson name")
        shown.add(slug)
    return SavedProgress(answers, first, shown)


class _NumberTooLong(ValueError):
    """A number in a code longer than ``MAX_NUMBER_DIGITS`` digits (told apart from a damaged code)."""


def _parse_int(text: str) -> int:
    """JSON's integers, refused by name past ``MAX_NUMBER_DIGITS`` digits, before ``int`` is asked (one of 16
    to ``MAX_NUMBER_DIGITS`` digits parses, and ``_plain_answer`` or the version check refuses it by entry)."""
    digits = len(text) - text.startswith("-")
    if digits > MAX_NUMBER_DIGITS:
        raise _NumberTooLong(f"the progress code holds a number of {digits:,} digits: a code this app wrote "
                             f"has none longer than 15 (an answer)")
    return int(text)


def describe_code(code: str) -> str:
    """A bad code named on the page: its first 24 characters (and its length when longer), as typed."""
    code = code if isinstance(code, str) else repr(code)
    return repr(code) if len(code) <= 24 else f"{code[:24]!r}... ({len(code):,} characters)"


def _plain_answer(value: Any) -> bool:
    """What a lesson can store: text, a finite number of at most 15 digits, or a flat list of those."""
    if isinstance(value, list):
        return all(not isinstance(v, list) and _plain_answer(v) for v in value)
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) < 10**15
    if isinstance(value, float):
        return math.isfinite(value) and abs(value) < 1e15
    return isinstance(value, str)


def _items(value: Any, kind: type, what: str):
    if value is None:
        return []
    if not isinstance(value, kind):
        raise ValueError(f"the progress code's {what} are malformed")
    items = value.items() if kind is dict else value
    for item in items:
        key = item[0] if kind is dict else item
        if not (isinstance(key, str) and _KEY.match(key)):
            raise ValueError(f"the progress code names a question {key!r} that is not 'lesson:question'")
    return items
