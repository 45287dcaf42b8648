"""Paged Attention Lab: the Streamlit app's entry point (page navigation only).

    streamlit run app.py      (or: bash scripts/run.sh)

The lesson pages come from ``lessons.catalog()``: adding a lesson under ``lessons/`` adds its page here.
"""

import sys
from pathlib import Path

import streamlit as st

# A local PNG, served by this server: a ":material/..." page icon makes the browser fetch the favicon from
# fonts.gstatic.com (Streamlit's frontend builds that URL), which fails on an offline class server.
FAVICON = str(Path(__file__).resolve().parent / "assets" / "favicon.png")
st.set_page_config(page_title="Paged Attention Lab", page_icon=FAVICON, layout="wide")
# The placeholder is drawn on every run, empty after the first: an element only the first run drew would shift
# every element after it, and Streamlit would mount them afresh on the second run (the stage's key counter
# among them, losing the presses made meanwhile).
starting = st.empty()
if "torch" not in sys.modules:  # the server's first page view: importing PyTorch and the engine takes seconds
    starting.info("Starting the lab: importing PyTorch and the engine (once per server start, a few seconds on "
                  "2 cores)...", icon=":material/hourglass_top:")

from engine.threads import configure_gc, configure_threads  # noqa: E402  (after the note above is drawn)
from lessons import catalog, keep_widget_state, sync_progress_url  # noqa: E402
from infra.runs import preload_model  # noqa: E402
from ui.class_server import keep_session  # noqa: E402

starting.empty()
configure_gc()  # fewer garbage collections per step (engine/threads.py)
configure_threads("app")  # one intra-op thread per step: sessions step at once (engine/threads.py)
preload_model()  # the embedded model loads in the background from the server's first page view, once per process
keep_session()  # a class server (PAL_CLASS_SERVER=1): touch this session, release idle sessions' labs

pages = {
    "Explore": [
        st.Page("ui/playground.py", title="Playground", icon=":material/play_circle:", default=True),
        st.Page("ui/compare.py", title="Compare", icon=":material/compare_arrows:"),
        st.Page("ui/model_info.py", title="Model", icon=":material/memory:"),
        st.Page("ui/server.py", title="Server", icon=":material/dns:"),
        st.Page("ui/classroom.py", title="Class", icon=":material/groups:"),
    ],
    "Lessons": [st.Page("ui/lessons.py", title="All lessons", icon=":material/school:")] + [
        st.Page(lesson.page_path, title=f"{lesson.number}. {lesson.nav_title}", url_path=lesson.url_path)
        for lesson in catalog()
    ],
}
keep_widget_state()  # the lessons' explore widgets keep their values across pages
sync_progress_url()  # lesson progress: restored from the URL after a reload, written back on every page
st.navigation(pages).run()
