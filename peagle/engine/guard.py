"""The engine's guard: owns the inference engine's process group and never lets it outlive its parent.

    python guard.py [--grace S] -- CMD ARG...          (stdlib only; `peagle.engine.server` starts it)

The trainer starts this script in a session of its own; the script starts CMD (`vllm serve ...`) in
another new session, so CMD and every process it spawns (vLLM's engine core and workers) share one process
group that nothing else is in. The guard then waits, and takes the whole group down (SIGTERM, then SIGKILL
after `--grace` seconds) when any of these happens:

* it receives SIGTERM, SIGINT or SIGHUP (a normal stop: `VllmServer.stop`);
* its parent dies, however it dies: the trainer killed by SIGKILL (the supervisor's cancel after its
  grace, or the supervisor itself killed with -9, which kills the trainer through its parent-death signal)
  is seen within half a second by polling `getppid()` (a parent-death signal would fire when the *thread*
  that started the guard ends, so it is not used);
* CMD exits (its leftover children are collected too).

Being in its own session, the guard is not hit by the supervisor's SIGKILL of the trainer's group, which
is what lets it clean up after a trainer that could not. It exits with CMD's exit code (128 + signal when
CMD was killed by one). It imports nothing outside the standard library, so any Python runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: guard.py [--grace S] -- CMD ARG...")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description="run CMD in its own process group; kill the group with the parent")
    p.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    args = p.parse_args(argv[:cut])
    cmd = argv[cut + 1 :]
    if not cmd:
        raise SystemExit("guard.py: no command after --")
    return args, cmd


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_down(pgid: int, child: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the whole group, SIGKILL to what is left after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if child.poll() is not None and not _group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=5)


def main(argv: list[str]) -> int:
    args, cmd = _parse(argv)
    parent = os.getppid()
    stop = {"why": ""}

    def on_signal(signum: int, _frame: object) -> None:
        stop["why"] = signal.Signals(signum).name

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    child = subprocess.Popen(cmd, start_new_session=True)  # CMD leads a new group: pgid == its pid
    pgid = child.pid
    try:
        while not stop["why"]:
            if child.poll() is not None:
                stop["why"] = "exited"
                break
            if os.getppid() != parent:
                stop["why"] = "parent died"
                break
            time.sleep(POLL_S)
    finally:
        _take_down(pgid, child, args.grace)
    rc = child.returncode
    if rc is None:
        return 137
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
