"""A lesson's one-page recap (no Streamlit here): its takeaways (the module's ``RECAP``, filled with the
figures the engine computed) and every question with the learner's answer and the engine's, as Markdown for
the page and as one self-contained HTML file to print or save."""

from __future__ import annotations

import html
import re
from datetime import date

from markdown_it import MarkdownIt

from . import Lesson
from .exercise import Exercise, format_answer
from .text import fill


def takeaways(module, facts: dict) -> list[str]:
    """The lesson module's ``RECAP`` sentences with their ``{{ figure }}`` fields filled (``[]`` if it has none).
    Raises KeyError naming a field the module did not compute."""
    return [fill(line, facts) for line in getattr(module, "RECAP", [])]


def answer_rows(slug: str, exercises: dict[str, Exercise], order: list[str], answers: dict) -> list[dict]:
    """One row per question in reading order: its text, the learner's answer as shown (or "not answered"),
    the engine's answer, and the verdict (the slip's name when a wrong answer matched one)."""
    rows = []
    for i, ex_id in enumerate(order, 1):
        ex = exercises[ex_id]
        entry = answers.get(f"{slug}:{ex_id}")
        mine, verdict = "not answered", ""
        if entry is not None:
            try:
                mine = format_answer(ex.parse(entry["raw"]), ex.unit)
                v = ex.check(entry["raw"])
                verdict = "right" if v.correct else ("wrong: " + v.slip if v.slip else "wrong")
            except ValueError:  # a code from an older version of the lesson
                mine, verdict = str(entry["raw"]), "no longer readable"
        rows.append({"n": i, "question": plain(ex.question), "yours": mine,
                     "engine": format_answer(ex.expected, ex.unit), "verdict": verdict})
    return rows


def plain(markdown: str) -> str:
    """A question's Markdown as one line of plain text for the recap's table (no ``**``, ``*emphasis*``,
    backticks or line breaks)."""
    text = re.sub(r"\*\*|__|`", "", markdown)
    text = re.sub(r"(?<![\w*])\*(?=\S)(.+?)(?<=\S)\*(?![\w*])", r"\1", text)  # *emphasis*, not 2 * 3
    return " ".join(text.split())


def recap_markdown(lesson: Lesson, lines: list[str], rows: list[dict]) -> str:
    """The recap as Markdown: title, takeaways, then each question with both answers."""
    out = [f"# Lesson {lesson.number}: {lesson.title}: recap", "", "## What to remember", ""]
    out += [f"- {line}" for line in lines] or ["- (this lesson has no takeaways listed)"]
    out += ["", "## Your predictions and the engine's answers", ""]
    for r in rows:
        question = " ".join(r["question"].split())
        out.append(f"{r['n']}. {question}  \n   You: **{r['yours']}**"
                   + (f" ({r['verdict']})" if r["verdict"] else "") + f" · the engine: **{r['engine']}**")
    return "\n".join(out) + "\n"


_STYLE = """body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:46rem;margin:2rem auto;
padding:0 1rem;line-height:1.45;color:#111}h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:1.6rem}
li{margin:.35rem 0}footer{margin-top:2rem;color:#555;font-size:.85rem}@media print{body{margin:0}}"""


def recap_html(markdown: str, title: str, when: date | None = None) -> str:
    """``markdown`` as one self-contained HTML page (no scripts, fonts or links to fetch), ready to print."""
    body = MarkdownIt("commonmark", {"html": False}).render(markdown)  # raw HTML in answers is escaped
    stamp = (when or date.today()).isoformat()
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}<footer>Paged Attention Lab · {stamp}</footer>"
            "</body></html>\n")
