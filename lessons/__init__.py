"""Self-paced lessons: each lesson is a Markdown file plus a small module of the same name.

    lessons/l3_block_tables.md   the text, with a front-matter header (title, minutes, playground preset
                                  with optional settings, and optionally a short navigation label)
                                  and markers where interactive parts go: ``<!-- exercise: id -->`` and
                                  ``<!-- widget: name -->``; ``{{ name }}`` is replaced by a figure the
                                  module computed with the engine at run time. The page shows the text up
                                  to the first question not yet answered, one question at a time
    lessons/l3_block_tables.py   ``facts(ctx)``, ``exercises(ctx)`` (pure, tested without Streamlit) and
                                  ``widget_<name>(ctx)`` functions; run as a Streamlit page it renders itself

Adding a lesson means adding such a pair here; the app builds its pages from ``catalog()``, and every count of
lessons the app shows is ``len(catalog())`` (the docs name none).

The public API (``__all__``): what the app (``app.py``, the ``ui`` pages) may import from the lessons: the
catalog, and the render entry points of ``lessons/render.py`` (a lesson page, the progress kept in the URL).
The ``ui`` modules import nothing else of this package (tests/test_app_state_imports.py); the lessons in turn
use the app's infrastructure from ``infra`` (the shared model and run caches, the class server's limits,
the session keys), never the ``ui`` package (the pages show the lessons, not the other way).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# the render entry points, imported on first use (``lessons.render`` imports Streamlit; ``catalog`` does not)
_RENDER_API = ("render_lesson", "keep_widget_state", "sync_progress_url", "show_progress_error", "lesson_progress",
               "progress_code", "restore_progress", "save_progress_url", "forget_progress")
__all__ = ["Lesson", "catalog", "number_word", "render_lesson", "keep_widget_state", "sync_progress_url",
           "show_progress_error", "lesson_progress", "progress_code", "restore_progress", "save_progress_url",
           "forget_progress"]


def __getattr__(name: str):
    if name in _RENDER_API:
        from . import render

        return getattr(render, name)
    raise AttributeError(f"module 'lessons' has no attribute {name!r}")


LESSONS_DIR = Path(__file__).resolve().parent
_NAME = re.compile(r"^l(\d+)_([a-z0-9_]+)\.md$")


@dataclass(frozen=True)
class Lesson:
    """One lesson: its number (order), slug (module and URL name), title, reading time (minutes), the
    Playground settings its "open in the Playground" button loads, and its Markdown body."""

    number: int
    slug: str
    title: str
    minutes: str
    playground: dict = field(default_factory=dict)
    body: str = ""
    short: str = ""  # the navigation label (default: the title)

    @property
    def nav_title(self) -> str:
        return self.short or self.title

    @property
    def exercise_ids(self) -> list[str]:
        """The ids of the lesson's questions, in reading order (from its markers; tests check they match the
        module's ``exercises``)."""
        from .text import split_body

        return [value for kind, value in split_body(self.body) if kind == "exercise"]

    @property
    def module_name(self) -> str:
        return f"lessons.{self.slug}"

    @property
    def page_path(self) -> str:
        """The page script, relative to the repository root (where app.py is)."""
        return f"lessons/{self.slug}.py"

    @property
    def url_path(self) -> str:
        return f"lesson-{self.number}"


def parse_front_matter(text: str, source: str) -> tuple[dict, str]:
    """Split ``---``-delimited ``key: value`` lines from the body. Raises ValueError naming the file."""
    if not text.startswith("---\n"):
        raise ValueError(f"{source}: a lesson starts with a '---' front-matter block")
    head, sep, body = text[4:].partition("\n---\n")
    if not sep:
        raise ValueError(f"{source}: the front-matter block is not closed with '---'")
    meta = {}
    for line in head.splitlines():
        if line.strip():
            key, colon, value = line.partition(":")
            if not colon:
                raise ValueError(f"{source}: front-matter line {line!r} is not 'key: value'")
            meta[key.strip()] = value.strip()
    return meta, body


def _playground(value: str) -> dict:
    """``preset [key=value ...]``, e.g. ``single block_size=16 num_blocks=32``."""
    preset, *pairs = value.split()
    out: dict = {"preset": preset}
    for pair in pairs:
        key, _, v = pair.partition("=")
        out[key] = int(v) if v.lstrip("-").isdigit() else v
    return out


def load_lesson(path: Path) -> Lesson:
    match = _NAME.match(path.name)
    if not match:
        raise ValueError(f"{path.name}: lesson files are named l<number>_<name>.md")
    meta, body = parse_front_matter(path.read_text(encoding="utf-8"), path.name)
    for key in ("title", "minutes", "playground"):
        if key not in meta:
            raise ValueError(f"{path.name}: front matter lacks {key!r}")
    return Lesson(int(match.group(1)), path.stem, meta["title"], meta["minutes"], _playground(meta["playground"]),
                  body, meta.get("short", ""))


def catalog() -> list[Lesson]:
    """Every lesson under ``lessons/``, in order of its number."""
    return sorted((load_lesson(p) for p in LESSONS_DIR.glob("l*_*.md")), key=lambda l: l.number)


_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_word(n: int) -> str:
    """``n`` in words for a count in a sentence ("ten", "eleven", "twenty-one"); digits from 100 on."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a count must be a non-negative integer, got {n!r}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + (f"-{_ONES[n % 10]}" if n % 10 else "")
    return f"{n:,}"
