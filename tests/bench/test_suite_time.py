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


def test_the_two_lanes_reports_add_up(tmp_path: Path, capsys) -> None:
    light, heavy = tmp_path / "junit-light.xml", tmp_path / "junit-heavy.xml"
    light.write_text(REPORT)
    heavy.write_text(REPORT.replace("test_split_job", "test_worker_vllm"))
    assert by_folder(light, heavy) == [("tests/worker", 20.5, 2), ("tests/api", 7.0, 4), ("tests", 1.0, 2)]
    assert main([str(light), str(heavy)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].split()[:3] == ["total", "28.5", "8"]
    assert main([str(light), str(tmp_path / "none.xml")]) == 1  # one missing report is an error too
