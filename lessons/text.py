"""Lesson Markdown: markers for interactive parts and ``{{ name }}`` figures filled from the engine."""

from __future__ import annotations

import re

from .exercise import format_value

MARKER = re.compile(r"<!--\s*(exercise|widget)\s*:\s*([A-Za-z0-9_]+)\s*-->")
FIELD = re.compile(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}")


def split_body(body: str) -> list[tuple[str, str]]:
    """``[("text", markdown), ("exercise", id), ("widget", name), ...]`` in reading order."""
    parts, pos = [], 0
    for m in MARKER.finditer(body):
        if body[pos:m.start()].strip():
            parts.append(("text", body[pos:m.start()]))
        parts.append((m.group(1), m.group(2)))
        pos = m.end()
    if body[pos:].strip():
        parts.append(("text", body[pos:]))
    return parts


def fill(text: str, facts: dict) -> str:
    """Replace each ``{{ name }}`` with ``facts[name]`` (numbers get thousands separators).
    Raises KeyError naming a field the lesson module did not compute."""
    def value(m: re.Match) -> str:
        name = m.group(1)
        if name not in facts:
            raise KeyError(f"lesson text uses {{{{ {name} }}}} but the module computed no such figure")
        v = facts[name]
        return v if isinstance(v, str) else format_value(v)
    return FIELD.sub(value, text)


def fields(text: str) -> set[str]:
    return set(FIELD.findall(text))
