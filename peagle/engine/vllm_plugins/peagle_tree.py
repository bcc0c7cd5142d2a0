"""vLLM general plug-in: every vLLM process dies with the process that started it (runs INSIDE vLLM).

vLLM loads its general plug-ins (entry point group ``vllm.general_plugins``) in each of its processes: the
API server while it reads its arguments, the engine core when it is built, each worker when it is built.
Ours is declared by ``peagle_vllm_plugins-1.dist-info`` in this folder, which is the engine's whole
``PYTHONPATH`` (`peagle.engine.server`), so every vLLM interpreter that serves for us finds it and nothing
needs installing. It never imports `peagle` (standard library only).

`register()`:

* in the API server (no ``PEAGLE_VLLM_PARENT`` in its environment: the guard started it, with its own
  parent-death signal) it only marks itself: ``PEAGLE_VLLM_PARENT`` = its pid, which every process it
  starts inherits;
* in a process that a vLLM process started (the engine core; a worker of the engine core) it ties the
  process to its parent, then marks itself for its own children. If that parent is gone already (vLLM
  loads plug-ins seconds after a process starts, once its imports are done), the process ends at once.

The tie is the kernel's parent-death signal (``PR_SET_PDEATHSIG``, SIGKILL) when the parent's main thread
started the process (``/proc/<parent>/task/<parent>/children`` lists it): that signal fires when the
starting *thread* ends, and a main thread ends only with its process. Otherwise (another thread started
it, or the kernel does not list children) a daemon thread polls ``getppid()`` every `POLL_S` seconds and
SIGKILLs the process when it changes. vLLM 0.32 starts its engine core and workers from main threads.

A fork start (``VLLM_WORKER_MULTIPROC_METHOD=fork``) runs no plug-in in the child (vLLM's "loaded once"
flag is copied with the memory), so `register()` also ties every child this process forks
(`os.register_at_fork`). vLLM's CLI uses spawn by default: a fresh interpreter that loads the plug-ins.

So a SIGKILLed API server takes its engine core down with it, and the engine core its workers; the
processes above a dead engine core or worker are vLLM's own to stop (the API server ends when its engine
dies) and the guard's (it kills the server's process group when the server ends).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from pathlib import Path

__all__ = ["PARENT_VAR", "POLL_S", "TIED", "register"]

#: The pid of the vLLM process that started this one (each process sets it to its own pid for its children).
PARENT_VAR = "PEAGLE_VLLM_PARENT"
#: Seconds between two looks at the parent when the death signal cannot be used.
POLL_S = 0.2
#: How this process is tied to its parent: None (not registered), "root", "death signal", "parent watch".
TIED: str | None = None

_PR_SET_PDEATHSIG = 1
_log = logging.getLogger("vllm.peagle_tree")  # vLLM's handler prints it, with the process's name and pid


def register() -> None:
    """The plug-in's entry point (module docstring); vLLM may call it more than once in a process."""
    global TIED
    if TIED is not None:
        return
    parent = os.environ.get(PARENT_VAR)
    if parent is None or not parent.isdigit():
        TIED = "root"
    else:
        _tie(int(parent))
        _log.info("peagle_tree: pid %d dies with its parent %d (%s)", os.getpid(), os.getppid(), TIED)
    os.environ[PARENT_VAR] = str(os.getpid())
    os.register_at_fork(after_in_child=_after_fork)


def _after_fork() -> None:
    global TIED
    parent = int(os.environ[PARENT_VAR])  # the forking process's pid, copied with its memory
    TIED = None
    _tie(parent)
    os.environ[PARENT_VAR] = str(os.getpid())


def _tie(expected: int) -> None:
    """Make this process die with its parent; end it now if the vLLM process that started it is gone."""
    global TIED
    parent = os.getppid()
    if parent != expected and not _exists(expected):
        _die()  # reparented: the process that started us died before we could tie ourselves to it
    if _started_by_main_thread(parent) and _prctl_pdeathsig(signal.SIGKILL):
        TIED = "death signal"
    else:
        threading.Thread(target=_watch, args=(parent,), name="peagle-parent-watch", daemon=True).start()
        TIED = "parent watch"
    if os.getppid() != parent:
        _die()  # it died while we tied ourselves (the request came too late to fire)


def _started_by_main_thread(parent: int) -> bool:
    with contextlib.suppress(OSError):
        kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        return str(os.getpid()) in kids
    return False


def _libc_prctl():
    """libc's `prctl`, looked up when the plug-in is loaded: a `dlopen` in the child of a threaded process
    (the fork hook) can wait forever for a loader lock another thread held at the fork."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


_prctl = _libc_prctl()


def _prctl_pdeathsig(sig: int) -> bool:
    return _prctl is not None and _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _die()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
