"""The worker announces itself: its `Worker` row (queues, GPUs, heartbeat) while it runs (`service.db.workers`).

A thread of the worker's main process, started when Celery reports the worker ready (it consumes its
queues) and stopped, its row deleted, when the worker shuts down. Each beat opens and closes its own
database connection, and no fork of this process happens during a beat: the prefork pool forks a child
for every job, and a child forked mid-beat inherits the beat's open connection and, with SQLite, its
per-process lock table holding the beat's write lock, so the child's own connection finds the database
locked until its busy timeout and the job's claim fails (the job then waits, queued, for the reaper).
`os.register_at_fork` makes a fork wait for the beat in progress (`_BEAT`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading

from service.db.session import make_engine, make_session_factory, session_scope
from service.db.workers import announce, retire
from service.settings import Settings

__all__ = ["Announcer", "visible_gpus"]

log = logging.getLogger(__name__)

#: Held by a beat for as long as its database connection is open, and by a fork of this process (module
#: docstring); registered with `os.register_at_fork` once, by the first `Announcer.start`.
_BEAT = threading.Lock()
_fork_gate: list[bool] = []


def _gate_forks() -> None:
    """A fork of this process waits for the beat in progress; the child starts with the gate open."""
    if not _fork_gate and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_BEAT.acquire, after_in_parent=_BEAT.release, after_in_child=_BEAT.release)
        _fork_gate.append(True)


def visible_gpus() -> int:
    """GPUs this process sees: `CUDA_VISIBLE_DEVICES` when set, else `nvidia-smi -L` (0 without one)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = []
        for dev in (d.strip() for d in env.split(",")):
            if not dev or dev.startswith("-"):  # CUDA ignores the devices after an invalid one
                break
            ids.append(dev)
        return len(ids)
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else 0


class Announcer:
    """Keeps this worker's row fresh every `settings.heartbeat_seconds` from `start()` to `stop()`."""

    def __init__(self, settings: Settings, *, name: str, queues: list[str]) -> None:
        self.settings = settings
        self.name = name
        self.queues = queues
        self.gpus = settings.worker_gpus if settings.worker_gpus is not None else visible_gpus()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, *, alive: bool) -> None:
        with _BEAT:
            engine = make_engine(self.settings.resolved_database_url())
            try:
                with session_scope(make_session_factory(engine)) as s:
                    if alive:
                        announce(s, name=self.name, queues=self.queues, gpus=self.gpus)
                    else:
                        retire(s, name=self.name)
            finally:
                engine.dispose()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._write(alive=True)
            except Exception as exc:  # noqa: BLE001 - the database may be away for a while: next beat
                log.warning("worker %s: cannot announce itself (%s); retrying", self.name, exc)
            self._stop.wait(self.settings.heartbeat_seconds)

    def start(self, **_: object) -> None:
        """Start beating (Celery's `worker_ready` signal calls it); the first row is written at once."""
        _gate_forks()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="peagle-announce", daemon=True)
            self._thread.start()

    def stop(self, **_: object) -> None:
        """Stop beating and delete the row (Celery's `worker_shutdown` signal calls it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self._write(alive=False)
        except Exception as exc:  # noqa: BLE001 - shutting down: the row goes stale on its own
            log.warning("worker %s: cannot retire its row (%s)", self.name, exc)
