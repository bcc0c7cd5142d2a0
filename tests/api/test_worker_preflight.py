"""Issue 39: a job no running worker can take is refused before queueing: no live worker consumes its queue,
or none of them has `resources.gpus` GPUs (the `gpu-llama3-8b` preset on a stack with only a CPU worker was
`valid: true`). Workers announce themselves in the database (`service.db.workers`); these tests run a REAL
worker process (`python -m worker`, as `make run` starts it) against the API's database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.main import create_app
from service.db.models import Job, Worker
from service.db.session import make_engine
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _rows(settings: Settings) -> list[tuple[str, list[str], int]]:
    engine = make_engine(settings.resolved_database_url())
    try:
        with engine.connect() as conn:
            return [(r.name, r.queues, r.gpus) for r in conn.execute(sa.select(Worker))]
    finally:
        engine.dispose()


class WorkerProcess:
    """`python -m worker` on `queue` with `gpus` announced, on the settings' database and embedded broker."""

    def __init__(self, settings: Settings, tmp_path: Path, *, queue: str, gpus: int) -> None:
        self.settings = settings
        self.log = tmp_path / f"worker-{queue}.log"
        env = {**os.environ, "PEAGLE_DATABASE_URL": settings.resolved_database_url(),
               "PEAGLE_HOME": str(settings.home), "PEAGLE_EMBEDDED": "false", "PEAGLE_WORKER_GPUS": str(gpus),
               "PEAGLE_HEARTBEAT_SECONDS": "0.5", "PEAGLE_ARTIFACT_ROOT": str(settings.resolved_artifact_root())}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker", "--queue", queue, "--no-reaper"], cwd=ROOT,
                                         env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while not any(queue in q for _, q, _ in _rows(settings)):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "the worker did not announce itself:\n" + self.log.read_text()
            time.sleep(0.3)

    def stop(self) -> None:
        """A warm shutdown (SIGTERM), as `docker compose stop` or Ctrl-C of `make run`."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def cpu_worker(settings: Settings, tmp_path: Path) -> Iterator[WorkerProcess]:
    w = WorkerProcess(settings, tmp_path, queue="cpu", gpus=0)
    yield w
    w.stop()


def _jobs(sim: Any) -> int:
    with sim.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(Job)))


def _problems(client: TestClient, headers: dict, body: dict[str, Any]) -> dict[str, str]:
    """Create is refused (422, nothing queued) and the dry run lists the same problems: {param: message}."""
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 422, r.text
    dry = client.post("/v1/jobs?dry_run=true", json=body, headers=headers).json()
    assert dry["valid"] is False
    got = {p["param"]: p["message"] for p in dry["problems"]}
    assert got == {d["param"]: d["message"] for d in r.json()["error"]["details"]}
    return got


def test_gpu_job_on_a_cpu_only_stack_is_refused(client: TestClient, alice: dict, sim: Any,
                                               cpu_worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub id's own problem is not this test's
    # an `all` worker (the default role) consumes the job queue and its engine queue (issue 37)
    assert [(q, g) for _, q, g in _rows(cpu_worker.settings)] == [(["cpu", "engine-cpu"], 0)]
    got = _problems(client, alice, {"preset": "gpu-llama3-8b"})
    assert "/resources/gpus" in got and "queue 'cpu' have no GPU" in got["/resources/gpus"], got
    got = _problems(client, alice, {"preset": "tiny", "queue": "a100"})
    assert "no live worker consumes queue 'a100'" in got["/queue"] and "consume cpu" in got["/queue"], got
    ok = client.post("/v1/jobs?dry_run=true", json={"preset": "tiny"}, headers=alice).json()
    assert ok["valid"] is True, ok["problems"]
    assert _jobs(sim) == 0


def test_gpu_count_of_the_queue_workers(client: TestClient, alice: dict, settings: Settings, tmp_path: Path) -> None:
    worker = WorkerProcess(settings, tmp_path, queue="gpu", gpus=2)
    try:
        def dry(gpus: int) -> dict[str, Any]:
            body = {"preset": "tiny", "queue": "gpu", "overrides": {"resources": {"device": "cuda", "gpus": gpus,
                                                                                  "precision": "auto"}}}
            return client.post("/v1/jobs?dry_run=true", json=body, headers=alice).json()

        assert dry(2)["valid"] is True, dry(2)["problems"]
        assert [p["param"] for p in dry(4)["problems"]] == ["/resources/gpus"]
        assert "at most 2 GPUs" in dry(4)["problems"][0]["message"]
    finally:
        worker.stop()
    assert _rows(settings) == []  # a stopped worker deletes its row


def test_stopped_and_stale_workers(settings_factory: Any, sim: Any, tmp_path: Path) -> None:
    from datetime import timedelta

    from service.db.models import utcnow
    from service.db.session import make_session_factory, session_scope
    from service.db.workers import announce

    settings = settings_factory()
    body = {"preset": "tiny"}
    h = {"Authorization": f"Bearer {sim.key('dave', 'write')}"}
    with TestClient(create_app(settings)) as c:  # auto: no worker ever announced -> not judged
        assert c.post("/v1/jobs?dry_run=true", json=body, headers=h).json()["valid"] is True
        with session_scope(make_session_factory(sim.engine)) as s:  # a worker that died 2 minutes ago
            announce(s, name="peagle-cpu@gone", queues=["cpu"], gpus=0, now=utcnow() - timedelta(seconds=120))
        got = _problems(c, h, body)
        assert "no worker is running" in got["/queue"], got
    with TestClient(create_app(settings_factory(worker_check="no"))) as c:
        assert c.post("/v1/jobs?dry_run=true", json=body, headers=h).json()["valid"] is True
    with session_scope(make_session_factory(sim.engine)) as s:
        s.execute(sa.delete(Worker))
    with TestClient(create_app(settings_factory(worker_check="yes"))) as c:  # yes: no worker is a problem
        assert "no worker is running" in _problems(c, h, body)["/queue"]
