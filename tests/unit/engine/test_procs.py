"""`peagle.engine.procs` on real processes: own group, dies with its parent, the group stopped as a whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peagle.engine.procs import group_alive, signal_group, spawn, stop_group
from tests.waiting import processes_mentioning as pids_mentioning
from tests.waiting import wait_until as _wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and PR_SET_PDEATHSIG: Linux")

# A process that ignores SIGTERM and starts a grandchild that ignores it too (the worst case for a stop).
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "time.sleep(600)', sys.argv[1]])\n"
    "time.sleep(600)\n"
)


def wait_until(cond, timeout: float, what: str) -> None:
    _wait_until(cond, timeout, what, every=0.05)


def test_spawn_starts_a_group_of_its_own_with_exactly_the_given_environment() -> None:
    proc = spawn([sys.executable, "-c", "import os, sys; print(os.getpgid(0), os.environ.get('ONLY'), "
                  "os.environ.get('HOME'))"], env={"ONLY": "this"}, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert out.split() == [str(proc.pid), "this", "None"]  # pgid == pid; nothing of our environment added
    assert os.getpgid(0) != proc.pid


def test_stop_group_kills_the_whole_group_after_the_grace(tmp_path: Path) -> None:
    marker = f"procs-stop-{os.getpid()}"
    proc = spawn([sys.executable, "-c", STUBBORN, marker], env=dict(os.environ))
    wait_until(lambda: len(pids_mentioning(marker)) >= 2, 30, "the child and its grandchild")
    t0 = time.monotonic()
    rc = stop_group(proc, grace_s=0.5)
    assert rc == -signal.SIGKILL and time.monotonic() - t0 >= 0.5  # SIGTERM ignored: SIGKILL after the grace
    assert not pids_mentioning(marker)
    wait_until(lambda: not group_alive(proc.pid), 10, "the group's zombies to be reaped")  # by init, not by us
    assert signal_group(proc, signal.SIGTERM) is False  # gone: nothing to signal
    assert stop_group(proc, grace_s=0.5) == rc  # idempotent


def test_a_spawned_child_dies_with_its_parent_even_by_sigkill() -> None:
    marker = f"procs-orphan-{os.getpid()}"
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time\n"
         "from peagle.engine.procs import spawn\n"
         f"spawn([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}], env=dict(os.environ))\n"
         "time.sleep(600)\n"],
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: pids_mentioning(marker), 30, "the child")
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: not pids_mentioning(marker), 10, "the child to die with its parent")
    finally:
        for pid in pids_mentioning(marker):
            os.kill(pid, signal.SIGKILL)


def test_spawn_refuses_to_be_bypassed() -> None:
    with pytest.raises(TypeError, match="spawn owns"):
        spawn([sys.executable, "-c", "pass"], env={}, start_new_session=False)
