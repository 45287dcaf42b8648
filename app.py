"""Paged Attention Lab: the Streamlit app's entry point (page navigation only).

    streamlit run app.py      (or: bash scripts/run.sh)
"""

import streamlit as st

st.set_page_config(page_title="Paged Attention Lab", page_icon=":material/grid_view:", layout="wide")

pages = [
    st.Page("ui/playground.py", title="Playground", icon=":material/play_circle:", default=True),
    st.Page("ui/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("ui/lessons.py", title="Lessons", icon=":material/school:"),
    st.Page("ui/model_info.py", title="Model", icon=":material/memory:"),
]
st.navigation(pages).run()
