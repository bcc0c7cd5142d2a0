"""Stored records as an owner may read them: no host name, process id or kernel build in any response.

`worker_label` names a worker or host by 8 hex digits of its sha256 (operators find the name in the worker
logs); `public_record` cleans a stored JSON record (a job's provenance, an event's data) for a response.
Used by the job schemas (`api.schemas.job_public`), the event pages and streams, and the task list.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

__all__ = ["public_record", "worker_label"]


def worker_label(name: str | None) -> str | None:
    """A stable label of a worker or host that names no host or pid (operators find the name in the worker
    logs): `w-` and 8 hex digits of its sha256."""
    return None if not name else "w-" + hashlib.sha256(name.encode()).hexdigest()[:8]


#: Keys of stored records (provenance, hardware) that name the machine: its host (shown as `worker_label`),
#: a process id (dropped), the kernel build (dropped; `platform` keeps the OS and architecture only).
_HOST_KEYS = frozenset({"host", "hostname", "node", "nodename", "node_name"})
_PID_KEYS = frozenset({"pid", "ppid", "pgid", "sid", "tid"})
_KERNEL_KEYS = frozenset({"kernel", "kernel_version", "kernel_release", "release", "uname", "os_release"})
#: `platform.machine()` values, as `platform.platform()` writes them among its dash-separated parts.
_MACHINES = ("x86_64", "aarch64", "arm64", "amd64", "i686", "i386", "ppc64le", "s390x", "riscv64")


def _split_platform(platform: str) -> tuple[str, str | None, str]:
    """`platform.platform()` as (OS, architecture or None, kernel release or ""):
    `Linux-5.15.0-1051-aws-x86_64-with-glibc2.35` -> (`Linux`, `x86_64`, `5.15.0-1051-aws`)."""
    parts = platform.split("-")
    at = next((i for i, p in enumerate(parts) if i > 0 and p.lower() in _MACHINES), None)
    release = "-".join(parts[1:at] if at is not None else parts[1:2])
    return parts[0], parts[at] if at is not None else None, release


def _os_of(platform: str) -> str:
    """`platform.platform()` without the kernel build: `Linux x86_64` (the OS, and the architecture)."""
    system, machine, _ = _split_platform(platform)
    return f"{system} {machine}" if machine else system


def public_record(value: Any) -> Any:
    """A stored JSON record (a job's provenance, an event's data) as its owner may read it: host names become
    their `worker_label` (also where the name appears in the record's other strings), process ids and kernel
    strings are dropped, `platform` keeps the OS and architecture. Pure: the input is not changed.

        public_record({"host": "gpu7", "pid": 12, "platform": "Linux-6.8.0-45-generic-x86_64-with-glibc2.39"})
        # -> {"host": "w-<8 hex>", "platform": "Linux x86_64"}
    """
    seen: dict[str, str] = {}  # a machine string found under its key -> what it reads as elsewhere

    def collect(v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                key = str(k).lower()
                if isinstance(x, str) and x:
                    if key in _HOST_KEYS:
                        seen[x] = label = worker_label(x) or ""
                        short = x.split(".")[0]
                        if any(c.isalpha() for c in short):  # an FQDN's short name (not an IP's first number)
                            seen.setdefault(short, label)
                    elif key in _KERNEL_KEYS:
                        seen[x] = "<kernel>"
                    elif key == "platform":
                        seen[x] = _os_of(x)
                        release = _split_platform(x)[2]
                        if "-" in release:  # a kernel build (`6.8.0-45-generic`), never a package's version
                            seen[release] = "<kernel>"
                collect(x)
        elif isinstance(v, list | tuple):
            for x in v:
                collect(x)

    collect(value)
    names = sorted((n for n in seen if len(n) > 2), key=len, reverse=True)  # an FQDN before its short name
    found = re.compile("|".join(rf"(?<![A-Za-z0-9_.-]){re.escape(n)}(?![A-Za-z0-9_-])" for n in names)) if names \
        else None

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                key = str(k).lower()
                if key in _PID_KEYS or key in _KERNEL_KEYS:
                    continue
                if key in _HOST_KEYS and isinstance(x, str):
                    out[k] = worker_label(x)
                elif key == "platform" and isinstance(x, str):
                    out[k] = _os_of(x)
                else:
                    out[k] = clean(x)
            return out
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        if isinstance(v, str) and found is not None:
            return found.sub(lambda m: seen[m.group(0)], v)
        return v

    return clean(value)
