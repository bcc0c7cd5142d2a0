"""Faults that used to lose a job at the API (issue 19): a broker 503 under an Idempotency-Key, and reads
after the database dropped its connections."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from service.db.models import Job

Sim = Any


def test_idempotency_key_retry_after_broker_503_queues_the_job(client: TestClient, alice: dict, sim: Sim) -> None:
    producer = client.app.state.peagle.producer
    real_send = producer.send_train
    calls: list[str] = []

    def send_once_down(job_id: str, queue: str, task_id: str | None = None) -> str:
        calls.append(job_id)
        if len(calls) == 1:
            raise ConnectionError("broker down (test)")
        return real_send(job_id, queue, task_id)

    producer.send_train = send_once_down
    h = {**alice, "Idempotency-Key": "retry-after-503"}
    first = client.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
    assert first.status_code == 503 and first.json()["error"]["code"] == "queue_unavailable"
    second = client.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
    assert second.status_code == 201, second.text
    assert "Idempotent-Replayed" not in second.headers  # really created and queued this time
    job = second.json()
    assert job["status"] == "queued" and job["id"] != calls[0] and calls[1] == job["id"]
    third = client.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
    assert third.status_code == 201 and third.headers["Idempotent-Replayed"] == "true"
    assert third.json() == job and len(calls) == 2  # the replay sends nothing
    with sim.sessions() as s:
        rows = s.execute(sa.select(Job.id, Job.status, Job.idempotency_key).order_by(Job.created_at)).all()
    assert [(r[1], r[2]) for r in rows] == [("failed", None), ("queued", "retry-after-503")]
