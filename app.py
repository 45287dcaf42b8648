"""Paged Attention Lab: the Streamlit app's entry point (page navigation only).

    streamlit run app.py      (or: bash scripts/run.sh)

The lesson pages come from ``lessons.catalog()``: adding a lesson under ``lessons/`` adds its page here.
"""

import streamlit as st

from engine.threads import configure_gc, configure_threads
from lessons import catalog
from lessons.render import keep_widget_state
from lessons.runs import preload_model

configure_gc()  # fewer garbage collections per step (engine/threads.py)
configure_threads("app")  # one intra-op thread per step: sessions step at once (engine/threads.py)
preload_model()  # the embedded model loads in the background from the server's first page view, once per process
st.set_page_config(page_title="Paged Attention Lab", page_icon=":material/grid_view:", layout="wide")

pages = {
    "Explore": [
        st.Page("ui/playground.py", title="Playground", icon=":material/play_circle:", default=True),
        st.Page("ui/compare.py", title="Compare", icon=":material/compare_arrows:"),
        st.Page("ui/model_info.py", title="Model", icon=":material/memory:"),
        st.Page("ui/server.py", title="Server", icon=":material/dns:"),
    ],
    "Lessons": [st.Page("ui/lessons.py", title="All lessons", icon=":material/school:")] + [
        st.Page(lesson.page_path, title=f"{lesson.number}. {lesson.nav_title}", url_path=lesson.url_path)
        for lesson in catalog()
    ],
}
keep_widget_state()  # the lessons' explore widgets keep their values across pages
st.navigation(pages).run()
