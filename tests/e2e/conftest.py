"""Browser-test fixtures: the real API on loopback (uvicorn, SQLite, temp home) and Debian's Chromium.

Chromium: `shutil.which("chromium")` (never `playwright install`). If it is missing the tests skip with
the reason, unless `PEAGLE_REQUIRE_SERVICES=1`, where they fail.
Screenshots go to `test-artifacts/screenshots/` (1280 px and 420 px wide).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-artifacts" / "screenshots"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDE = {"width": 1280, "height": 900}
NARROW = {"width": 420, "height": 860}

pytestmark = pytest.mark.e2e


def _require_services() -> bool:
    return os.environ.get("PEAGLE_REQUIRE_SERVICES", "") not in ("", "0", "false")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running API: its base URL, database URL, artifact root and an admin API key."""

    url: str
    database_url: str
    home: Path
    artifact_root: Path
    key: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=30)


_LAUNCH = """
import uvicorn
from api.main import create_app
from service.settings import get_settings
uvicorn.run(create_app(get_settings()), host="127.0.0.1", port={port}, log_level="warning", access_log=False)
"""


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The real API (uvicorn subprocess) on a free loopback port, SQLite in a temp home."""
    from alembic import command
    from alembic.config import Config

    from service.db import repo
    from service.db.session import make_engine, make_session_factory, session_scope

    home = tmp_path_factory.mktemp("peagle-home")
    db_url = f"sqlite:///{home / 'peagle.db'}"
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.attributes["url"] = db_url
    command.upgrade(cfg, "head")
    engine = make_engine(db_url)
    with session_scope(make_session_factory(engine)) as s:
        _, key = repo.create_key(s, "e2e", ["admin", "write", "read"], name="e2e")
    engine.dispose()

    port = _free_port()
    env = {**os.environ, "PEAGLE_HOME": str(home), "PEAGLE_DATABASE_URL": db_url, "PEAGLE_EMBEDDED": "true"}
    env.pop("PEAGLE_REDIS_URL", None)
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCH.format(port=port)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"API did not start: {(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield Server(url=url, database_url=db_url, home=home, artifact_root=(home / "artifacts").resolve(), key=key)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Headless Debian Chromium driven by the Playwright client."""
    exe = shutil.which("chromium")
    if exe is None:
        msg = "chromium is not installed (apt-get install -y chromium; `make deps` does it)"
        if _require_services():
            pytest.fail(msg + " — PEAGLE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
        pytest.skip(msg)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def feeder(server: Server) -> Iterator[object]:
    """Writes progress rows as the worker does (see feed.py)."""
    from tests.e2e.feed import Feeder

    f = Feeder(server.database_url, server.artifact_root)
    try:
        yield f
    finally:
        f.close()


def _new_context(browser: object, server: Server, viewport: dict[str, int], signed_in: bool) -> object:
    ctx = browser.new_context(base_url=server.url, viewport=viewport, accept_downloads=True)  # type: ignore[attr-defined]
    ctx.set_default_timeout(15_000)
    if signed_in:
        r = ctx.request.post("/v1/auth/session", data={"api_key": server.key})
        assert r.ok, r.text()
    return ctx


@pytest.fixture
def page(browser: object, server: Server) -> Iterator[object]:
    """A signed-in page at 1280 px (the session cookie comes from POST /v1/auth/session)."""
    ctx = _new_context(browser, server, WIDE, signed_in=True)
    pg = ctx.new_page()  # type: ignore[attr-defined]
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield pg
    finally:
        ctx.close()  # type: ignore[attr-defined]
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def new_context(browser: object, server: Server) -> Iterator[object]:
    """Factory of extra contexts: new_context(viewport=NARROW, signed_in=True)."""
    made: list[object] = []

    def make(viewport: dict[str, int] = WIDE, signed_in: bool = True) -> object:
        ctx = _new_context(browser, server, viewport, signed_in)
        made.append(ctx)
        return ctx

    yield make
    for c in made:
        c.close()  # type: ignore[attr-defined]


def shot(page: object, name: str) -> Path:
    """Full-page screenshot into test-artifacts/screenshots/<name>.png."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    return path
