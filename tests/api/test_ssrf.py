"""SSRF through webhooks (issue 19): internal URLs are refused when an endpoint is created (422 naming
`url`) and when a message is sent (a loopback listener must receive nothing); a name that resolved to a
public address at creation and to a private one at send time (DNS rebinding) is refused too; redirects are
not followed; deliveries record a status code and an error class, never the receiver's body.

The allow-list (`webhook_allow_hosts`) is empty here unless a test sets it. Traffic only ever goes to
listeners these tests start on 127.0.0.1 / ::1.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.test_webhooks import wait_for
from worker.webhooks import run_dispatcher


class Listener:
    """A bare TCP listener that counts every connection it accepts (and closes it at once)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    yield lst
    lst.close()


@pytest.fixture
def listener6() -> Iterator[Listener]:
    lst = Listener("::1")
    yield lst
    lst.close()


def loopback_spellings(port: int, port6: int) -> list[str]:
    """Every way to write "this machine" that the HTTP client would connect to."""
    return [f"http://127.0.0.1:{port}/h", f"http://2130706433:{port}/h", f"http://0x7f000001:{port}/h",
            f"http://0177.0.0.1:{port}/h", f"http://127.1:{port}/h", f"http://localhost:{port}/h",
            f"http://0.0.0.0:{port}/h", f"http://[::ffff:127.0.0.1]:{port}/h", f"http://[::ffff:7f00:1]:{port}/h",
            f"http://[::1]:{port6}/h", f"http://LOCALHOST.:{port}/h"]


INTERNAL = ["http://10.0.0.1/h", "http://172.16.0.1/h", "http://172.31.255.254/h", "http://192.168.1.1/h",
            "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/latest", "http://[fe80::1]/h",
            "http://100.64.0.1/h", "http://224.0.0.1/h", "http://[ff02::1]/h", "http://240.0.0.1/h",
            "http://metadata.google.internal/computeMetadata/v1/", "http://metadata/h", "http://[fc00::1]/h",
            "http://[::]/h", "http://0/h", "http://0x0a000001/h", "http://[2002:7f00:1::]/h",
            "https://[::ffff:10.0.0.1]/h", "http://012.0.0.1/h"]


@pytest.fixture
def ssrf_settings(settings_factory: Any) -> Callable[..., Any]:
    """Settings with the allow-list empty (explicitly) and a fast dispatcher."""
    def make(**over: Any) -> Any:
        kw: dict[str, Any] = dict(webhook_allow_hosts="", webhook_retry_base_seconds=0.2,
                                  webhook_poll_seconds=0.05, webhook_max_attempts=1, webhook_timeout_seconds=3,
                                  webhook_tests_per_minute=100)  # one test message per spelling
        kw.update(over)
        return settings_factory(**kw)
    return make


@pytest.fixture
def run_dispatch(ssrf_settings: Any) -> Iterator[Callable[..., None]]:
    """`run_dispatch(**settings)` starts the real dispatcher loop in a thread (stopped at teardown)."""
    from service.db.session import make_engine, make_session_factory

    started: list[tuple[threading.Event, threading.Thread, Any]] = []

    def start(**over: Any) -> None:
        settings = ssrf_settings(**over)
        engine = make_engine(settings.resolved_database_url())
        stop = threading.Event()
        t = threading.Thread(target=run_dispatcher, args=(settings, make_session_factory(engine), stop), daemon=True)
        t.start()
        started.append((stop, t, engine))

    yield start
    for stop, t, engine in started:
        stop.set()
        t.join(timeout=20)
        engine.dispose()


def _insert_endpoint(sim: Any, url: str) -> str:
    """An endpoint row written directly (as one created before the guard existed): bypasses creation checks."""
    from service.db import webhooks as wh
    from service.db.models import Owner, WebhookEndpoint, new_id
    from service.db.session import session_scope

    with session_scope(sim.sessions) as s:
        owner_id = s.scalar(sa.select(Owner.id).where(Owner.name == "alice"))
        ep = WebhookEndpoint(id=new_id("wh"), owner_id=owner_id, url=url, description="", events=["job.failed"],
                             secret=wh.new_secret(), start_event_id=0)
        s.add(ep)
        s.flush()
        return ep.id


def _deliveries(client: TestClient, headers: dict[str, str], wid: str) -> list[dict[str, Any]]:
    r = client.get(f"/v1/webhooks/{wid}/deliveries", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def test_userinfo_refused_at_creation(ssrf_settings: Any, sim: Any) -> None:
    key = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    with TestClient(create_app(ssrf_settings(webhook_allow_hosts="example.com"))) as client:
        for url in ("https://user:pass@example.com/hook", "https://user@example.com/hook",
                    "https://:pw@example.com/hook"):
            r = client.post("/v1/webhooks", json={"url": url, "events": ["job.failed"]}, headers=key)
            assert r.status_code == 422, (url, r.text)
            assert r.json()["error"]["param"] == "/url", r.json()


def test_internal_spellings_refused_at_creation(ssrf_settings: Any, sim: Any, listener: Listener,
                                                listener6: Listener) -> None:
    key = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    with TestClient(create_app(ssrf_settings())) as client:
        for url in loopback_spellings(listener.port, listener6.port) + INTERNAL:
            r = client.post("/v1/webhooks", json={"url": url, "events": ["job.failed"]}, headers=key)
            assert r.status_code == 422, (url, r.text)
            err = r.json()["error"]
            assert err["param"] == "/url" and "address" in err["message"], (url, err)
        assert client.get("/v1/webhooks", headers=key).json()["data"] == []
    assert listener.accepted == 0 and listener6.accepted == 0


def test_existing_internal_endpoints_refused_at_send_time(ssrf_settings: Any, sim: Any, listener: Listener,
                                                           listener6: Listener, run_dispatch: Any) -> None:
    """Rows that predate the guard (or were written around it) never reach the loopback listener."""
    key = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    urls = [*loopback_spellings(listener.port, listener6.port), f"http://user:pw@127.0.0.1:{listener.port}/h"]
    with TestClient(create_app(ssrf_settings())) as client:
        wids = [_insert_endpoint(sim, url) for url in urls]
        for wid in wids:
            assert client.post(f"/v1/webhooks/{wid}/test", headers=key).status_code == 202
        run_dispatch()

        def all_attempted() -> bool:
            return all(_deliveries(client, key, w)[0]["attempts"] >= 1 for w in wids)

        wait_for(all_attempted, what="every delivery attempted")
        for wid, url in zip(wids, urls, strict=True):
            d = _deliveries(client, key, wid)[0]
            assert d["status"] == "failed" and d["last_error"] == "refused_address", (url, d)
            assert d["last_status_code"] is None
    assert listener.accepted == 0 and listener6.accepted == 0


def test_dns_rebinding_refused_at_send_time(ssrf_settings: Any, sim: Any, listener: Listener, run_dispatch: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`rebind.example` is public when the endpoint is created, then answers 127.0.0.1 when it is sent."""
    real = socket.getaddrinfo
    answer = {"ip": "93.184.216.34"}  # public while the endpoint is created (no traffic is ever sent there)

    def fake_getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, (str, bytes)) and (host.decode() if isinstance(host, bytes) else host).rstrip(
                ".").lower() == "rebind.example":
            return real(answer["ip"], port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)
    key = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    with TestClient(create_app(ssrf_settings())) as client:
        r = client.post("/v1/webhooks", json={"url": f"http://rebind.example:{listener.port}/hook",
                                              "events": ["job.failed"]}, headers=key)
        assert r.status_code == 201, r.text
        wid = r.json()["id"]
        answer["ip"] = "127.0.0.1"  # the name now points inside
        assert client.post(f"/v1/webhooks/{wid}/test", headers=key).status_code == 202
        run_dispatch()
        d = wait_for(lambda: [x for x in _deliveries(client, key, wid) if x["attempts"] >= 1], what="attempt")[0]
        assert d["last_error"] == "refused_address" and d["last_status_code"] is None, d
    assert listener.accepted == 0


class _Answer(BaseHTTPRequestHandler):
    """Answers every POST with the server's `answer` (status, headers, body)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        status, headers, body = self.server.answer  # type: ignore[attr-defined]
        self.server.hits += 1  # type: ignore[attr-defined]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[Callable[[int, dict[str, str], bytes], ThreadingHTTPServer]]:
    servers: list[ThreadingHTTPServer] = []

    def make(status: int, headers: dict[str, str], body: bytes) -> ThreadingHTTPServer:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
        srv.answer = (status, headers, body)  # type: ignore[attr-defined]
        srv.hits = 0  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_no_redirects_and_no_remote_body_stored(ssrf_settings: Any, sim: Any, run_dispatch: Any,
                                               answering: Any, listener: Listener) -> None:
    """An allowed internal receiver: a 302 is not followed and a 500's body never reaches the API."""
    target = answering(200, {}, b"ok")
    redirect = answering(302, {"Location": f"http://127.0.0.1:{target.server_address[1]}/x"}, b"moved")
    leaky = answering(500, {}, b"SECRET-INTERNAL-TOKEN " * 20)
    key = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    settings = dict(webhook_allow_hosts="127.0.0.1")
    with TestClient(create_app(ssrf_settings(**settings))) as client:
        wids = []
        for port in (redirect.server_address[1], leaky.server_address[1], listener.port):
            r = client.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{port}/hook", "events": ["job.failed"]},
                            headers=key)
            assert r.status_code == 201, r.text
            wids.append(r.json()["id"])
            assert client.post(f"/v1/webhooks/{wids[-1]}/test", headers=key).status_code == 202
        run_dispatch(**settings)
        wait_for(lambda: all(_deliveries(client, key, w)[0]["attempts"] >= 1 for w in wids), what="attempts")
        time.sleep(0.3)
        moved, failed, closed = (_deliveries(client, key, w)[0] for w in wids)
        listing = client.get(f"/v1/webhooks/{wids[1]}/deliveries", headers=key).text
    assert redirect.hits == 1 and target.hits == 0  # not followed
    assert moved["last_status_code"] == 302 and moved["last_error"] == "http_status", moved
    assert failed["last_status_code"] == 500 and failed["last_error"] == "http_status", failed
    assert "SECRET-INTERNAL-TOKEN" not in listing
    # the listener accepts and hangs up at once: a connection-level failure, recorded as its class only
    assert closed["last_status_code"] is None and closed["last_error"] in ("connect_error", "timeout"), closed
