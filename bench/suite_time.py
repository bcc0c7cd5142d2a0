"""The test suite's time by folder, from a pytest JUnit XML report (issue 47: measured first).

    make test JUNIT=.peagle/junit                             # writes junit-light.xml and junit-heavy.xml
    python -m bench.suite_time .peagle/junit-light.xml .peagle/junit-heavy.xml   # per folder, slowest first

`.ci/run` writes the reports of `make test`'s two pytest runs (the light lane over the cores, then the heavy
tests) and prints this table over both after the suite (with pytest's `--durations=40`), so every CI log
carries the suite's time by folder. Over xdist workers the seconds are test time, not wall time. The times are each test's own call, set-up and tear-down
(pytest's `time` attribute): a session-scoped fixture's cost lands on the first test that needs it.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

__all__ = ["by_folder", "main"]


def by_folder(*reports: Path, depth: int = 2) -> list[tuple[str, float, int]]:
    """(folder, seconds, tests) per test folder `depth` levels deep (`tests/api`) over every report, slowest
    first."""
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    cases = (case for report in reports for case in ET.parse(report).getroot().iter("testcase"))
    for case in cases:
        parts = (case.get("classname") or "").split(".")
        folder = "/".join(parts[:depth]) if len(parts) > depth else "/".join(parts[:-1]) or "?"
        seconds[folder] += float(case.get("time") or 0.0)
        count[folder] += 1
    return sorted(((f, seconds[f], count[f]) for f in seconds), key=lambda row: -row[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="JUnit XML reports, summed")
    parser.add_argument("--depth", type=int, default=2, help="folder levels below the root (tests/api: 2)")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.reports if not r.is_file()]
    if missing:
        sys.stderr.write(f"no report at {', '.join(missing)}\n")
        return 1
    rows = by_folder(*args.reports, depth=args.depth)
    total = sum(s for _, s, _ in rows) or 1.0
    out = [f"{'folder':<28} {'seconds':>9} {'tests':>6} {'share':>6}"]
    out += [f"{f:<28} {s:>9.1f} {n:>6} {s / total:>6.1%}" for f, s, n in rows]
    out.append(f"{'total':<28} {total:>9.1f} {sum(n for _, _, n in rows):>6}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
