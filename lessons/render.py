"""Streamlit rendering of a lesson: its Markdown, predict-then-reveal exercises, widgets, progress, and the
buttons to the Playground and the next lesson. A lesson page calls ``render_lesson(__file__)``."""

from __future__ import annotations

import importlib
from pathlib import Path

import streamlit as st

from engine import EMBEDDED_MODEL

from . import Lesson, catalog
from .common import LessonContext
from .exercise import Exercise, format_value
from .text import fill, split_body

PROGRESS = "lesson_progress"  # session_state: "slug:exercise id" -> {"raw": answer, "correct": bool}


@st.cache_resource(show_spinner="Running the engine...", max_entries=128)
def _cached(key: str, args: tuple, _fn):
    return _fn(*args)


def _memo(fn, *args):
    """``fn(*args)`` cached for every session (lesson runs are deterministic: same arguments, same run)."""
    key = getattr(fn, "key", None) or f"{fn.__module__}.{fn.__qualname__}"
    return _cached(key, args, fn)


def context() -> LessonContext:
    from ui.state import shared_model

    return LessonContext(loaded=shared_model(EMBEDDED_MODEL), memo=_memo, state=st.session_state)


def progress() -> dict:
    return st.session_state.setdefault(PROGRESS, {})


def lesson_progress(lesson: Lesson, exercise_ids) -> tuple[int, int]:
    """(answered, right) for a lesson's exercises in this session."""
    done = [progress()[f"{lesson.slug}:{i}"] for i in exercise_ids if f"{lesson.slug}:{i}" in progress()]
    return len(done), sum(d["correct"] for d in done)


# ---------------------------------------------------------------------------------------------- exercise
def _answer_input(ex: Exercise, key: str):
    if ex.kind == "choice":
        return st.radio("Your answer", ex.options, index=None, key=f"in-{key}")
    placeholder = {"number": "a number" + (f" ({ex.unit})" if ex.unit else ""),
                   "list": "numbers in order, e.g. 0, 2", "set": "numbers in any order, e.g. 3, 5 (or: none)"}
    return st.text_input("Your answer", key=f"in-{key}", placeholder=placeholder[ex.kind])


def predict(slug: str, ex: Exercise, reveal=None, ctx: LessonContext | None = None) -> None:
    """Ask ``ex``; once the learner commits an answer, show the engine's answer, the explanation and the
    ``reveal(ctx)`` drawing (the engine's state after the step in question)."""
    key = f"{slug}:{ex.id}"
    with st.container(border=True):
        st.markdown(f":material/psychology_alt: **Predict.** {ex.question}")
        entry = progress().get(key)
        if entry is None:
            slot = st.empty()  # the form lives here, so it can vanish in the run that commits the answer
            with slot.form(f"predict-{key}", border=False):
                answer = _answer_input(ex, key)
                committed = st.form_submit_button("Commit my answer and run the engine", type="primary")
            if committed:
                if answer is None or (isinstance(answer, str) and not answer.strip()):
                    st.warning("Commit an answer first: a guess is fine, it is what makes the reveal stick.")
                else:
                    try:
                        verdict = ex.check(answer)
                    except ValueError as exc:
                        st.error(f"Could not read your answer: {exc}")
                    else:
                        progress()[key] = entry = {"raw": answer, "correct": verdict.correct}
                        slot.empty()
        if entry is not None:
            verdict = ex.check(entry["raw"])
            shown = format_value(ex.parse(entry["raw"]), ex.unit)
            (st.success if verdict.correct else st.error)(f"You said **{shown}**. {verdict.message}")
            if ex.explanation:
                st.markdown(ex.explanation)
            if reveal is not None:
                reveal(ctx)
            if st.button("Try again", key=f"again-{key}", help="Forget this answer and predict again"):
                del progress()[key]
                st.rerun()


def gate_open(slug: str, ids: list[str]) -> bool:
    """True once the exercises ``ids`` are answered (or the reader chose to skip); else say what to do."""
    shown = st.session_state.setdefault("lesson_shown", set())
    missing = [i for i in ids if f"{slug}:{i}" not in progress()]
    gate = f"{slug}:{' '.join(ids)}"
    if not missing:
        shown.add(gate)  # once opened, a gate stays open (also after "Try again")
    if gate in shown:
        return True
    with st.container(border=True):
        st.info(f"Commit your {'answer' if len(missing) == 1 else f'{len(missing)} answers'} above to go on: the "
                "rest of the lesson shows what the engine did.", icon=":material/lock:")
        if st.button("Show the rest without predicting", key=f"skip-{gate}", type="tertiary",
                     help="For teachers presenting the lesson, or a second reading"):
            shown.add(gate)
            st.rerun()
    return False


# ------------------------------------------------------------------------------------------------ page
def open_in_playground(lesson: Lesson) -> None:
    from ui.state import build_lab, preset_settings

    if build_lab(preset_settings(**lesson.playground)):
        st.session_state["playing"] = False
        st.switch_page("ui/playground.py")
    st.error(f"Could not open the Playground: {st.session_state.get('lab_error')}")


def render_lesson(page_file: str) -> None:
    slug = Path(page_file).stem
    lessons = catalog()
    index = next(i for i, l in enumerate(lessons) if l.slug == slug)
    lesson = lessons[index]
    module = importlib.import_module(lesson.module_name)
    ctx = context()
    exercises = module.exercises(ctx)
    facts = module.facts(ctx)

    st.title(f"Lesson {lesson.number}: {lesson.title}")
    header = st.container()  # filled last, so it counts the answer committed in this run
    for kind, value in split_body(lesson.body):
        if kind == "text":
            st.markdown(fill(value, facts))
        elif kind == "exercise":
            predict(slug, exercises[value], getattr(module, f"reveal_{value}", None), ctx)
        elif kind == "widget":
            getattr(module, f"widget_{value}")(ctx)
        elif not gate_open(slug, value.split()):
            break

    answered, right = lesson_progress(lesson, exercises)
    with header:
        st.caption(f"Lesson {index + 1} of {len(lessons)} · about {lesson.minutes} minutes · "
                   f"{answered} of {len(exercises)} predictions made, {right} right")
        st.progress(answered / len(exercises) if exercises else 1.0)

    st.divider()
    c = st.columns(3)
    if c[0].button("Open this in the Playground", type="primary", icon=":material/play_circle:",
                   help=f"Loads the '{lesson.playground['preset']}' preset there, to step it freely"):
        open_in_playground(lesson)
    if index > 0:
        c[1].page_link(lessons[index - 1].page_path, label=f"Previous: {lessons[index - 1].nav_title}",
                       icon=":material/arrow_back:")
    if index + 1 < len(lessons):
        c[2].page_link(lessons[index + 1].page_path, label=f"Next: {lessons[index + 1].nav_title}",
                       icon=":material/arrow_forward:")
    else:
        c[2].page_link("ui/lessons.py", label="All lessons", icon=":material/school:")
