"""Streamlit rendering of a lesson: its Markdown, predict-then-reveal exercises, widgets, progress, and the
buttons to the Playground and the next lesson. A lesson page calls ``render_lesson(__file__)``."""

from __future__ import annotations

import importlib
from pathlib import Path

import streamlit as st

from engine import EMBEDDED_MODEL
from infra.runs import LESSON_RUNS, ProgressBox, preload_model, shared_model  # app infrastructure (not a page)
from infra.keys import OPEN_PRESET  # the Playground opens the preset a lesson leaves there

from . import Lesson, catalog
from .common import LessonContext, reporting
from .exercise import Exercise, format_answer
from .progress import MAX_ANSWER_CHARS, SavedProgress, decode, describe_code, encode
from .recap import answer_rows, recap_html, recap_markdown, takeaways
from .text import fill, split_body

PROGRESS = "lesson_progress"  # session_state: "slug:exercise id" -> {"raw": answer, "correct": bool}
FIRST = "lesson_first_try"  # session_state: "slug:exercise id" -> the first committed answer was right
SHOWN = "lesson_shown"  # session_state: slugs of lessons shown whole, without predicting
KEEP = "keep_"  # widgets whose key starts with this keep their value while the learner is on another page
URL_PARAM = "progress"  # the page URL's query parameter holding the progress code (lessons/progress.py)
RESTORED = "lesson_progress_restored"  # session_state: the URL's code was read (once per session)
PROGRESS_ERROR = "lesson_progress_error"  # session_state: why the URL's code was not restored (shown until answered)


def keep(**defaults) -> None:
    """Give ``keep_*`` widget keys their first value (the widgets then take no default of their own)."""
    for key, value in defaults.items():
        st.session_state.setdefault(key, value)


def keep_widget_state() -> None:
    """Called by app.py on every page: Streamlit forgets a widget's value once a run does not draw it;
    writing the value back makes it plain session state, which survives until the widget is drawn again."""
    for key in [k for k in st.session_state if isinstance(k, str) and k.startswith(KEEP)]:
        st.session_state[key] = st.session_state[key]


_MISSING = object()
RUNS_TITLE = "Running the engine for this lesson (once per server start; later visits reuse its runs)"


def _memo_key(fn, args: tuple) -> tuple:
    """Everything that decides a lesson run: the function, its arguments and the model (the runs are
    deterministic: the same key, the same records)."""
    return (EMBEDDED_MODEL, getattr(fn, "key", None) or f"{fn.__module__}.{fn.__qualname__}", args)


def memo_for(box: ProgressBox):
    """A ``LessonContext.memo``: ``fn(*args)`` computed once per process for every session
    (``infra.runs.LESSON_RUNS``), its engine steps shown in ``box`` while it runs."""

    def memo(fn, *args):
        key = _memo_key(fn, args)
        kept = LESSON_RUNS.peek(key, _MISSING)
        if kept is not _MISSING:
            return kept
        getattr(fn, "prepare", lambda: None)()  # the model, loaded here: its progress is drawn by this thread

        def compute(report):  # in RunCache's worker thread: no drawing
            with reporting(report):
                return fn(*args)
        return LESSON_RUNS.get(key, compute, on_progress=box)
    return memo


def context(where=None) -> tuple[LessonContext, ProgressBox]:
    """The lesson's engine context: the process-wide shared model (``infra.runs.shared_model``, the same
    copy the Playground's sessions use; loaded when the lesson first needs it) and the cross-session run
    cache; and the box (in ``where``) that shows the engine's progress while a run is not cached yet."""
    box = ProgressBox(RUNS_TITLE, where)
    return LessonContext(memo=memo_for(box), loader=lambda: shared_model(EMBEDDED_MODEL, where)), box


def progress() -> dict:
    return st.session_state.setdefault(PROGRESS, {})


def first_tries() -> dict:
    """"slug:exercise id" -> whether the first answer committed for it was right (kept through "Try again")."""
    return st.session_state.setdefault(FIRST, {})


def saved_progress() -> SavedProgress:
    return SavedProgress(dict(progress()), dict(first_tries()), set(whole_lessons()))


def restore_progress(code: str) -> None:
    """Replace this session's progress with the one in ``code``. Raises ValueError saying what is wrong with
    the code (the session's progress is then left as it was)."""
    saved = decode(code)
    st.session_state[PROGRESS], st.session_state[FIRST] = saved.answers, saved.first
    st.session_state[SHOWN] = saved.shown


def progress_code() -> tuple[str, str]:
    """(this session's progress code, "") or ("", why there is none: nothing answered yet, or the reason a
    code would be too long for a URL)."""
    saved = saved_progress()
    if not saved:
        return "", "Nothing answered yet: your code appears here after your first prediction."
    try:
        return encode(saved), ""
    except ValueError as exc:
        return "", str(exc)


def save_progress_url() -> None:
    """Keep the progress code in the page's URL, so a reload or a bookmark resumes; none while nothing is
    answered. A code too long for a URL is left out (the progress then lasts for the session only)."""
    code, _ = progress_code()
    if not code:
        if URL_PARAM in st.query_params:
            del st.query_params[URL_PARAM]
    elif st.query_params.get(URL_PARAM) != code:
        st.query_params[URL_PARAM] = code


def sync_progress_url() -> None:
    """Called by app.py on every page run: the first run of a session with a progress code in its URL (a
    reload, a bookmark) restores it; every run writes the current code back (moving to another page drops
    query parameters)."""
    if not st.session_state.get(RESTORED):
        st.session_state[RESTORED] = True
        code = st.query_params.get(URL_PARAM)
        if code and not saved_progress():
            try:
                restore_progress(code)
            except ValueError as exc:  # said on the lesson pages until the learner answers (show_progress_error)
                st.session_state[PROGRESS_ERROR] = (
                    f"The lesson progress in this page's link could not be restored: {exc} (the code: "
                    f"{describe_code(code)}). The lessons start without saved progress: your answers from now on "
                    f"get a new code (in this page's link, and on the Lessons page).")
    save_progress_url()


def show_progress_error() -> None:
    """On a lesson page and the overview: why the link's progress code was not restored, and that the lessons
    start without it (``sync_progress_url``); shown until the learner's first answer or a loaded code."""
    if saved_progress():
        st.session_state.pop(PROGRESS_ERROR, None)
    elif message := st.session_state.get(PROGRESS_ERROR):
        st.error(message, icon=":material/error:")


def forget_progress() -> None:
    """Forget every prediction made in this session (and lock the lessons shown whole again, for the next
    learner); the page's URL then holds no progress code."""
    st.session_state[PROGRESS] = {}
    st.session_state[FIRST] = {}
    st.session_state[SHOWN] = set()
    save_progress_url()


def lesson_progress(lesson: Lesson, exercise_ids) -> tuple[int, int, int]:
    """(answered, right, right at the first try) for a lesson's exercises in this session."""
    keys = [f"{lesson.slug}:{i}" for i in exercise_ids]
    answered = [k for k in keys if k in progress()]
    return (len(answered), sum(progress()[k]["correct"] for k in answered),
            sum(first_tries().get(k, False) for k in answered))


def score_line(answered: int, total: int, right: int, first: int) -> str:
    line = f"{answered} of {total} predictions made, {right} right"
    return line + (f" ({first} at the first try)" if first != right else "")


# ---------------------------------------------------------------------------------------------- exercise
def _answer_input(ex: Exercise, key: str):
    if ex.kind == "choice":
        return st.radio("Your answer", ex.options, index=None, key=f"in-{key}")
    placeholder = {"number": "a number" + (f" ({ex.unit})" if ex.unit else ""),
                   "list": "whole numbers in order, separated by commas",
                   "set": "whole numbers in any order, separated by commas (or: none)"}
    return st.text_input("Your answer", key=f"in-{key}", placeholder=placeholder[ex.kind])


def predict(slug: str, ex: Exercise, reveal=None, ctx: LessonContext | None = None, later: tuple = ()) -> None:
    """Ask ``ex``; once the learner commits an answer, show the engine's answer, the explanation and the
    ``reveal(ctx)`` drawing (the engine's state after the step in question). "Try again" forgets this answer
    and those of the ``later`` exercises, whose reveals could otherwise give this one away."""
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
                answer = answer.strip() if isinstance(answer, str) else answer
                if answer is None or answer == "":
                    st.warning("Commit an answer first: a guess is fine, it is what makes the reveal stick.")
                elif isinstance(answer, str) and len(answer) > MAX_ANSWER_CHARS:
                    st.error(f"Could not read your answer: it is {len(answer):,} characters long; an answer here "
                             f"is at most {MAX_ANSWER_CHARS}.")
                else:
                    try:
                        verdict = ex.check(answer)
                    except ValueError as exc:
                        st.error(f"Could not read your answer: {exc}")
                    else:
                        progress()[key] = entry = {"raw": answer, "correct": verdict.correct}
                        first_tries().setdefault(key, verdict.correct)
                        save_progress_url()
                        slot.empty()
        if entry is None and slug in whole_lessons():
            with st.expander("The engine's answer (for presenters)"):
                st.markdown(f"**{format_answer(ex.expected, ex.unit)}**")
                if ex.explanation:
                    st.markdown(ex.explanation)
                if reveal is not None:
                    reveal(ctx)
        if entry is not None:
            try:
                verdict = ex.check(entry["raw"])
                shown = format_answer(ex.parse(entry["raw"]), ex.unit)
            except ValueError:  # restored from a code written for an older version of this question
                progress().pop(key, None)
                st.rerun()
            if entry["correct"] != verdict.correct:  # a code's stored verdict is re-checked, not trusted
                entry["correct"] = verdict.correct
                save_progress_url()
            (st.success if verdict.correct else st.error)(f"You said **{shown}**. {verdict.message}")
            if ex.explanation:
                st.markdown(ex.explanation)
            if reveal is not None:
                reveal(ctx)
            if st.button("Try again from here", key=f"again-{key}",
                         help="Forget this answer and the ones after it in this lesson, and predict again"):
                for k in (key, *(f"{slug}:{i}" for i in later)):
                    progress().pop(k, None)
                st.rerun()


def whole_lessons() -> set:
    """Lessons a reader chose to see whole, without predicting (a teacher presenting, a second reading)."""
    return st.session_state.setdefault(SHOWN, set())


def gate(slug: str, ex_id: str) -> bool:
    """Whether the lesson goes on past exercise ``ex_id``; if not, say how to go on."""
    if f"{slug}:{ex_id}" in progress() or slug in whole_lessons():
        return True
    with st.container(border=True):
        st.info("Commit your answer to go on: the rest of the lesson shows what the engine did.",
                icon=":material/lock:")
        if st.button("Show the whole lesson without predicting", key=f"skip-{slug}", type="tertiary",
                     help="For teachers presenting the lesson, or a second reading"):
            whole_lessons().add(slug)
            st.rerun()
    return False


# ------------------------------------------------------------------------------------------------ page
def show_recap(lesson: Lesson, module, facts: dict, exercises: dict[str, Exercise], order: list[str]) -> None:
    """The lesson's one-page recap (``lessons.recap``): its takeaways and every question with both answers,
    shown on the page and offered as an HTML file to print or save."""
    lines = takeaways(module, facts)
    rows = answer_rows(lesson.slug, exercises, order, progress())
    text = recap_markdown(lesson, lines, rows)
    with st.container(border=True):
        st.subheader("Recap", anchor="recap")
        for line in lines:
            st.markdown(f"- {line}")
        st.dataframe([{"#": r["n"], "question": " ".join(r["question"].split()), "you": r["yours"],
                       "the engine": r["engine"], "": r["verdict"]} for r in rows],
                     hide_index=True, width="stretch")
        c = st.columns(2)
        c[0].download_button("Save the recap (HTML, prints on one page)", recap_html(text, f"Lesson {lesson.number} recap"),
                             file_name=f"lesson-{lesson.number}-recap.html", mime="text/html",
                             icon=":material/print:", key=f"recap-html-{lesson.slug}")
        c[1].download_button("Save as Markdown", text, file_name=f"lesson-{lesson.number}-recap.md",
                             mime="text/markdown", icon=":material/download:", key=f"recap-md-{lesson.slug}")


def open_in_playground(lesson: Lesson) -> None:
    """Leave the lesson's preset (its ``playground`` dict: a preset name and settings) for the Playground,
    which builds its lab from it on arrival, and go there. The lessons never import the app's pages."""
    st.session_state[OPEN_PRESET] = dict(lesson.playground)
    st.switch_page("ui/playground.py")


def render_lesson(page_file: str) -> None:
    slug = Path(page_file).stem
    lessons = catalog()
    index = next(i for i, l in enumerate(lessons) if l.slug == slug)
    lesson = lessons[index]
    module = importlib.import_module(lesson.module_name)
    preload_model(EMBEDDED_MODEL)  # in the background: the next lesson finds it loaded, even if this one runs none

    st.title(f"Lesson {lesson.number}: {lesson.title}")
    show_progress_error()  # a bad ?progress= code: what was wrong, and that the lesson starts without it
    header = st.container()  # filled last, so it counts the answer committed in this run
    ctx, box = context(st.container())  # the first visit since the server started shows its runs' progress here
    exercises = module.exercises(ctx)
    facts = module.facts(ctx)
    box.close()
    # One question at a time: the page stops at the first question not yet answered, so nothing below it
    # (text, a widget, the next question's wording) can give its answer away.
    parts = split_body(lesson.body)
    order = lesson.exercise_ids
    for kind, value in parts:
        if kind == "text":
            st.markdown(fill(value, facts))
        elif kind == "widget":
            getattr(module, f"widget_{value}")(ctx)
        else:
            predict(slug, exercises[value], getattr(module, f"reveal_{value}", None), ctx,
                    later=tuple(order[order.index(value) + 1:]))
            if not gate(slug, value):
                break

    box.close()  # a widget or reveal that ran the engine
    answered, right, first = lesson_progress(lesson, exercises)
    if answered == len(exercises) or slug in whole_lessons():
        show_recap(lesson, module, facts, exercises, order)
    with header:
        st.caption(f"Lesson {index + 1} of {len(lessons)} · about {lesson.minutes} minutes · "
                   + score_line(answered, len(exercises), right, first))
        st.progress(answered / len(exercises) if exercises else 1.0)

    st.divider()
    c = st.columns([1.3, 1, 1.7])
    if c[0].button("Open this in the Playground", type="primary", icon=":material/play_circle:",
                   help=f"Loads the '{lesson.playground['preset']}' preset there, to step it freely"):
        open_in_playground(lesson)
    if index > 0:
        c[1].page_link(lessons[index - 1].page_path, label="Previous lesson", icon=":material/arrow_back:")
    if index + 1 < len(lessons):
        c[2].page_link(lessons[index + 1].page_path, label=f"Next: {lessons[index + 1].nav_title}",
                       icon=":material/arrow_forward:")
    else:
        c[2].page_link("ui/lessons.py", label="All lessons", icon=":material/school:")
