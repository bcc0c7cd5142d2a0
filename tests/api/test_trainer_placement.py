"""Issue 37: a split job's trainer is placed by `resources.trainer.queue` (its `peagle.train` task goes
there, that queue becomes the job's queue) and refused before queueing when no live worker consumes it, or
none consumes the split job's engine queue (`resources.engine.queue`, default `engine-<the job's queue>`).
A job without these fields is queued and checked exactly as before."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.main import create_app
from peagle.spec import preset
from service.db.models import Job, Worker
from service.db.session import make_session_factory, session_scope
from service.db.workers import announce
from service.queue import make_producer


def _split(trainer_queue: str | None, engine_queue: str | None = None) -> dict[str, Any]:
    spec = preset("demo").model_dump(mode="json")
    spec["resources"].update(target_engine="vllm", capture="online", engine={"replicas": 2, "queue": engine_queue})
    if trainer_queue is not None:
        spec["resources"]["trainer"] = {"queue": trainer_queue}
    return {"spec": spec, "queue": "q1"}


def _problems(c: TestClient, h: dict[str, str], body: dict[str, Any]) -> dict[str, str]:
    r = c.post("/v1/jobs", json=body, headers=h)
    assert r.status_code == 422, r.text
    dry = c.post("/v1/jobs?dry_run=true", json=body, headers=h).json()
    assert dry["valid"] is False
    return {p["param"]: p["message"] for p in dry["problems"]}


def test_trainer_queue_places_the_train_task_and_needs_a_worker(settings_factory: Any, sim: Any) -> None:
    settings = settings_factory(vllm_on_workers="yes")
    h = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    factory = make_session_factory(sim.engine)
    with session_scope(factory) as s:  # a trainer worker on q1 and engine workers of q1 only
        announce(s, name="trainer-q1", queues=["q1"], gpus=0)
        announce(s, name="engine-q1", queues=["engine-q1"], gpus=0)
    with TestClient(create_app(settings)) as c:
        got = _problems(c, h, _split("q2"))
        assert "no live worker consumes queue 'q2'" in got["/resources/trainer/queue"], got
        got = _problems(c, h, _split(None, engine_queue="engine-big"))
        assert "no live worker consumes queue 'engine-big'" in got["/resources/engine/queue"], got
        with session_scope(factory) as s:
            assert s.scalar(sa.select(sa.func.count()).select_from(Job)) == 0  # nothing was queued
            announce(s, name="trainer-q2", queues=["q2"], gpus=0)
        got = _problems(c, h, _split("q2"))  # the engines default beside the trainer's queue: engine-q2
        assert "no live worker consumes queue 'engine-q2'" in got["/resources/engine/queue"], got
        with session_scope(factory) as s:
            announce(s, name="engine-q2", queues=["engine-q2"], gpus=0)
        r = c.post("/v1/jobs", json=_split("q2"), headers=h)
        assert r.status_code == 201, r.text
        placed = r.json()["id"]
        r = c.post("/v1/jobs", json=_split(None), headers=h)  # without resources.trainer: the job's queue
        assert r.status_code == 201, r.text
        plain = r.json()["id"]
    producer = make_producer(settings)
    try:
        with session_scope(factory) as s:
            rows = {j.id: j for j in s.scalars(sa.select(Job))}
            assert rows[placed].queue == "q2" and rows[plain].queue == "q1"
            assert producer.waiting_task_ids("q2") == {rows[placed].celery_task_id}
            assert producer.waiting_task_ids("q1") == {rows[plain].celery_task_id}
            s.execute(sa.delete(Worker))
    finally:
        producer.close()
