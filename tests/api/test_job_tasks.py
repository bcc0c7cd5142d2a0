"""GET /v1/jobs/{id}/tasks (issue 37): the trainer and, per engine worker, the chunks it ran (chunks done,
tokens/s), worker labels that name no host; owner-scoped."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from service.db import engine_tasks as et
from service.db.session import session_scope


def test_tasks_of_a_split_job(client: TestClient, alice: dict, bob: dict, sim: Any, submit: Any) -> None:
    job = submit(client, alice, preset="tiny")
    got = client.get(f"/v1/jobs/{job['id']}/tasks", headers=alice).json()
    assert got["object"] == "list" and [t["role"] for t in got["data"]] == ["trainer"]
    sim.set(job["id"], status="running", lease_owner="trainer-host:123:abc")
    with session_scope(sim.sessions) as s:
        et.plan_sends(s, job["id"], kind="capture", pending=[0, 1, 2], generation=1, replicas=3, lease_seconds=60,
                      max_attempts=3)
        for i, w in ((0, "hostA:1"), (1, "hostB:2"), (2, "hostA:1")):
            et.start_chunk(s, job["id"], "capture", i, worker=w, gpus=1, lease_seconds=60)
        et.end_chunk(s, job["id"], "capture", 0, worker="hostA:1", state="done", tokens=1000, seconds=2.0)
        et.end_chunk(s, job["id"], "capture", 1, worker="hostB:2", state="done", tokens=300, seconds=3.0)
    rows = client.get(f"/v1/jobs/{job['id']}/tasks", headers=alice).json()["data"]
    assert rows[0]["role"] == "trainer" and rows[0]["state"] == "running"
    engines = {(r["chunks_done"], r["chunks_total"], r["state"], r["tokens_per_second"]) for r in rows[1:]}
    assert engines == {(1, 2, "running", 500.0), (1, 1, "done", 100.0)}
    text = str(rows)
    assert "host" not in text and all(r["worker"].startswith("w-") for r in rows)
    assert client.get(f"/v1/jobs/{job['id']}/tasks", headers=bob).status_code == 404
