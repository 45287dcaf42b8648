"""The app's pages reach the lessons through their public API only (issue 24, item 4): every ``ui`` module
imports from the ``lessons`` package nothing but the names ``lessons/__init__.py`` exports (its ``__all__``),
and no submodule of it (``lessons.render``, ``lessons.runs``, ...). The app infrastructure the lessons use
(the shared model, the run caches, the progress box, the class server's limits, the session keys) lives in
``infra/``, which the pages and the lessons both import: the lessons import nothing from ``ui``.
Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lessons_api() -> set[str]:
    """The names ``lessons/__init__.py`` lists in ``__all__`` (read from its source)."""
    tree = ast.parse((ROOT / "lessons" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def lessons_imports(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every import of the ``lessons`` package or its submodules in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "lessons":
                found += [(node.lineno, f"lessons.{a.name}") for a in node.names]
            elif node.module.startswith("lessons."):
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name == "lessons" or a.name.startswith("lessons.")]
    return found


def test_lessons_exports_a_public_api():
    api = lessons_api()
    assert {"catalog", "render_lesson"} <= api, sorted(api)


def test_ui_modules_import_only_the_lessons_public_api():
    api = {f"lessons.{name}" for name in lessons_api()}
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in sorted((ROOT / "ui").glob("*.py"))
           for line, what in lessons_imports(path) if what not in api]
    assert not bad, "ui modules import lessons internals (not in lessons/__init__.py's __all__):\n" + "\n".join(bad)


def test_the_lessons_import_no_ui_page():
    """Lessons never import a page (a script that draws when imported): the ``ui`` pages app.py registers
    (``st.Page("ui/...")``). (Nor any other ``ui`` module: ``test_the_lessons_import_nothing_from_ui``.)"""
    import re

    pages = {f"ui.{name}" for name in re.findall(r'st\.Page\("ui/(\w+)\.py"', (ROOT / "app.py").read_text())}
    assert "ui.playground" in pages and "ui.lessons" in pages, pages
    bad = []
    for path in sorted((ROOT / "lessons").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "ui":
                names = [f"ui.{a.name}" for a in node.names]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n in pages]
    assert not bad, "\n".join(bad)


def test_the_lessons_import_nothing_from_ui():
    """The flow is one way (pages show lessons; lessons use engine, viz and the app's infrastructure in
    ``infra/``): no module of ``lessons/`` imports the ``ui`` package or any of its modules, so the two
    packages form no cycle (issue 24's review: lessons/common.py and lessons/render.py imported ``infra.runs``,
    ``ui.state`` and ``infra.class_limits`` while ``ui/lessons.py`` and app.py import the lessons)."""
    bad = []
    for path in sorted((ROOT / "lessons").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n == "ui" or n.startswith("ui.")]
    assert not bad, "lessons import ui:\n" + "\n".join(bad)
