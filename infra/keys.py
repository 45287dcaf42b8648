"""Session-state keys that one page or lesson leaves for another (plain strings, no Streamlit here)."""

OPEN_PRESET = "open_preset"  # session_state: a lesson's playground dict, which the Playground opens and drops
