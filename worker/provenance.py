"""Provenance of a job attempt, gathered by the worker without importing torch or touching CUDA.

Package versions come from installed metadata, the git revision from `git`, GPUs from `nvidia-smi` (if
present) and `CUDA_VISIBLE_DEVICES`, the CPU's hardware class (`peagle.spec.hardware.hardware_class`, which
the dry-run estimate matches earlier jobs on) from /proc/cpuinfo. The trainer writes its own
`provenance.json` into the run directory; the supervisor folds it (and `resolved_spec.json`) into what the job row stores.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from peagle.spec.hardware import hardware_class, read_cpu_flags

__all__ = ["worker_provenance"]

PACKAGES = ("peagle", "torch", "transformers", "tokenizers", "safetensors", "numpy", "celery", "kombu",
            "sqlalchemy", "pydantic")


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _git(repo: Path) -> dict[str, Any] | None:
    if shutil.which("git") is None:
        return None
    rev = _run(["git", "rev-parse", "HEAD"], cwd=repo)
    if rev is None:
        return None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo)
    return {"revision": rev, "dirty": bool(status)}


def _gpus() -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
    gpus = []
    for line in (out or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append(dict(zip(("index", "name", "memory_total", "driver"), parts, strict=True)))
    return gpus


def worker_provenance(*, argv: list[str], attempt: int) -> dict[str, Any]:
    """What the worker knows about this attempt: platform, packages, git revision, GPUs, command. It is
    stored on the job, which its owner reads: the host's name and the worker's process stay in the worker
    log and the job's lease owner (operators)."""
    repo = Path(__file__).resolve().parent.parent
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "packages": _versions(),
        "git": _git(repo),
        "gpus": _gpus(),
        "hardware_class": hardware_class(device="cpu", cpu_flags=read_cpu_flags()),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "argv": argv,
        "attempt": attempt,
    }


