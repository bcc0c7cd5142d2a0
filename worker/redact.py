"""What the worker stores for clients never names a server path (issue 19).

A job's events, logs, error message, resolved spec and provenance are returned by the API to the job's
owner. The trainer's output names the files it reads and writes: the uploaded dataset's file, the run
directory, the artifact/dataset roots, the Python install and the home folder (caches). `Redactor`
rewrites those to stable placeholders before anything is written to the database:

    <dataset file>        -> dataset:<id>        (what the spec said)
    run directory         -> <run>
    artifact/dataset root -> <artifacts> / <datasets>
    service home          -> <home>
    sys.prefix / app dir  -> <python> / <app>
    the user's home       -> ~

Nor infrastructure (issue: events and errors named the worker's host, pids and Redis's address): the
service's own endpoints (database, broker, Redis: their URLs and `host:port`), other URLs of a local or
private address, IP addresses with their port and `localhost:port` become `<url>` / `<address>`, and a
`pid N` / `pid=N` loses its number. The worker log keeps the details for operators.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from peagle.spec import dataset_ref
from service.settings import Settings

__all__ = ["Redactor"]

_APP = Path(__file__).resolve().parents[1]

#: URL schemes that name the service's own infrastructure whatever the host.
_INFRA_SCHEMES = ("redis", "rediss", "postgres", "postgresql", "amqp", "amqps", "sqlite", "mysql", "sentinel")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s'\"<>)\]]+")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?(?!\w|\.\d)")
_IPV6 = re.compile(r"\[[0-9a-fA-F]*:[0-9a-fA-F:.]*\](?::\d{1,5})?")
_LOCALHOST = re.compile(r"\blocalhost:\d{1,5}\b")
_PID = re.compile(r"\b(pid\s*[=:]?\s*)\d+", re.IGNORECASE)


def _local_host(host: str | None) -> bool:
    """Whether a URL's host is this machine or a private network (not a public site such as the hub)."""
    if not host:
        return True
    if host == "localhost" or "." not in host:  # a bare name is a host of the local network or compose
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_unspecified


def _infra_url(url: str) -> bool:
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:
        return True
    return parts.scheme.lower().split("+")[0] in _INFRA_SCHEMES or _local_host(host)


class Redactor:
    """Replaces known server paths in strings (and in nested lists/dicts of them)."""

    def __init__(self, settings: Settings, run_dir: Path, dataset_files: Mapping[str, str] | None = None) -> None:
        pairs: dict[str, str] = {}
        for path, ds_id in (dataset_files or {}).items():
            pairs[str(path)] = dataset_ref(ds_id)
            pairs[str(Path(path).parent)] = "<datasets>"
        pairs[str(run_dir)] = "<run>"
        pairs[str(settings.resolved_artifact_root())] = "<artifacts>"
        pairs[str(settings.resolved_dataset_root())] = "<datasets>"
        pairs[str(settings.home.resolve())] = "<home>"
        pairs[sys.prefix] = "<python>"
        pairs[sys.base_prefix] = "<python>"
        pairs[str(_APP)] = "<app>"
        home = str(Path.home())
        if home not in ("/", ""):
            pairs[home] = "~"
        self.pairs = sorted(((k, v) for k, v in pairs.items() if len(k) > 1), key=lambda kv: -len(kv[0]))
        #: the service's endpoints: whole URLs, then `host:port` (a driver's error names only that)
        self.endpoints: list[tuple[str, str]] = []
        for url in (settings.database_url, settings.broker_url, settings.redis_url):
            if not url:
                continue
            self.endpoints.append((url, "<url>"))
            try:
                parts = urlsplit(url)
                host, port = parts.hostname, parts.port
            except ValueError:
                continue
            if host and port and len(host) > 1:
                self.endpoints.append((f"{host}:{port}", "<address>"))
        self.endpoints.sort(key=lambda kv: -len(kv[0]))

    def text(self, s: str) -> str:
        """`s` with every known server path and every infrastructure address replaced."""
        for old, new in self.endpoints:
            if old in s:
                s = s.replace(old, new)
        s = _URL.sub(lambda m: "<url>" if _infra_url(m.group(0)) else m.group(0), s)
        for pattern in (_IPV6, _IPV4, _LOCALHOST):
            s = pattern.sub("<address>", s)
        s = _PID.sub(lambda m: m.group(1) + "<pid>", s)
        for old, new in self.pairs:
            if old in s:
                s = s.replace(old, new)
        return s

    def value(self, v: Any) -> Any:
        """A JSON-like value with every string redacted (keys included)."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list | tuple):
            return [self.value(x) for x in v]
        if isinstance(v, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(x) for k, x in v.items()}
        return v
