"""Write one benchmark's Markdown into its own section of docs/benchmarks.md.

Each benchmark owns the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; rerunning it
replaces only that section, so results of different machines (a CPU laptop, a GPU) live side by side.
"""

from __future__ import annotations

from pathlib import Path


def write_section(path: str | Path, name: str, text: str) -> None:
    """Replace (or append) section ``name`` of the Markdown file at ``path`` with ``text``."""
    path = Path(path)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if start in old and end in old:
        head, rest = old.split(start, 1)
        _, tail = rest.split(end, 1)
        new = head + block + tail.lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
