"""Write tests/file_durations.json (seconds per test file) from a whole run's JUnit XML, so the suite hands the
longest files to its workers first (tests/conftest.py):

    bash scripts/test.sh --junitxml=/tmp/suite.xml
    .venv/bin/python scripts/test_durations.py /tmp/suite.xml

A file's seconds are the sum of its test cases' ``time`` (pytest's JUnit ``time`` of a test is its setup, call
and teardown by default, so a module fixture's start is counted in its file's first test). Skipped tests count
what they took. Rerun it when a file's cost changes a lot; a file it does not list is estimated from what its
tests need.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "file_durations.json"


def file_seconds(junit_xml: str | Path) -> dict[str, float]:
    """Seconds per test file (``tests/test_x.py``), from a pytest JUnit XML report.

    Raises:
        ValueError: the report holds no test case (not a pytest JUnit report, or an empty run).
    """
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # classname is "tests.test_x" or "tests.test_x.TestClass": the file is its first two parts
        parts = case.get("classname", "").split(".")
        if len(parts) < 2 or not parts[1].startswith("test_"):
            continue
        seconds[f"{parts[0]}/{parts[1]}.py"] += float(case.get("time") or 0.0)
    if not seconds:
        raise ValueError(f"{junit_xml}: no test case of a tests/test_*.py file in this JUnit report")
    return dict(seconds)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = {f: round(s, 1) for f, s in sorted(file_seconds(argv[0]).items(), key=lambda kv: -kv[1])}
    OUT.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(table)} files, {sum(table.values()):,.0f} s of tests in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
