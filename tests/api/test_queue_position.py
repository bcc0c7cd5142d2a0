"""Issue 39: "jobs ahead in the queue" counts the jobs the queue's workers run now, not only queued ones
(the user saw 0 while the only worker was busy with another job)."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

Sim = Any


def test_running_job_counts_as_ahead(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    busy = submit(client, alice, preset="tiny")
    sim.set(busy["id"], status="running")  # the only worker runs it
    est = client.post("/v1/jobs?dry_run=true", json={"preset": "tiny"}, headers=alice).json()
    assert est["queue_position"] == 1 and est["queue_running"] == 1
    assert any("1 running, 0 queued" in n for n in est["notes"]), est["notes"]
    waiting = submit(client, alice, preset="tiny")
    assert client.get(f"/v1/jobs/{waiting['id']}", headers=alice).json()["queue_position"] == 1
    later = submit(client, alice, preset="tiny")
    assert client.get(f"/v1/jobs/{later['id']}", headers=alice).json()["queue_position"] == 2
    sim.set(busy["id"], status="succeeded")  # the worker is free: the first queued job is next
    assert client.get(f"/v1/jobs/{waiting['id']}", headers=alice).json()["queue_position"] == 0


def test_other_queues_do_not_count(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    busy = submit(client, alice, preset="tiny", queue="gpu")
    sim.set(busy["id"], status="running")
    est = client.post("/v1/jobs?dry_run=true", json={"preset": "tiny"}, headers=alice).json()
    assert est["queue_position"] == 0 and est["queue_running"] == 0
