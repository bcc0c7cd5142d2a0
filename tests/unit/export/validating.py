"""Helpers of the validator-bounds tests: `peagle validate --json` in this process or in a measured subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from peagle.cli import app


def validate_json(d: Path, *flags: str) -> dict[str, Any]:
    """`peagle validate d --json [flags]` in this process: its JSON answer (a traceback fails here)."""
    res = CliRunner().invoke(app, ["validate", str(d), "--json", *flags])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code in (0, 8), (res.exit_code, res.stdout, res.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def refused(d: Path, needle: str) -> str:
    """The export is refused in portable mode and a violation names `needle`: the first such."""
    out = validate_json(d, "--portable")
    assert out["ok"] is False, out
    hits = [v for v in out["violations"] if needle in v]
    assert hits, out["violations"]
    return hits[0]


# A fresh interpreter runs the validator and reports ITS children's peak RSS (the test process has run others).
# It kills the validator past 2 GiB so that a regression fails the test instead of exhausting the machine.
_PEAK_RSS = """
import json, resource, subprocess, sys, time
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
killed = False
while p.poll() is None:
    try:
        rss = [int(x.split()[1]) for x in open(f"/proc/{p.pid}/status") if x.startswith("VmRSS:")]
    except (FileNotFoundError, ProcessLookupError):
        rss = []
    if rss and rss[0] > 2 * 1024 * 1024:
        p.kill()
        killed = True
    time.sleep(0.02)
out, err = p.communicate()
print(json.dumps({"rc": p.returncode, "killed": killed, "stdout": out.decode(), "stderr": err.decode()[-2000:],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def validate_measured(d: Path) -> dict[str, Any]:
    """`python -m peagle validate DIR --json --portable` as the API runs it (cwd = the parent): rc, killed
    (past 2 GiB), stdout, stderr and peak_rss_mb."""
    cmd = [sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "peagle", "validate", d.name, "--json",
           "--portable"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=d.parent, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout)
