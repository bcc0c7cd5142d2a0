"""bench/suite_time: the suite's time by folder from a JUnit XML report (issue 47)."""

from __future__ import annotations

from pathlib import Path

from bench.suite_time import by_folder, main

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.api.test_jobs" name="test_a" time="1.5"/>
<testcase classname="tests.api.test_sse" name="test_b" time="2.0"/>
<testcase classname="tests.worker.test_split_job" name="test_c" time="10.25"/>
<testcase classname="tests.conftest_free" name="test_d" time="0.5"/>
</testsuite></testsuites>
"""


def test_times_are_summed_per_folder_slowest_first(tmp_path: Path, capsys) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(REPORT)
    assert by_folder(report) == [("tests/worker", 10.25, 1), ("tests/api", 3.5, 2), ("tests", 0.5, 1)]
    assert main([str(report)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["tests/worker", "10.2", "1"] and out[-1].split()[:3] == ["total", "14.2", "4"]


def test_a_missing_report_is_an_error(tmp_path: Path) -> None:
    assert main([str(tmp_path / "none.xml")]) == 1
