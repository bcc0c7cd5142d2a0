"""Helpers of the tests that wait on real processes: poll a condition, find processes by command line."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def wait_until(cond: Callable[[], object], timeout: float, what: str, *, every: float = 0.5) -> None:
    """Poll `cond` every `every` seconds until it is truthy; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def processes_mentioning(marker: str) -> list[int]:
    """Live processes (zombies excluded, this one too) whose command line contains `marker`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(entry.name))
    return out


def gone(pid: int) -> bool:
    """Whether `pid` has ended (no such process, or a zombie waiting for its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


def descendants(pid: int) -> set[int]:
    """Live processes below `pid` (children, their children, ...), read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                found.add(child)
                todo.append(child)
    return {p for p in found if not gone(p)}
