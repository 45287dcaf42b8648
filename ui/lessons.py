"""The lessons' overview: every lesson in order with this session's progress and a link to it."""

import streamlit as st

from engine import EMBEDDED_MODEL
from lessons import (catalog, forget_progress, lesson_progress, number_word, progress_code, restore_progress,
                     save_progress_url, show_progress_error)
from infra.runs import preload_model

preload_model(EMBEDDED_MODEL)  # in the background while the learner reads: the lessons find the model loaded

st.title("Lessons")
show_progress_error()  # a bad ?progress= code in the link: what was wrong, and that the lessons start without it
lessons = catalog()
st.markdown(
    f"{number_word(len(lessons)).capitalize()} short lessons on how a language-model server keeps its KV "
    "cache in memory, taught on the same engine the Playground runs. Each lesson asks you to **predict** what "
    "the engine will do before it runs, then shows what it did. Go in order; each takes 8 to 16 minutes. "
    "Your answers are kept in this page's link: a reload or a bookmark resumes where you were."
)
total_answered = total = 0
for lesson in lessons:
    ids = lesson.exercise_ids  # from the text: the overview runs no engine
    answered, right, first = lesson_progress(lesson, ids)
    total_answered, total = total_answered + answered, total + len(ids)
    with st.container(border=True):
        c1, c2 = st.columns([3, 1], vertical_alignment="center")
        c1.page_link(lesson.page_path, label=f"**{lesson.number}. {lesson.title}**", icon=":material/menu_book:")
        c1.caption(f"about {lesson.minutes} minutes · {len(ids)} predictions")
        status = "not started" if answered == 0 else "done" if answered == len(ids) else "in progress"
        c2.progress(answered / len(ids) if ids else 0.0, text=f"{status}: {answered}/{len(ids)}, {right} right"
                    + (f" ({first} at the first try)" if first != right else ""))
st.progress(total_answered / total if total else 0.0, text=f"All lessons: {total_answered} of {total} predictions made")
with st.expander("Continue on another browser: your progress code"):
    code, why_none = progress_code()
    if code:
        st.caption("Copy this code (it is also in this page's link) and paste it below on the other browser.")
        st.code(code, language=None, wrap_lines=True)
    else:
        st.caption(why_none)
    with st.form("load-progress", border=False):
        pasted = st.text_input("Paste a progress code", placeholder="the code from another browser")
        if st.form_submit_button("Load it (replaces the answers in this browser)"):
            try:
                restore_progress(pasted)
            except ValueError as exc:
                st.error(f"Could not load that code: {exc}.")
            else:
                save_progress_url()
                st.rerun()
if st.button("Forget my answers", help="Clear every prediction made in this session"):
    forget_progress()  # also locks the hidden parts again, for the next learner
    st.rerun()
