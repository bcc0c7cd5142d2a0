"""Webhooks: endpoint CRUD, validation, cross-owner 404, and real signed deliveries to a loopback receiver
(verified with the independent `standardwebhooks` package), retries after a 500, giving up."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from standardwebhooks import Webhook

from service.db.session import make_engine, make_session_factory
from tests.api.conftest import make_settings
from worker.webhooks import run_dispatcher

ALLOW = "127.0.0.1"  # the receivers are on loopback: allowed explicitly (the default allow-list is empty)


class Receiver:
    """A real HTTP server on loopback that records every POST and answers `status_for(n)` (n = 1, 2, ...)."""

    def __init__(self, status_for: Callable[[int], int] = lambda n: 200) -> None:
        self.requests: list[dict[str, Any]] = []
        self.status_for = status_for
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.requests.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
                code = outer.status_for(len(outer.requests))
                self.send_response(code)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r["body"]) for r in self.requests]


@pytest.fixture
def receiver() -> Iterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(status_for: Callable[[int], int] = lambda n: 200) -> Receiver:
        made.append(Receiver(status_for))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def settings(tmp_path: Any, db_url: str) -> Any:
    """The API's settings here: loopback receivers allowed."""
    return make_settings(tmp_path, db_url, webhook_allow_hosts=ALLOW)


@pytest.fixture
def dispatcher(settings_factory: Any) -> Iterator[Any]:
    """The real dispatcher loop (as the reaper runs it) in a thread, fast back-off for the test."""
    settings = settings_factory(webhook_retry_base_seconds=0.2, webhook_poll_seconds=0.05, webhook_max_attempts=3,
                                webhook_timeout_seconds=5, webhook_allow_hosts=ALLOW)
    engine = make_engine(settings.resolved_database_url())
    stop = threading.Event()
    t = threading.Thread(target=run_dispatcher, args=(settings, make_session_factory(engine), stop), daemon=True)
    t.start()
    yield t
    stop.set()
    t.join(timeout=20)
    engine.dispose()


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timeout waiting for {what}"
        time.sleep(0.05)


def test_crud_validation_and_cross_owner(client, alice, bob):
    r = client.post("/v1/webhooks", json={"url": "https://example.com/hook", "events": ["job.succeeded"],
                                          "description": "ci"}, headers=alice)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["secret"].startswith("whsec_") and created["events"] == ["job.succeeded"]
    wid = created["id"]
    got = client.get(f"/v1/webhooks/{wid}", headers=alice).json()
    assert "secret" not in got and got["url"] == "https://example.com/hook"
    assert [w["id"] for w in client.get("/v1/webhooks", headers=alice).json()["data"]] == [wid]
    for bad, where in (({"url": "ftp://x/y", "events": ["job.failed"]}, "/url"),
                       ({"url": "not a url", "events": ["job.failed"]}, "/url"),
                       ({"url": "http:///nohost", "events": ["job.failed"]}, "/url"),
                       ({"url": "https://x.example", "events": ["job.exploded"]}, "/events/0"),
                       ({"url": "https://x.example", "events": []}, "/events")):
        r = client.post("/v1/webhooks", json=bad, headers=alice)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["param"] == where, r.json()
    # another owner sees nothing of alice's endpoint
    assert client.get("/v1/webhooks", headers=bob).json()["data"] == []
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/test"), ("GET", "/deliveries")):
        assert client.request(method, f"/v1/webhooks/{wid}{path}", headers=bob).status_code == 404
    assert client.delete(f"/v1/webhooks/{wid}", headers=alice).status_code == 204
    assert client.get(f"/v1/webhooks/{wid}", headers=alice).status_code == 404


def test_signed_deliveries_retry_and_job_events(client, alice, submit, receiver, dispatcher):
    # the 2nd request the receiver sees gets a 500 (then the retry succeeds)
    rec = receiver(lambda n: 500 if n == 2 else 200)
    early = submit(client, alice)  # before the endpoint exists: never delivered
    r = client.post("/v1/webhooks", json={"url": rec.url, "events": ["job.status_changed", "job.cancelled"]},
                    headers=alice)
    assert r.status_code == 201
    wid, secret = r.json()["id"], r.json()["secret"]
    test = client.post(f"/v1/webhooks/{wid}/test", headers=alice)
    assert test.status_code == 202 and test.json()["status"] == "pending"
    wait_for(lambda: len(rec.requests) >= 1, what="the test message")
    job = submit(client, alice)
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=alice).status_code == 200
    # test + queued (500, then retried) + cancelled status change + job.cancelled = 5 requests
    wait_for(lambda: len(rec.requests) >= 5, what="all deliveries")
    time.sleep(0.5)  # nothing else arrives (in particular nothing about the early job)
    verifier = Webhook(secret)
    for req in rec.requests:
        verifier.verify(req["body"], req["headers"])  # raises on a bad signature or stale timestamp
        assert req["headers"]["webhook-id"].startswith("msg_")
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + "A" * 32).verify(rec.requests[0]["body"], rec.requests[0]["headers"])
    bodies = rec.bodies()
    assert bodies[0]["type"] == "webhook.test"
    assert all(b["data"].get("job_id") != early["id"] for b in bodies)
    ids = [r["headers"]["webhook-id"] for r in rec.requests]
    assert len(set(ids)) == 4 and ids.count(ids[1]) == 2  # the retry re-sent the same message id
    unique = {i: b for i, b in zip(ids, bodies, strict=True)}
    kinds = sorted((b["type"], b["data"].get("status")) for b in list(unique.values())[1:])
    assert kinds == [("job.cancelled", "cancelled"), ("job.status_changed", "cancelled"),
                     ("job.status_changed", "queued")]
    deliveries = client.get(f"/v1/webhooks/{wid}/deliveries", headers=alice).json()["data"]
    assert len(deliveries) == 4 and all(d["status"] == "succeeded" for d in deliveries)
    retried = [d for d in deliveries if d["attempts"] == 2]
    assert len(retried) == 1 and retried[0]["last_status_code"] == 200 and retried[0]["id"] == ids[1]


def test_gives_up_after_max_attempts(client, alice, receiver, dispatcher):
    rec = receiver(lambda n: 503)
    wid = client.post("/v1/webhooks", json={"url": rec.url, "events": ["job.failed"]}, headers=alice).json()["id"]
    client.post(f"/v1/webhooks/{wid}/test", headers=alice)

    def failed() -> Any:
        data = client.get(f"/v1/webhooks/{wid}/deliveries", headers=alice).json()["data"]
        return data if data and data[0]["status"] == "failed" else None

    d = wait_for(failed, what="the delivery to fail")[0]
    assert d["attempts"] == 3 and d["last_status_code"] == 503 and d["last_error"] == "http_status"
    assert len(rec.requests) == 3


def test_test_messages_are_rate_limited_per_owner(client, alice, bob):
    """`/test` queues an outbound request on demand: at most `webhook_tests_per_minute` (5) per owner in any
    60 s, over all their endpoints; past it 429 with Retry-After. Another owner is not affected."""
    def endpoint(headers: dict) -> str:
        r = client.post("/v1/webhooks", json={"url": "https://example.com/hook", "events": ["job.failed"]},
                        headers=headers)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    first, second = endpoint(alice), endpoint(alice)
    for i in range(5):
        assert client.post(f"/v1/webhooks/{(first, second)[i % 2]}/test", headers=alice).status_code == 202
    for wid in (first, second):
        r = client.post(f"/v1/webhooks/{wid}/test", headers=alice)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 61
    assert len(client.get(f"/v1/webhooks/{first}/deliveries", headers=alice).json()["data"]) == 3
    assert client.post(f"/v1/webhooks/{endpoint(bob)}/test", headers=bob).status_code == 202
