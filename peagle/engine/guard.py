"""The engine's guard: owns a vLLM process group (`vllm serve` or the probe) and never lets it outlive its parent.

    python guard.py [--grace S] [--cleanup DIR]... -- CMD ARG...    (stdlib only)
    proc = guarded(cmd, env=vllm_env(...), grace_s=20.0, cleanup=[tmp])  # how `server` and `prober` start it

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

Then it removes every `--cleanup` folder (the probe's plan, result and log), unless CMD exited on its own
while the parent lives: that parent still reads the result, and removes the folder itself.

Being in its own session, the guard is not hit by the supervisor's SIGKILL of the trainer's group, which
is what lets it clean up after a trainer that could not. It exits with CMD's exit code (128 + signal when
CMD was killed by one). It imports nothing outside the standard library and `procs.py` beside it
(loaded by path), so any Python runs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from peagle.engine import procs
else:  # run as a script, by any Python: the sibling module, by path (not `peagle`, which may not import)
    _spec = importlib.util.spec_from_file_location("_peagle_procs", Path(__file__).with_name("procs.py"))
    procs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(procs)

POLL_S = 0.5
GUARD = Path(__file__).resolve()


def guarded(
    cmd: Sequence[str], *, env: dict[str, str], grace_s: float, cleanup: Sequence[Path] = (), stdout: Any = None,
    stderr: Any = None,
) -> subprocess.Popen[Any]:
    """Start `cmd` under the guard (this interpreter runs it), in a session of its own (module docstring).

    Args:
        cmd: the vLLM command (`vllm serve ...`, the probe).
        env: the environment of the guard and of `cmd` (`peagle.engine.environment.vllm_env`).
        grace_s: seconds between the group's SIGTERM and its SIGKILL.
        cleanup: folders the guard removes when it takes `cmd` down (the probe's temporary folder).
        stdout: where the guard's and `cmd`'s output goes (`subprocess.Popen` values).
        stderr: likewise (`subprocess.STDOUT` = into stdout).

    Returns:
        The guard's process: stop it with `procs.stop_group(proc, grace_s=...)` (SIGTERM: the guard takes
        the command's group down within its own grace); its exit code is `cmd`'s.
    """
    argv = [sys.executable, str(GUARD), "--grace", f"{grace_s:g}"]
    for folder in cleanup:
        argv += ["--cleanup", str(folder)]
    # No parent-death signal: it fires when the starting *thread* ends; the guard polls its parent instead.
    return procs.spawn([*argv, "--", *cmd], env=env, stdout=stdout, stderr=stderr, die_with_parent=False)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: guard.py [--grace S] [--cleanup DIR]... -- CMD ARG...")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description="run CMD in its own process group; kill the group with the parent")
    p.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--cleanup", action="append", default=[], help="a folder to remove when CMD is taken down")
    args = p.parse_args(argv[:cut])
    cmd = argv[cut + 1 :]
    if not cmd:
        raise SystemExit("guard.py: no command after --")
    return args, cmd


def main(argv: list[str]) -> int:
    args, cmd = _parse(argv)
    parent = os.getppid()
    stop = {"why": ""}

    def on_signal(signum: int, _frame: object) -> None:
        stop["why"] = signal.Signals(signum).name

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # CMD leads a new group (pgid == its pid); it is SIGKILLed should the guard itself be SIGKILLed.
    child = procs.spawn(cmd, env=os.environ, stdout=None, stderr=None, stdin=None)
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
        procs.stop_group(child, grace_s=args.grace)
        if stop["why"] != "exited" or os.getppid() != parent:
            for folder in args.cleanup:
                shutil.rmtree(folder, ignore_errors=True)
    rc = child.returncode
    if rc is None:
        return 137
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
