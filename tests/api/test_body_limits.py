"""Bounded bodies against a REAL server process: an unauthenticated or over-limit body is refused before
it is read (the server's memory stays small), a chunked body is cut at the limit."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import ApiProcess, api_key

MIB = 1024 * 1024


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[ApiProcess, dict[str, str]]]:
    db = f"sqlite:///{tmp_path / 'service.db'}"
    from service.db import upgrade

    upgrade(db)
    headers = api_key(db)
    proc = ApiProcess(tmp_path, {"PEAGLE_DATABASE_URL": db, "PEAGLE_BROKER_URL": "filesystem://",
                                 "PEAGLE_MAX_REQUEST_BODY_BYTES": str(MIB)})
    yield proc, headers
    proc.close()


def _post(port: int, head: dict[str, str], body_bytes: int, *, chunked: bool = False, timeout: float = 30.0
          ) -> tuple[int, dict[str, object], int]:
    """POST `body_bytes` of a JSON-ish body to /v1/jobs over a raw socket, stopping as soon as the server
    answers. Returns (status, error body, bytes sent)."""
    lines = ["POST /v1/jobs HTTP/1.1", f"Host: 127.0.0.1:{port}", "Content-Type: application/json",
             *(f"{k}: {v}" for k, v in head.items())]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {body_bytes}")
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    chunk = b'{"preset": "tiny", "name": "' + b"x" * (MIB - 30)
    sent = 0
    sock.setblocking(False)
    reply = b""
    deadline = time.monotonic() + timeout
    try:
        while sent < body_bytes and time.monotonic() < deadline:
            try:
                reply += sock.recv(65536)
                if reply:
                    break
            except BlockingIOError:
                pass
            piece = chunk[: min(len(chunk), body_bytes - sent)]
            data = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") if chunked else piece
            try:
                sock.sendall(data)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        sock.setblocking(True)
        while b"\r\n\r\n" not in reply:
            more = sock.recv(65536)
            if not more:
                break
            reply += more
        head_s, _, rest = reply.partition(b"\r\n\r\n")
        status = int(head_s.split(b" ", 2)[1])
        length = next(int(h.split(b":", 1)[1]) for h in head_s.split(b"\r\n") if h.lower().startswith(b"content-length"))
        while len(rest) < length:
            more = sock.recv(65536)
            if not more:
                break
            rest += more
        return status, json.loads(rest[:length]), sent
    finally:
        sock.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_unauthenticated_300_mib_body_is_refused_before_it_is_read(api: tuple[ApiProcess, dict[str, str]],
                                                                      chunked: bool) -> None:
    proc, _ = api
    before = proc.rss_kib()
    start = time.monotonic()
    status, body, sent = _post(proc.port, {}, 300 * MIB, chunked=chunked)
    assert time.monotonic() - start < 5
    assert status in (401, 413) and body["error"]["code"] in ("unauthorized", "payload_too_large")
    assert sent < 64 * MIB  # answered long before the client could send it all
    assert proc.rss_kib() - before < 32 * 1024


def test_an_authenticated_body_over_the_limit_is_413(api: tuple[ApiProcess, dict[str, str]]) -> None:
    proc, headers = api
    before = proc.rss_kib()
    status, body, _ = _post(proc.port, headers, 300 * MIB)  # declared: refused at once
    assert status == 413 and body["error"]["code"] == "payload_too_large"
    status, body, sent = _post(proc.port, headers, 300 * MIB, chunked=True)  # counted while streamed
    assert status == 413 and body["error"]["code"] == "payload_too_large"
    assert sent < 64 * MIB
    assert proc.rss_kib() - before < 32 * 1024
    status, body, _ = _post(proc.port, headers, 2 * MIB, chunked=True)  # just over the limit, sent whole
    assert status == 413, body


def test_bodies_under_the_limit_still_work(api: tuple[ApiProcess, dict[str, str]]) -> None:
    import httpx

    proc, headers = api
    r = httpx.post(f"{proc.url}/v1/jobs", json={"preset": "tiny", "name": "n" * 200}, headers=headers, timeout=30)
    assert r.status_code == 201, r.text

    def chunks() -> Iterator[bytes]:
        yield b'{"preset": '
        yield b'"tiny"}'

    r = httpx.post(f"{proc.url}/v1/jobs", content=chunks(), headers={**headers, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 201, r.text
    r = httpx.post(f"{proc.url}/v1/jobs", json={"preset": "tiny"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
