"""One sandbox for every child that parses tenants' bytes (uploaded datasets and drafts, and anything later).

    limits = Limits(memory_bytes=4 << 30, cpu_seconds=600, file_bytes=64 << 20, wall_seconds=300.0)
    out = await run([python, "-m", "peagle.data.formats", "chats.jsonl"], cwd=folder, limits=limits)
    out.breach   # None, or "memory" | "cpu" | "file_size" | "wall_clock"
    out.message  # "validation stopped: it exceeded the 4 GiB memory limit" (None when no limit was hit)

The child is started the way `peagle.engine.procs` starts every child (a new session, so one `killpg`
reaches everything it starts; the parent-death signal, `procs.child_hook`), with:
- the environment `peagle.engine.environment.sandbox_env`: PATH, the locale, the venv, and HOME = TMPDIR
  = its work folder. Nothing named `PEAGLE_*`, no credential (`PEAGLE_SECRET_KEY`, the database, broker and
  Redis URLs stay in the API), and `PYTHONSAFEPATH=1`: the folder of tenant files it runs in is never on
  the import path (before, `python -m ...` in it imported a tenant's `json.py`);
- resource limits set between fork and exec: address space (RLIMIT_AS), CPU seconds (RLIMIT_CPU: SIGXCPU at
  the limit, SIGKILL 5 s later), the largest file it may write (RLIMIT_FSIZE), no core dump;
- a wall-clock limit: past it the whole process group is killed (SIGKILL) and reaped. The group is killed
  after every run too, so nothing the child started outlives it.

A breach is told from the child's end: SIGXCPU (CPU), our own timer (wall clock), an EFBIG "File too large"
or SIGXFSZ (file size), a `MemoryError` / ENOMEM / `bad_alloc` on its stderr (memory). Anything else (an
exit code, a crash) is the caller's to read from `returncode`, `stdout` and `stderr`.

Bounding how many run at once is the caller's (the API holds `AppState.validator_slots`). Standard library
only, like `procs` (the API imports it and never imports torch).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from peagle.engine.environment import sandbox_env
from peagle.engine.procs import child_hook

__all__ = ["Breach", "Limits", "Outcome", "describe", "limits_hook", "run"]

Breach = Literal["memory", "cpu", "file_size", "wall_clock", "killed"]

#: Seconds between the CPU soft limit (SIGXCPU, which ends a child that does not handle it) and the hard one.
CPU_GRACE_S = 5
#: What a child's stderr says when an allocation failed under RLIMIT_AS (Python, libc, C++, torch).
_MEMORY_MARKS = (b"MemoryError", b"Cannot allocate memory", b"can't allocate memory", b"bad_alloc",
                 b"out of memory", b"Out of memory")  # fmt: skip
_FSIZE_MARKS = (b"File too large", b"[Errno 27]")


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What one sandboxed child may use.

        Limits(memory_bytes=4 << 30, cpu_seconds=600, file_bytes=64 << 20, wall_seconds=300.0)
    """

    memory_bytes: int  # address space (RLIMIT_AS): every mapping counts, not only what is resident
    cpu_seconds: int  # CPU time, all its threads together (RLIMIT_CPU)
    file_bytes: int  # the largest file it may write (RLIMIT_FSIZE)
    wall_seconds: float  # from start to exit


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a sandboxed child ended: its exit code (negative: the signal), output, and the limit it hit."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    breach: Breach | None = None
    message: str | None = None  # "<what> stopped: it exceeded ..." when `breach` is set


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def describe(breach: Breach, limits: Limits, what: str = "validation") -> str:
    """The refusal for `breach`: "validation stopped: it exceeded the 2 GiB memory limit"."""
    limit = {
        "memory": f"the {_size(limits.memory_bytes)} memory limit",
        "cpu": f"the CPU time limit of {limits.cpu_seconds} s",
        "file_size": f"the {_size(limits.file_bytes)} file-size limit",
        "wall_clock": f"the wall-clock limit of {limits.wall_seconds:g} s",
    }.get(breach)
    if limit is None:  # "killed": SIGKILL from outside the child (the CPU limit's hard stop, the OOM killer)
        return (f"{what} stopped: it was killed (the CPU time limit's hard stop at {limits.cpu_seconds + CPU_GRACE_S} s, "
                "or the host's out-of-memory killer)")
    return f"{what} stopped: it exceeded {limit}"


def limits_hook(limits: Limits) -> Callable[[], None]:
    """A `preexec` (runs in the child between fork and exec) setting `limits`' rlimits; everything it calls
    is looked up here, in the parent."""
    setrlimit = resource.setrlimit
    values = (
        (resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)),
        (resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + CPU_GRACE_S)),
        (resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),
    )

    def hook() -> None:
        for which, value in values:
            setrlimit(which, value)

    return hook


def _breach(rc: int | None, stderr: bytes) -> Breach | None:
    if rc == -signal.SIGXCPU:
        return "cpu"
    if rc == -signal.SIGXFSZ or (rc != 0 and any(m in stderr for m in _FSIZE_MARKS)):
        return "file_size"
    if rc != 0 and any(m in stderr for m in _MEMORY_MARKS):
        return "memory"
    if rc == -signal.SIGKILL:  # not ours (the wall clock is told apart before): a hard limit or the host
        return "killed"
    return None


def _kill_group(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


async def run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path,
    limits: Limits,
    home: Path | None = None,
    base_env: Mapping[str, str] | None = None,
    what: str = "validation",
) -> Outcome:
    """Run `cmd` in the sandbox (module docstring) in `cwd` and collect its output.

    Args:
        cmd: the program and its arguments (a Python child: `sys.executable`, the venv's interpreter).
        cwd: its working folder (the tenant's files).
        limits: its rlimits and wall clock.
        home: its HOME and TMPDIR (created; None = `cwd`).
        base_env: the environment its allow-list filters (None = `os.environ`).
        what: names the work in a refusal ("validation stopped: ...").

    Raises:
        OSError: the program cannot be started.
    """
    home = cwd if home is None else home
    home.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        *[os.fspath(c) for c in cmd], cwd=str(cwd), env=sandbox_env(home, base=base_env),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True, preexec_fn=child_hook(then=limits_hook(limits)),
    )  # fmt: skip
    pgid = getattr(proc, "pid", None)  # (a stand-in for the process in a test may have none)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limits.wall_seconds)
    except TimeoutError:
        _kill_group(pgid)
        await proc.wait()
        return Outcome(proc.returncode, b"", b"", "wall_clock", describe("wall_clock", limits, what))
    except BaseException:  # cancelled: the child goes with the request
        _kill_group(pgid)
        raise
    finally:
        _kill_group(pgid)  # whatever it started and left behind
    breach = _breach(proc.returncode, err[-65536:])
    return Outcome(proc.returncode, out, err, breach, describe(breach, limits, what) if breach else None)
