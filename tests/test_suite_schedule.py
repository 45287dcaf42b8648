"""The suite's schedule: the longest test files start first on scripts/test.sh's xdist workers (measured seconds
per file in tests/file_durations.json, written by scripts/test_durations.py), and xdist keeps that order."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from conftest import FILE_DURATIONS, _measured_seconds

ROOT = Path(__file__).resolve().parent.parent


def _load_durations_script():
    spec = importlib.util.spec_from_file_location("test_durations_script", ROOT / "scripts" / "test_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_junit_times_are_summed_per_file(tmp_path):
    xml = tmp_path / "suite.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="1.5"/>'
        '<testcase classname="tests.test_a.TestGroup" name="t2" time="2.0"/>'
        '<testcase classname="tests.test_b" name="t3" time="0.25"><skipped/></testcase>'
        '</testsuite></testsuites>')
    assert _load_durations_script().file_seconds(xml) == {"tests/test_a.py": 3.5, "tests/test_b.py": 0.25}


def test_a_report_with_no_test_is_refused(tmp_path):
    xml = tmp_path / "empty.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest"/></testsuites>')
    with pytest.raises(ValueError, match="no test case"):
        _load_durations_script().file_seconds(xml)


def test_the_table_names_test_files_that_exist():
    table = _measured_seconds()
    assert table, f"{FILE_DURATIONS} is missing or unreadable"
    assert all((ROOT / f).is_file() and re.fullmatch(r"tests/test_\w+\.py", f) for f in table), \
        [f for f in table if not (ROOT / f).is_file()]
    assert all(s >= 0 for s in table.values())


def test_the_runner_keeps_that_order_on_its_workers():
    # without --no-loadscope-reorder, xdist's loadfile re-sorts files by their number of tests, so the longest
    # files (a few slow browser or vLLM tests) were handed out last
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert re.search(r"--dist loadfile --no-loadscope-reorder", script)
