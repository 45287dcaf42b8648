"""The app's infrastructure that the ``ui`` pages and the lessons share, and neither owns: no page, no lesson.

- ``infra.runs``: the shared model loaded once per process, finished runs kept once for every session
  (``RunCache``: the lessons' and Compare's), and the progress box a page shows while either happens;
- ``infra.class_limits``: the class server's policy (caps, models, memory shares), read where the app or a
  lesson builds engines, never inside the engine;
- ``infra.keys``: the session-state keys one page or lesson leaves for another (``OPEN_PRESET``).

The flow is one way: ``engine`` -> ``viz`` -> the lessons -> the ``ui`` pages, and both the lessons and the
pages import from here; this package imports only ``engine`` (and Streamlit), never ``ui`` or ``lessons``
(tests/test_app_state_imports.py), so the lessons and the pages form no cycle.
"""
