"""`make deps` waits for the dpkg lock instead of giving up (issue 39).

On a machine running another `apt-get install`, `apt-get` without a lock timeout fails at once ("Could not
get lock /var/lib/dpkg/lock-frontend"): docker-compose was skipped with a warning and the compose tests
failed. Every apt-get the Makefile runs waits for the lock (`-o DPkg::Lock::Timeout=600`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _expanded_makefile() -> str:
    """The Makefile without comment lines, with its simple `NAME := value` / `NAME = value` variables substituted (one level)."""
    lines = (ROOT / "Makefile").read_text(encoding="utf-8").splitlines()
    text = "\n".join(line for line in lines if not line.lstrip("\t @").startswith("#"))  # comments say apt-get too
    for name, value in re.findall(r"^([A-Z_]+)\s*:?=\s*(.*)$", text, flags=re.MULTILINE):
        text = text.replace(f"$({name})", value.strip())
    return text


def test_every_apt_get_waits_for_the_dpkg_lock() -> None:
    text = _expanded_makefile()
    calls = [m.start() for m in re.finditer(r"(?<![\w-])apt-get(?![\w-])", text)]
    commands = [text[i:text.find("\n", i)] for i in calls]
    assert commands, "the Makefile installs Debian packages with apt-get"
    for line in commands:
        m = re.match(r"apt-get -o DPkg::Lock::Timeout=(\d+)\b", line)
        assert m is not None, f"apt-get without a dpkg lock timeout: {line!r}"
        assert int(m.group(1)) >= 300, f"lock timeout too short to outwait another install: {line!r}"
