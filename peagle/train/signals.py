"""Graceful shutdown: the first SIGTERM/SIGINT asks the loop to stop after the current step (it then
saves a checkpoint and raises `TrainingInterrupted`, exit code 75); a second one exits at once.

    >>> with GracefulShutdown() as stop:
    ...     for step in ...:
    ...         train_step()
    ...         if stop.requested:
    ...             save_checkpoint(); raise TrainingInterrupted(...)
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from peagle.errors import EXIT_CODES

__all__ = ["GracefulShutdown", "stop_reason"]


def stop_reason(signum: int | None) -> str:
    """What a stop signal means here, for the log: the supervisor sends SIGTERM for a pause or a worker
    shutdown (both resume from the checkpoint), a person at a terminal sends SIGINT (Ctrl-C)."""
    if signum == signal.SIGINT:
        return "interrupted (Ctrl-C)"
    if signum == signal.SIGTERM:
        return "pause requested (SIGTERM: a pause or a worker shutdown)"
    return "stop requested" if signum is None else f"stop requested (signal {signum})"  # None: another rank


class GracefulShutdown:
    """Context manager installing SIGTERM/SIGINT handlers (main thread only; a no-op elsewhere)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            # Second signal: leave now. The newest COMPLETE checkpoint is still there, so this is resumable.
            os._exit(EXIT_CODES["interrupted"])
        self.requested = True
        self.signum = signum

    def __enter__(self) -> GracefulShutdown:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
