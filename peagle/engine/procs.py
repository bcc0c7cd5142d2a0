"""The one owner of child processes: start one in a process group of its own, signal that group, stop it.

    proc = spawn([python, "-m", "peagle", "train", ...], env=child_env(extra={...}), stdout=PIPE)
    signal_group(proc, signal.SIGTERM)           # the child and everything it started
    rc = stop_group(proc, grace_s=20.0)          # SIGTERM the group, SIGKILL what is left, reap

`spawn` starts the command in a new session, so its process id is its process group id and every
process it starts (torchrun ranks, vLLM's engine core and workers) shares that group, which nothing else
is in: one `killpg` reaches them all, and a signal to the parent's own group does not reach them. On
Linux the child also gets a parent-death signal (`PR_SET_PDEATHSIG`, SIGKILL by default), so it never
outlives the process that started it. That signal fires when the *thread* that called `spawn` ends, not
only the process: start long-lived children from a thread that lives as long as they should (the guard,
`peagle.engine.guard`, polls its parent instead and is started with `die_with_parent=False`).

Standard library only: `guard.py` runs as a plain script under any Python and loads this file by path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["child_hook", "group_alive", "signal_group", "spawn", "stop_group"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int, sig: int) -> Callable[[], None]:
    """A `preexec_fn` (runs in the child between fork and exec) asking the kernel for `sig` when the
    parent dies; if the parent died already (before the request), the child signals itself. libc's
    `prctl` is looked up here, in the parent: a `dlopen` in the child of a threaded process can wait
    forever for a loader lock that another thread held at the fork."""
    prctl = None
    with contextlib.suppress(OSError, AttributeError):
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl

    def hook() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return hook


def child_hook(
    *, die_with_parent: bool = True, death_signal: int = signal.SIGKILL, then: Callable[[], None] | None = None
) -> Callable[[], None] | None:
    """The `preexec_fn` of a child this process owns: the parent-death request (Linux, `die_with_parent`),
    then `then` (e.g. `peagle.engine.sandbox`'s resource limits). None when there is nothing to run. Also
    for a child that asyncio starts (`start_new_session=True` with it keeps `spawn`'s conventions)."""
    death = _die_with_parent(os.getpid(), death_signal) if die_with_parent and sys.platform == "linux" else None
    if death is None or then is None:
        return death or then

    def hook() -> None:
        death()
        then()

    return hook


def spawn(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str],
    cwd: str | Path | None = None,
    stdout: Any = None,
    stderr: Any = None,
    die_with_parent: bool = True,
    death_signal: int = signal.SIGKILL,
    new_session: bool = True,
    preexec: Callable[[], None] | None = None,
    **popen_kw: Any,
) -> subprocess.Popen[Any]:
    """Start `cmd` as a child this process owns (module docstring).

    Args:
        cmd: the program and its arguments.
        env: the child's whole environment (build it with `peagle.engine.environment.child_env`; nothing
            of this process's environment is added).
        cwd: its working directory (None = ours).
        stdout: as `subprocess.Popen` (None = ours, `subprocess.PIPE`, a file).
        stderr: as `subprocess.Popen` (`subprocess.STDOUT` = into stdout).
        die_with_parent: on Linux, send `death_signal` to the child when this thread/process dies.
        death_signal: the parent-death signal (SIGKILL; the worker's reaper takes SIGTERM to stop cleanly).
        new_session: start a new session (pgid == pid). False keeps the child in our group (the reaper,
            which the terminal's Ctrl-C should reach like its worker).
        preexec: run in the child after the parent-death request, before the exec (resource limits:
            `peagle.engine.sandbox.limits_hook`). Look up what it calls in the parent, not in the child.
        **popen_kw: the rest of `subprocess.Popen`'s keywords (`stdin`, `text`, `bufsize`, `pass_fds`, ...).
            `stdin` defaults to `subprocess.DEVNULL`.

    Raises:
        OSError: the program cannot be started.
    """
    if "preexec_fn" in popen_kw or "start_new_session" in popen_kw:
        raise TypeError("spawn owns preexec_fn and start_new_session (use die_with_parent / new_session)")
    popen_kw.setdefault("stdin", subprocess.DEVNULL)
    hook = child_hook(die_with_parent=die_with_parent, death_signal=death_signal, then=preexec)
    return subprocess.Popen(
        [os.fspath(c) for c in cmd], env=dict(env), cwd=cwd, stdout=stdout, stderr=stderr,
        start_new_session=new_session, preexec_fn=hook, **popen_kw,
    )  # fmt: skip


def group_alive(pgid: int) -> bool:
    """Whether any process is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(proc: subprocess.Popen[Any], sig: int) -> bool:
    """Send `sig` to the process group `proc` leads (it was started by `spawn`). Returns False when the
    group is gone already (nothing was signalled)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[Any], *, grace_s: float, interrupt: threading.Event | None = None) -> int | None:
    """Take `proc`'s whole process group down and reap `proc`: SIGTERM to the group, up to `grace_s`
    seconds for `proc` to exit and the group to empty, then SIGKILL to whatever is left (idempotent).

    Args:
        proc: a child started by `spawn` (its own process group).
        grace_s: seconds between SIGTERM and SIGKILL.
        interrupt: when set during the grace, SIGKILL at once (a second Ctrl-C).

    Returns:
        `proc`'s exit code (negative: killed by that signal), or None if it could not be reaped.
    """
    if proc.poll() is None or group_alive(proc.pid):
        signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not (interrupt is not None and interrupt.is_set()):
            if proc.poll() is not None and not group_alive(proc.pid):
                break
            time.sleep(0.1)
    signal_group(proc, signal.SIGKILL)  # whatever is left of the group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    return proc.returncode
