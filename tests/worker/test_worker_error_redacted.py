"""Issue 19: a supervisor crash fails the job without showing the exception's text (a host path, file
content) to the job's owner; the worker log keeps the details."""

from __future__ import annotations

import sqlalchemy as sa

from service.db import upgrade
from service.db.models import Job, JobEvent
from service.db.session import make_engine, make_session_factory, session_scope
from service.settings import Settings
from tests.worker.conftest import new_job
from worker import tasks


def test_supervisor_crash_message_names_no_host_path(tmp_path, monkeypatch, caplog):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    factory = make_session_factory(engine)
    job_id = new_job(factory)

    def boom(self):
        raise OSError("cannot read /srv/tenants/owner_a/secret.jsonl: root:x:0:0")

    monkeypatch.setattr(tasks.Supervisor, "run", boom)
    settings = Settings(home=tmp_path / "home", database_url=url)
    with caplog.at_level("ERROR"):
        assert tasks.run_job(settings, job_id) == "failed"
    with session_scope(factory) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.error_code == "worker_error"
        shown = [job.error_message or "", *s.scalars(sa.select(JobEvent.message).where(JobEvent.job_id == job_id))]
    engine.dispose()
    assert all("/srv" not in m and "root:x" not in m for m in shown), shown
    assert "OSError" in (job.error_message or "")
    assert "/srv/tenants" in caplog.text  # the operator still sees it
