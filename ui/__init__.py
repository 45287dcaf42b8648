"""The Streamlit app's pages and the session-level ``Lab`` that drives the engines for them."""
