"""Queue routing with a REAL API process (uvicorn subprocess), a real Redis broker and PostgreSQL.

The producer once appended a queue to Celery's `task_queues` after Celery had built its router, so an API
process could only queue to the first queue it ever sent to (503 `Queue 'cpu' missing from task_queues`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service.db import upgrade
from service.db.session import make_engine, make_session_factory
from tests.api.conftest import ApiProcess, api_key

pytestmark = pytest.mark.integration

@pytest.fixture
def pg_db(postgres_url: str) -> str:
    upgrade(postgres_url)
    return postgres_url


@pytest.fixture
def redis_broker(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _task_ids(client: redis.Redis, queue: str) -> set[str]:
    return {json.loads(body)["headers"]["id"] for body in client.lrange(queue, 0, -1)}


def test_one_api_process_queues_to_every_queue_in_any_order(tmp_path: Path, pg_db: str, redis_url: str,
                                                            redis_broker: redis.Redis) -> None:
    tag = uuid.uuid4().hex[:8]
    gpu, cpu = f"gpu-{tag}", f"cpu-{tag}"
    headers = api_key(pg_db)
    api = ApiProcess(tmp_path, {"PEAGLE_DATABASE_URL": pg_db, "PEAGLE_BROKER_URL": redis_url,
                                "PEAGLE_REDIS_URL": redis_url})
    try:
        jobs: list[dict[str, Any]] = []
        for queue in (gpu, cpu, gpu):
            r = httpx.post(f"{api.url}/v1/jobs", json={"preset": "tiny", "queue": queue}, headers=headers, timeout=30)
            assert r.status_code == 201, r.text
            jobs.append(r.json())
        db_jobs = {j["id"]: j for j in httpx.get(f"{api.url}/v1/jobs", headers=headers, timeout=30).json()["data"]}
        assert {db_jobs[j["id"]]["status"] for j in jobs} == {"queued"}
        assert len(_task_ids(redis_broker, gpu)) == 2
        assert len(_task_ids(redis_broker, cpu)) == 1

        # resume a job of yet another queue (pause it first: queued -> paused)
        r = httpx.post(f"{api.url}/v1/jobs", json={"preset": "tiny", "queue": f"other-{tag}"}, headers=headers,
                       timeout=30)
        assert r.status_code == 201, r.text
        other = r.json()["id"]
        assert httpx.post(f"{api.url}/v1/jobs/{other}/pause", headers=headers, timeout=30).json()["status"] == "paused"
        r = httpx.post(f"{api.url}/v1/jobs/{jobs[1]['id']}/pause", headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        for job_id in (other, jobs[1]["id"]):
            r = httpx.post(f"{api.url}/v1/jobs/{job_id}/resume", headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["status"] == "queued"
            assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()["status"] == "queued"
        engine = make_engine(pg_db)
        try:
            from service.db.models import Job

            with make_session_factory(engine)() as s:
                for job_id, queue in ((other, f"other-{tag}"), (jobs[1]["id"], cpu)):
                    assert s.get(Job, job_id).celery_task_id in _task_ids(redis_broker, queue)
        finally:
            engine.dispose()
        assert "missing from task_queues" not in api.log.read_text()
    finally:
        api.close()
        redis_broker.delete(gpu, cpu, f"other-{tag}")


@pytest.mark.parametrize("broker", ["redis", "filesystem"])
def test_one_producer_sends_to_every_queue(broker: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The reaper's path: one `Producer` re-sends to several queues in turn (it used to reach only the first)."""
    from service.queue import make_producer
    from service.settings import get_settings

    tag = uuid.uuid4().hex[:8]
    over: dict[str, Any] = {"home": tmp_path / "home", "database_url": f"sqlite:///{tmp_path / 'db'}"}
    if broker == "redis":
        over["broker_url"] = request.getfixturevalue("redis_url")
    settings = get_settings(**over)
    producer = make_producer(settings)
    sent: dict[str, set[str]] = {}
    try:
        for queue in (f"gpu-{tag}", f"cpu-{tag}", f"gpu-{tag}", f"a100-{tag}"):
            sent.setdefault(queue, set()).add(producer.send_train(f"job_{len(sent)}", queue))
        for queue, ids in sent.items():
            assert producer.waiting_task_ids(queue) == ids
    finally:
        if broker == "redis":
            client = redis.Redis.from_url(settings.resolved_broker_url())
            client.delete(*sent)
            client.close()
        producer.close()


def test_broker_down_is_a_generic_503_with_the_detail_in_the_server_log(tmp_path: Path) -> None:
    """The client reads a clear reason; the broker's address and error are only in the server's log."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: "Error 111 connecting to 127.0.0.1:<port>"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = f"sqlite:///{tmp_path / 'service.db'}"
    upgrade(db)
    headers = api_key(db)
    api = ApiProcess(tmp_path, {"PEAGLE_DATABASE_URL": db, "PEAGLE_BROKER_URL": f"redis://127.0.0.1:{port}/0"})
    try:
        r = httpx.post(f"{api.url}/v1/jobs", json={"preset": "tiny"}, headers=headers, timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "queue_unavailable" and r.headers["Retry-After"]
        job = httpx.get(f"{api.url}/v1/jobs", headers=headers, timeout=30).json()["data"][0]
        assert job["status"] == "failed" and job["error"]["code"] == "queue_unavailable"
        ready = httpx.get(f"{api.url}/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["checks"]["broker"] is False
        for text in (r.text, json.dumps(job), ready.text):
            for infra in ("127.0.0.1", str(port), "redis://", "Error 111", "onnection refused"):
                assert infra not in text, (infra, text)
        assert "the job queue is unavailable" in r.json()["error"]["message"]
        assert str(port) in api.log.read_text()  # the detail is logged for the operator
    finally:
        api.close()
