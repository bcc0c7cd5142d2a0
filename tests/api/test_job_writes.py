"""`service.db.jobs`: the queued-jobs quota holds under concurrent creations; a resume the broker refuses
is undone (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from peagle.spec import preset
from service.db import jobs, repo, states
from service.db.models import Job
from service.db.session import make_engine, make_session_factory, session_scope


def _create(sessions: Any, owner_id: int, *, send: jobs.Send, quota: jobs.Quota | None) -> Job:
    spec = preset("tiny")
    with sessions() as session:
        return jobs.create_job(session, owner_id=owner_id, spec=spec.model_dump(mode="json"), name="q",
                               tags=[], queue="cpu", max_restarts=spec.resources.max_restarts, send=send, quota=quota)


def _sent(_job_id: str, _queue: str, _task_id: str) -> str:
    return _task_id


@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)],
                         indirect=True)
def test_concurrent_creations_never_pass_the_queued_quota(db_url: str) -> None:
    engine = make_engine(db_url, pool_size=40, max_overflow=0) if db_url.startswith("postgresql") else make_engine(db_url)
    sessions = make_session_factory(engine)
    with session_scope(sessions) as s:
        owner_id = repo.get_or_create_owner(s, "alice").id
    quota = jobs.Quota(max_queued=15, max_concurrent=100)
    start = threading.Barrier(40)
    outcomes: list[str] = []

    def one() -> None:
        start.wait()
        try:
            _create(sessions, owner_id, send=_sent, quota=quota)
            outcomes.append("created")
        except jobs.QuotaExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=one) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        with sessions() as s:
            queued = s.scalar(sa.select(sa.func.count()).select_from(Job).where(Job.status == states.QUEUED))
        assert len(outcomes) == 40
        assert queued == outcomes.count("created") == 15
    finally:
        engine.dispose()


def test_a_resume_the_broker_refuses_is_undone(db_url: str) -> None:
    engine = make_engine(db_url)
    sessions = make_session_factory(engine)
    try:
        with session_scope(sessions) as s:
            owner_id = repo.get_or_create_owner(s, "alice").id
        job_id = _create(sessions, owner_id, send=_sent, quota=None).id
        with sessions() as s:
            paused = jobs.apply_action(s, owner_id=owner_id, job_id=job_id, action="pause", send=_sent)
            assert paused is not None and paused.job.status == "paused" and paused.changed

        def down(_job_id: str, _queue: str, _task_id: str) -> str:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6393. Connection refused.")

        with sessions() as s, pytest.raises(jobs.QueueUnavailable) as err:
            jobs.apply_action(s, owner_id=owner_id, job_id=job_id, action="resume", send=down)
        assert "127.0.0.1" not in str(err.value)
        with sessions() as s:
            job = s.get(Job, job_id)
            assert job is not None and job.status == states.PAUSED
            events = [e.message for e in repo.read_rows(s, "events", job_id)]
        assert events[-2:] == ["resume requested: paused -> queued", f"resume failed: {jobs.QUEUE_UNAVAILABLE_MESSAGE}"]
        with sessions() as s:
            resumed = jobs.apply_action(s, owner_id=owner_id, job_id=job_id, action="resume", send=_sent)
            assert resumed is not None and resumed.job.status == "queued" and resumed.previous == "paused"
        with sessions() as s:
            again = jobs.apply_action(s, owner_id=owner_id, job_id=job_id, action="resume", send=_sent)
            assert again is not None and not again.changed
        with sessions() as s:
            assert jobs.apply_action(s, owner_id=owner_id + 1, job_id=job_id, action="cancel", send=_sent) is None
    finally:
        engine.dispose()


def test_concurrent_api_creations_never_pass_the_queued_quota(settings_factory: Any, live_server: Any,
                                                              sim: Any) -> None:
    """The same through a real server: 30 concurrent `POST /v1/jobs` against a limit of 10."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from api.main import create_app

    headers = {"Authorization": f"Bearer {sim.key('carol', 'write')}"}
    with live_server(create_app(settings_factory(max_queued_jobs=10, max_concurrent_jobs=1))) as srv:
        httpx.get(f"{srv.url}/v1/jobs", headers=headers, timeout=30)  # the key is cached: all race the insert

        def post(_: int) -> int:
            return httpx.post(f"{srv.url}/v1/jobs", json={"preset": "tiny"}, headers=headers, timeout=60).status_code

        with ThreadPoolExecutor(30) as pool:
            statuses = sorted(pool.map(post, range(30)))
    assert statuses == [201] * 10 + [429] * 20
    with sim.sessions() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Job).where(Job.status == states.QUEUED)) == 10
