"""tests/timings.py: a JUnit report's seconds and tests per file, the slowest tests, and two runs side by side."""

from __future__ import annotations

from pathlib import Path

from tests import timings

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.integration.test_a" name="test_slow" time="12.5"/>
<testcase classname="tests.integration.test_a" name="test_quick" time="0.5"><skipped message="no"/></testcase>
<testcase classname="tests.unit.test_b.TestGroup" name="test_one" time="1.0"><failure message="x"/></testcase>
</testsuite></testsuites>
"""


def test_files_outcomes_and_the_slowest_tests(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    cases = timings.read_cases(str(report))
    assert [(c.file, c.outcome) for c in cases] == [("tests/integration/test_a.py", "passed"),
                                                    ("tests/integration/test_a.py", "skipped"),
                                                    ("tests/unit/test_b.py", "failed")]
    assert timings.per_file(cases) == [("tests/integration/test_a.py", 13.0, 2), ("tests/unit/test_b.py", 1.0, 1)]
    text = timings.render(cases, slowest=1)
    assert "| **all** | **14.0** | **3** |" in text
    assert "| `tests/integration/test_a.py::test_slow` | 12.5 |" in text and "test_quick` |" not in text
    assert text.endswith("1 failed, 1 passed, 1 skipped")


def test_two_runs_side_by_side(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    report.write_text(REPORT)
    cases = timings.read_cases(str(report))
    table = timings.compare(cases, cases[:1])
    assert "| `tests/integration/test_a.py` | 2 | 13.0 | 1 | 12.5 |" in table
    assert "| `tests/unit/test_b.py` | 1 | 1.0 | 0 | 0.0 |" in table
