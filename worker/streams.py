"""The trainer child's output: two reader threads put its stdout and stderr lines on one queue.

    output = TrainerOutput(proc)                    # starts the readers
    while output.open or proc.poll() is None:
        kind, line = output.get(timeout=0.1)        # ("out" | "err", line), or ("", "") when nothing came
    for level, part in stderr_parts(text): ...      # a stderr line -> the log lines the job's owner reads

stdout carries the trainer's JSON progress lines (`worker.progress.ProgressCollector`); stderr is its log.
"""

from __future__ import annotations

import queue
import subprocess
import threading
from typing import IO

__all__ = ["TrainerOutput", "stderr_parts"]


class TrainerOutput:
    """The lines of a started trainer's stdout (``"out"``) and stderr (``"err"``) in arrival order; `open`
    counts the streams not closed yet."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self.open = 2
        streams: list[tuple[IO[str] | None, str]] = [(proc.stdout, "out"), (proc.stderr, "err")]
        for stream, name in streams:
            threading.Thread(target=self._read, args=(stream, name), daemon=True).start()

    def _read(self, stream: IO[str], name: str) -> None:
        try:
            for line in stream:
                self.lines.put((name, line))
        finally:
            self.lines.put(None)

    def get(self, timeout: float) -> tuple[str, str]:
        """The next (stream, line); ("", "") when none came within `timeout` or a stream just closed."""
        try:
            item = self.lines.get(timeout=timeout)
        except queue.Empty:
            return "", ""
        if item is None:
            self.open -= 1
            return "", ""
        return item


def stderr_parts(text: str) -> list[tuple[str, str]]:
    """(level, line) for each non-blank line of a stderr chunk (a progress bar's "\\r" redraws split it):
    "error" for a line that names an error or starts a traceback, else "info"."""
    out = []
    for part in text.replace("\r", "\n").split("\n"):
        if part.strip():
            low = part.lower()
            out.append(("error" if ("error" in low or part.startswith("Traceback")) else "info", part))
    return out
