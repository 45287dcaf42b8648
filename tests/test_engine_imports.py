"""The engine stands alone (issue 24, item 5; DESIGN.md "one direction of flow"): no module under ``engine/``
imports another package of this project except ``kernels``. Deployment policy (a class server's caps, its
model list) is the app's (``infra/class_limits.py``), read where the app builds engines, never inside them.
Read from the source with ``ast``, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"engine", "kernels"}


def project_packages() -> set[str]:
    """The project's own top-level packages and modules (a folder with Python files, or a .py file)."""
    names = {p.stem for p in ROOT.glob("*.py")}
    names |= {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
              and any(p.glob("*.py"))}
    return names


def engine_imports() -> list[tuple[str, int, str]]:
    """(file, line, imported top-level name) of every absolute import under engine/."""
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [(str(path.relative_to(ROOT)), node.lineno, n.split(".")[0]) for n in names]
    return found


def test_the_engine_imports_no_other_project_package_but_kernels():
    project = project_packages()
    assert {"engine", "kernels", "ui", "viz", "lessons"} <= project  # the check sees the project's packages
    bad = [f"{f}:{line} imports {name}" for f, line, name in engine_imports()
           if name in project and name not in ALLOWED]
    assert not bad, "engine/ imports the app's packages:\n" + "\n".join(bad)
