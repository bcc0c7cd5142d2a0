"""SSE streams against a real uvicorn server on loopback with a real httpx client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

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
