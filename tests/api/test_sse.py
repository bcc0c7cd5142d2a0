"""SSE streams against a real uvicorn server on loopback with a real httpx client."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from api.main import create_app

Server = Any


def sse(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Parse an SSE line stream into {"id","event","data","comment"} dicts."""
    cur: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if cur:
                yield cur
            cur = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            cur[field] = value if field != "data" else json.loads(value)


@pytest.fixture(params=["poll", pytest.param("redis", marks=pytest.mark.integration)])
def server(request: pytest.FixtureRequest, settings_factory: Any, live_server: Any) -> Iterator[Server]:
    over = {"redis_url": request.getfixturevalue("redis_url")} if request.param == "redis" else {}
    app = create_app(settings_factory(**over))
    with live_server(app) as srv:
        app.state.peagle.keepalive_s = 0.5
        yield srv


def _publish(server: Server, job_id: str) -> None:
    client = server.app.state.peagle.redis_sync
    if client is not None:
        client.publish(f"peagle:job:{job_id}", json.dumps({"job_id": job_id}))


def test_reconnect_with_last_event_id_loses_and_duplicates_nothing(server: Server, sim: Any, alice: dict,
                                                                     submit: Any) -> None:
    with httpx.Client(base_url=server.url, headers=alice, timeout=30) as c:
        jid = c.post("/v1/jobs", json={"preset": "tiny"}).json()["id"]
        sim.set(jid, status="running")
        sim.emit(jid, "metrics", 40)
        got: list[int] = []

        def writer() -> None:  # the "worker" keeps writing while the client reads and reconnects
            for _ in range(12):
                sim.emit(jid, "metrics", 5)
                _publish(server, jid)
                time.sleep(0.05)
            sim.set(jid, status="succeeded")
            _publish(server, jid)

        t = threading.Thread(target=writer)
        with c.stream("GET", f"/v1/jobs/{jid}/metrics/stream") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for ev in sse(r.iter_lines()):
                if "id" in ev:
                    assert ev["event"] == "metric" and ev["data"]["seq"] == int(ev["id"])
                    got.append(int(ev["id"]))
                    if len(got) == 25:
                        break  # drop the connection mid-stream
        t.start()
        ended = None
        with c.stream("GET", f"/v1/jobs/{jid}/metrics/stream", headers={"Last-Event-ID": str(got[-1])}) as r:
            for ev in sse(r.iter_lines()):
                if ev.get("event") == "end":
                    ended = ev["data"]
                    break
                if "id" in ev:
                    got.append(int(ev["id"]))
        t.join()
        assert ended == {"status": "succeeded"}
        assert got == list(range(1, 101))
        # replay of a finished job from the middle, via ?after=
        with c.stream("GET", f"/v1/jobs/{jid}/metrics/stream?after=95") as r:
            evs = list(sse(r.iter_lines()))
        assert [int(e["id"]) for e in evs if "id" in e] == [96, 97, 98, 99, 100]
        assert evs[-1]["event"] == "end"


def test_keepalive_and_live_events(server: Server, sim: Any, alice: dict) -> None:
    with httpx.Client(base_url=server.url, headers=alice, timeout=30) as c:
        jid = c.post("/v1/jobs", json={"preset": "tiny"}).json()["id"]
        sim.set(jid, status="running")
        seen: list[Any] = []
        with c.stream("GET", f"/v1/jobs/{jid}/events/stream") as r:
            it = sse(r.iter_lines())
            for ev in it:
                seen.append(ev)
                if ev.get("comment") == "keep-alive":
                    break
            assert [int(e["id"]) for e in seen if "id" in e] == [1]
            # cancel through the API: the stream sees the state event, then `end` after the worker finishes
            assert c.post(f"/v1/jobs/{jid}/cancel").json()["status"] == "cancelling"
            sim.set(jid, status="cancelled")
            _publish(server, jid)
            rest = []
            for ev in it:
                rest.append(ev)
                if ev.get("event") == "end":
                    break
        ids = [e for e in rest if "id" in e]
        assert ids[0]["data"]["data"]["status"] == "cancelling" and rest[-1]["data"] == {"status": "cancelled"}


def _read_until(c: httpx.Client, url: str, *, headers: dict[str, str] | None = None, stop_after_s: float,
                ) -> tuple[list[int], str | None]:
    """Read a stream for `stop_after_s` (or to its `end`); (seqs, end status). A silent stream raises ReadTimeout."""
    seqs: list[int] = []
    deadline = time.monotonic() + stop_after_s
    with c.stream("GET", url, headers=headers or {}) as r:
        assert r.status_code == 200, r.read()
        for ev in sse(r.iter_lines()):
            if "id" in ev:
                seqs.append(int(ev["id"]))
            if ev.get("event") == "end":
                return seqs, ev["data"]["status"]
            if time.monotonic() > deadline:
                break  # drop the connection wherever the server is (usually waiting for rows)
    return seqs, None


def test_streams_survive_subscribers_dropping_mid_wait(server: Server, sim: Any, alice: dict) -> None:
    """Regression: a subscriber dropped while it waited for rows released the tail's shared lock that its
    cancelled inner wait re-took later (`RuntimeError: Lock is not acquired`); the lock then stayed held and
    every stream of the job went silent (no rows, no keep-alives) while the job kept writing rows.
    Timings shrunk: keep-alive 20 ms, polling 10 ms, subscribers dropping every 10-150 ms for 4 s."""
    server.app.state.peagle.keepalive_s = 0.02
    server.app.state.peagle.hub.poll_s = 0.01
    with httpx.Client(base_url=server.url, headers=alice, timeout=30) as c:
        jid = c.post("/v1/jobs", json={"preset": "tiny"}).json()["id"]
    sim.set(jid, status="running")
    stop = threading.Event()
    failures: list[str] = []
    url = f"/v1/jobs/{jid}/logs/stream"

    def writer() -> None:
        while not stop.is_set():
            sim.emit(jid, "logs", 3)
            _publish(server, jid)
            time.sleep(0.01)

    def subscriber(i: int) -> None:
        rng = random.Random(i)
        last = 0
        with httpx.Client(base_url=server.url, headers=alice, timeout=httpx.Timeout(30, read=3)) as cc:
            while not stop.is_set():
                try:
                    seqs, _ = _read_until(cc, url, headers={"Last-Event-ID": str(last)} if last else None,
                                          stop_after_s=rng.uniform(0.01, 0.15))
                except httpx.HTTPError as e:
                    failures.append(f"subscriber {i}: {type(e).__name__} {e}")
                    return
                if seqs:
                    if seqs != list(range(last + 1, seqs[-1] + 1)):
                        failures.append(f"subscriber {i}: gap or duplicate after {last}")
                        return
                    last = seqs[-1]

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=subscriber, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not failures, failures
    total = sim.job(jid).log_seq
    sim.set(jid, status="succeeded")
    _publish(server, jid)
    with httpx.Client(base_url=server.url, headers=alice, timeout=httpx.Timeout(30, read=3)) as c:
        seqs, end = _read_until(c, url, stop_after_s=30)
    assert seqs == list(range(1, total + 1)) and end == "succeeded"


@pytest.mark.parametrize("value", [b"2147483648", b"9" * 32, b"\xb2", b"-1", b"1e3"])
def test_last_event_id_is_bounded_like_after(server: Server, alice: dict, value: bytes) -> None:
    with httpx.Client(base_url=server.url, headers=alice, timeout=30) as c:
        jid = c.post("/v1/jobs", json={"preset": "tiny"}).json()["id"]
        r = c.get(f"/v1/jobs/{jid}/logs/stream", headers={"Last-Event-ID": value})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "validation_error" and err["param"] == "/last-event-id"
        assert "2147483647" in err["message"]
        assert c.get(f"/v1/jobs/{jid}/logs/stream?after=2147483648").status_code == 422  # the same bound
        with c.stream("GET", f"/v1/jobs/{jid}/logs/stream", headers={"Last-Event-ID": "2147483647"}) as r:
            assert r.status_code == 200


def test_stream_ends_with_an_error_when_the_live_source_fails(server: Server, sim: Any, alice: dict) -> None:
    """The job table disappears under a live stream (a real database error in every read): the stream ends
    with `event: error` instead of going on without rows; once the table is back, a reconnect resumes."""
    server.app.state.peagle.hub.poll_s = 0.05
    with httpx.Client(base_url=server.url, headers=alice, timeout=httpx.Timeout(30, read=5)) as c:
        jid = c.post("/v1/jobs", json={"preset": "tiny"}).json()["id"]
        sim.set(jid, status="running")
        sim.emit(jid, "logs", 3)
        url = f"/v1/jobs/{jid}/logs/stream"
        got: list[int] = []
        error = None
        deadline = time.monotonic() + 15  # keep-alives alone would keep it open for ever
        with c.stream("GET", url) as r:
            for ev in sse(r.iter_lines()):
                if time.monotonic() > deadline:
                    break
                if "id" in ev:
                    got.append(int(ev["id"]))
                    if len(got) == 3:
                        with sim.engine.begin() as conn:
                            conn.execute(sa.text("ALTER TABLE job RENAME TO job_away"))
                if ev.get("event") == "error":
                    error = ev["data"]
                    break
        with sim.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE job_away RENAME TO job"))
        assert got == [1, 2, 3] and error is not None and error["code"] == "live_unavailable"
        sim.emit(jid, "logs", 2)
        sim.set(jid, status="succeeded")
        _publish(server, jid)
        seqs, end = _read_until(c, url, headers={"Last-Event-ID": "3"}, stop_after_s=30)
        assert seqs == [4, 5] and end == "succeeded"
