"""The lessons' overview: every lesson in order with this session's progress and a link to it."""

import streamlit as st

from engine import EMBEDDED_MODEL
from lessons import catalog
from lessons.render import FIRST, PROGRESS, SHOWN, lesson_progress
from lessons.runs import preload_model

preload_model(EMBEDDED_MODEL)  # in the background while the learner reads: the lessons find the model loaded

st.title("Lessons")
st.markdown(
    "Six short lessons on how a language-model server keeps its KV cache in memory, taught on the same "
    "engine the Playground runs. Each lesson asks you to **predict** what the engine will do before it "
    "runs, then shows what it did. Go in order; each takes 5 to 15 minutes. Your answers are kept for "
    "this browser tab's session only: a reload starts afresh."
)
lessons = catalog()
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
if st.button("Forget my answers", help="Clear every prediction made in this session"):
    st.session_state[PROGRESS] = {}
    st.session_state[FIRST] = {}
    st.session_state[SHOWN] = set()  # lock the hidden parts again, for the next learner
    st.rerun()
