"""The app's page list is read from app.py (tests/test_app.py's ``PAGES``), not written again: a fast check, apart
from test_app.py, whose every other test runs a Streamlit page (the slow tier)."""

from __future__ import annotations

from pathlib import Path

from test_app import APP, PAGES, app_pages


def test_pages_are_the_list_app_py_navigates():
    """``PAGES`` is read from app.py, not written again here (a copy had drifted: it lacked the Class page)."""
    literal_pages = Path(APP).read_text(encoding="utf-8").count("st.Page(\"")
    assert PAGES == app_pages() and len(PAGES) == literal_pages, (PAGES, literal_pages)
    assert "ui/classroom.py" in PAGES and "ui/lessons.py" in PAGES
    assert all((Path(APP).parent / page).is_file() for page in PAGES)
