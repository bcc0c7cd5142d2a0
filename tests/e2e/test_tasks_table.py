"""The job page's tasks table (issue 37) in a real browser against the real API: a job split over engine
workers (`resources.engine`) shows its trainer and, per engine worker, the chunks it ran. The rows are
written as the trainer worker's dispatcher and the engine workers write them (`service.db.engine_tasks`)."""

from __future__ import annotations

from typing import Any

import pytest

from api.routes.tasks import worker_label
from service.db import engine_tasks as et
from service.db.models import Job
from service.db.session import session_scope
from tests.e2e.conftest import Server, shot

pytestmark = pytest.mark.e2e


def test_job_page_shows_the_tasks_table(page: Any, server: Server, feeder: Any) -> None:
    with server.client() as c:
        r = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {"name": "split e2e"}})
        assert r.status_code == 201, r.text
        job_id = str(r.json()["id"])
    feeder.claim(job_id)
    with session_scope(feeder.sessions) as s:  # the job is split: its chunks run on two engine workers
        job = s.get(Job, job_id)
        assert job is not None
        job.spec = {**job.spec, "resources": {**job.spec["resources"], "engine": {"gpus": 0, "replicas": 2}}}
        assert et.plan_sends(s, job_id, kind="capture", pending=[0, 1, 2], generation=1, replicas=3,
                             lease_seconds=600, max_attempts=3) == ([0, 1, 2], [])
        for index, worker in ((0, "engine-a@host1"), (1, "engine-b@host2"), (2, "engine-a@host1")):
            assert et.start_chunk(s, job_id, "capture", index, worker=worker, gpus=0, lease_seconds=600) == 1
        et.end_chunk(s, job_id, "capture", 0, worker="engine-a@host1", state="done", tokens=4096, seconds=2.0)
        et.end_chunk(s, job_id, "capture", 1, worker="engine-b@host2", state="done", tokens=1000, seconds=1.0)
    pg = page
    pg.goto(f"/job.html?id={job_id}")
    table = pg.locator("table.tasks")
    table.wait_for()
    rows = [[c.strip() for c in row.locator("td").all_inner_texts()] for row in table.locator("tbody tr").all()]
    a, b = worker_label("engine-a@host1"), worker_label("engine-b@host2")
    assert rows[0][0] == "trainer" and rows[0][1] == worker_label("e2e-feeder") and rows[0][3] == "running"
    engines = {r[1]: r for r in rows[1:]}
    assert set(engines) == {a, b}, rows
    assert engines[a][0] == "engine" and engines[a][3] == "running" and engines[a][4] == "1 / 2"  # chunk 2 runs
    assert engines[a][5] == "2,048"
    assert engines[b][3] == "done" and engines[b][4] == "1 / 1" and engines[b][5] == "1,000"
    assert "host1" not in table.inner_text()  # a label, never the host name
    shot(pg, "job-tasks-1280")
