import streamlit as st

st.title("Lessons")
st.info("The self-paced lessons (the KV cache and its size, contiguous waste, blocks and block tables, "
        "sharing and copy-on-write, running out of memory, when paging matters) are coming in a later "
        "release. Meanwhile the Playground's presets step through each idea on the real model.")
