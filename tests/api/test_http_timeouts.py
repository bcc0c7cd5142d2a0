"""Slow clients are cut off and connections are capped (issue 46, item 7): a real API process on 127.0.0.1
started as production starts it (`--http api.timeouts:HttpProtocol`), raw sockets, bounded loops.

Before: a client sending its headers (or its body) one byte a second held its connection for as long as it
kept going (75 s in the report, no limit in fact), and nothing capped the number of connections.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from api.timeouts import HTTP_PROTOCOL
from service.db import upgrade
from tests.api.conftest import ROOT, ApiProcess, api_key

HEADER_S, BODY_S, MAX_CONNECTIONS = 1.5, 1.5, 6


class Api(ApiProcess):
    """The API as `worker/run.py` starts it (`ApiProcess`: uvicorn, the factory, `--http api.timeouts:HttpProtocol`),
    with raw sockets."""

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        s.settimeout(10)
        return s


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("timeouts")
    db = f"sqlite:///{tmp / 'service.db'}"
    upgrade(db)
    proc = Api(tmp, {"PEAGLE_DATABASE_URL": db, "PEAGLE_BROKER_URL": "filesystem://",
                     "PEAGLE_HTTP_HEADER_TIMEOUT_S": str(HEADER_S), "PEAGLE_HTTP_BODY_TIMEOUT_S": str(BODY_S),
                     "PEAGLE_HTTP_BODY_MIN_BYTES_PER_S": "1000",
                     "PEAGLE_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS)})
    try:
        yield proc, api_key(db)
    finally:
        proc.close()


def _trickle(s: socket.socket, data: bytes, *, every_s: float, for_s: float) -> tuple[float, bool]:
    """Send `data` one byte per `every_s` for at most `for_s`; (seconds until the server stopped it, whether it
    did: the connection was closed, answered or reset before all of it was sent)."""
    start = time.monotonic()
    for i in range(len(data)):
        if time.monotonic() - start > for_s:
            return time.monotonic() - start, False
        try:
            s.sendall(data[i:i + 1])
        except OSError:  # reset or broken pipe: closed
            return time.monotonic() - start, True
        s.settimeout(every_s)
        try:
            if s.recv(65536, socket.MSG_PEEK):
                return time.monotonic() - start, True
            return time.monotonic() - start, True  # b"": closed
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start, True
    return time.monotonic() - start, False


def _read_all(s: socket.socket, limit_s: float = 10) -> bytes:
    s.settimeout(limit_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _status(raw: bytes) -> int:
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", raw)
    assert m, raw[:200]
    return int(m.group(1))


def test_a_slow_header_client_is_cut_off_with_408(api: tuple[Api, dict[str, str]]) -> None:
    proc, _ = api
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    with proc.connect() as s:
        took, stopped = _trickle(s, head, every_s=0.2, for_s=HEADER_S + 6)
        assert stopped, f"still sending headers after {took:.1f} s"
        assert took < HEADER_S + 2, took
        raw = _read_all(s)
    assert _status(raw) == 408, raw
    body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"


def test_a_silent_connection_is_closed_at_the_header_timeout(api: tuple[Api, dict[str, str]]) -> None:
    proc, _ = api
    with proc.connect() as s:
        start = time.monotonic()
        raw = _read_all(s, limit_s=HEADER_S + 6)
        took = time.monotonic() - start
    assert took < HEADER_S + 2 and _status(raw) == 408, (took, raw)


def test_a_slow_body_client_is_cut_off_with_408(api: tuple[Api, dict[str, str]]) -> None:
    proc, headers = api
    body = json.dumps({"preset": "tiny", "name": "x" * 150}).encode()
    head = (f"POST /v1/jobs?dry_run=true HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: {headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with proc.connect() as s:
        s.sendall(head)
        took, stopped = _trickle(s, body, every_s=0.2, for_s=BODY_S + 6)
        assert stopped, f"still sending the body after {took:.1f} s"
        assert took < BODY_S + 2, took
        raw = _read_all(s)
    assert _status(raw) == 408, raw


def test_a_body_at_the_minimum_rate_is_not_cut(api: tuple[Api, dict[str, str]]) -> None:
    """1,000 bytes/s is the floor here: 24,000 bytes sent at about 8,000 bytes/s over 3 s (past the 1.5 s
    body timeout) arrive whole, and the request is answered."""
    proc, headers = api
    body = json.dumps({"preset": "tiny", "name": "slow but steady", "tags": ["t" * 60] * 10}).encode()
    body = body[:-1] + b" " * (24_000 - len(body)) + b"}"
    head = (f"POST /v1/jobs?dry_run=true HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: {headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with proc.connect() as s:
        s.sendall(head)
        for i in range(0, len(body), 800):
            s.sendall(body[i:i + 800])
            time.sleep(0.1)
        raw = _read_all(s, limit_s=30)
    assert _status(raw) in (200, 422), raw[:300]  # answered by the app (the estimate, or its spec problems)


def _get(s: socket.socket) -> int:
    """One keep-alive `GET /healthz` on `s`: its status."""
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    s.settimeout(10)
    raw = b""
    while b"\r\n\r\n" not in raw or not raw.endswith(b"}"):
        chunk = s.recv(65536)
        if not chunk:
            break
        raw += chunk
    return _status(raw)


def _served_again(proc: Api) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with proc.connect() as s:
            if _get(s) == 200:
                return True
        time.sleep(0.2)
    return False


def test_connections_beyond_the_cap_get_503_and_the_open_ones_keep_working(
        api: tuple[Api, dict[str, str]]) -> None:
    proc, _ = api
    assert _served_again(proc)  # the other tests' connections are gone
    time.sleep(0.3)
    held = [proc.connect() for _ in range(MAX_CONNECTIONS)]
    try:
        assert [_get(s) for s in held] == [200] * MAX_CONNECTIONS  # now kept alive, idle (not in a head)
        with proc.connect() as extra:  # one more than the cap: refused at its first request
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            raw = _read_all(extra)
        assert _status(raw) == 503, raw
        assert _get(held[0]) == 200  # a connection within the cap is still served
    finally:
        for s in held:
            s.close()
    assert _served_again(proc)  # once they are closed, new connections are served again


def test_a_normal_request_still_works(api: tuple[Api, dict[str, str]]) -> None:
    proc, headers = api
    with httpx.Client(base_url=proc.url, headers=headers, timeout=30) as c:
        for _ in range(3):  # kept alive across requests
            assert c.get("/healthz").status_code == 200
        r = c.post("/v1/jobs", json={"preset": "tiny"})
        assert r.status_code == 201, r.text
        assert c.get(f"/v1/jobs/{r.json()['id']}").status_code == 200


def test_production_starts_the_api_with_the_bounded_protocol() -> None:
    """worker/run.py (`make run`), the Dockerfile and docker-compose.yml all name `--http api.timeouts:...`."""
    run = (ROOT / "worker" / "run.py").read_text()
    assert f'"--http", "{HTTP_PROTOCOL}"' in run
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    cmd = compose["services"]["api"]["command"]
    assert cmd[cmd.index("--http") + 1] == HTTP_PROTOCOL, cmd
    docker = next(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("CMD"))
    argv: list[Any] = json.loads(docker[3:].strip())
    assert argv[argv.index("--http") + 1] == HTTP_PROTOCOL, argv
    assert shlex.join(argv).startswith("uvicorn --factory api.main:create_app")
