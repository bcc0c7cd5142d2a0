"""Fixtures for worker tests: a migrated database, real Celery worker and reaper processes.

`stack` builds one service stack per test on one of two backends:
- `embedded`: SQLite + Celery's `filesystem://` broker under the test's tmp dir (no services);
- `services`: a fresh PostgreSQL database + Redis (broker and live channel), via `postgres_url`/`redis_url`.
Each test gets its own queue name, so concurrent workers of other tests never take its jobs.
Every process started here is in its own process group and is killed at teardown.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[2]
FAKE_TRAINER = Path(__file__).with_name("fake_trainer.py")


def migrate(url: str) -> None:
    """`alembic upgrade head` on `url`."""
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(REPO / "alembic.ini"))
    cfg.attributes["url"] = url
    command.upgrade(cfg, "head")


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[Any]:
    """A session factory on a migrated SQLite database of this test's own."""
    from service.db import upgrade
    from service.db.session import make_engine, make_session_factory

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def new_job(factory: Any, *, status: str = "queued", max_restarts: int = 2) -> str:
    """A `tiny` job of owner "t" (created once per database) in `status`; its id."""
    from peagle.spec import preset
    from service.db.models import Job, Owner, utcnow
    from service.db.session import session_scope

    with session_scope(factory) as s:
        owner = s.scalar(sa.select(Owner).where(Owner.name == "t")) or Owner(name="t")
        s.add(owner)
        s.flush()
        job = Job(owner_id=owner.id, spec=preset("tiny").model_dump(mode="json"), status=status, progress={},
                  max_restarts=max_restarts, queue="cpu", queued_at=utcnow())
        s.add(job)
        s.flush()
        return str(job.id)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with (/proc/<pid>/environ); {} when it is gone or not ours."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class Stack:
    """Database + broker + processes of one test. `env` is what worker/reaper processes get."""

    def __init__(self, tmp: Path, *, database_url: str, broker_url: str | None, redis_url: str | None,
                 fake_trainer: bool) -> None:
        from service.db.session import make_engine, make_session_factory
        from service.settings import Settings
        from tests.lane import fast_lane

        if fast_lane():
            pytest.fail("a worker stack in the fast lane: mark this test slow, or ask for `make_stack` or "
                        "`stack` (tests/lane), and make test runs it", pytrace=False)
        self.tmp = tmp
        self.queue = f"q{uuid.uuid4().hex[:8]}"
        self.env = {
            **os.environ,
            "PEAGLE_HOME": str(tmp / "home"),
            "PEAGLE_DATABASE_URL": database_url,
            "PEAGLE_WORKER_QUEUE": self.queue,
            "PEAGLE_HEARTBEAT_SECONDS": "0.3",
            "PEAGLE_LEASE_SECONDS": "2.5",
            "PEAGLE_KILL_GRACE_SECONDS": "8",
            "PEAGLE_LOG_LEVEL": "info",
            "PYTHONUNBUFFERED": "1",
        }
        for key, value in (("PEAGLE_BROKER_URL", broker_url), ("PEAGLE_REDIS_URL", redis_url)):
            if value:
                self.env[key] = value
            else:
                self.env.pop(key, None)
        if fake_trainer:
            self.env["PEAGLE_TRAINER_COMMAND"] = f"{sys.executable} {FAKE_TRAINER}"
        else:
            self.env.pop("PEAGLE_TRAINER_COMMAND", None)
        fields = {k[len("PEAGLE_"):].lower(): v for k, v in self.env.items() if k.startswith("PEAGLE_")}
        self.settings = Settings(**{k: v for k, v in fields.items() if k in Settings.model_fields})
        migrate(database_url)
        self.engine = make_engine(database_url)
        self.factory = make_session_factory(self.engine)
        self.procs: list[subprocess.Popen[Any]] = []
        self.producer: Any = None

    # ------------------------------------------------------------------ processes

    def _spawn(self, args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        log = (self.tmp / f"{name}-{len(self.procs)}.log").open("wb")
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**self.env, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def start_worker(self, env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        """A real Celery worker process (`python -m worker`) on this test's queue.

        The fake trainer's knobs (`FAKE_*` in `env`) travel in its command line (`env K=V python
        fake_trainer.py`): the worker hands the trainer only an allow-listed environment."""
        env = dict(env or {})
        knobs = {k: env.pop(k) for k in list(env) if k.startswith("FAKE_")}
        command = env.get("PEAGLE_TRAINER_COMMAND", self.env.get("PEAGLE_TRAINER_COMMAND"))
        if knobs and command:
            env["PEAGLE_TRAINER_COMMAND"] = shlex.join(["env", *(f"{k}={v}" for k, v in knobs.items())]) + \
                " " + command
        return self._spawn(["-m", "worker", "--queue", self.queue, "--no-reaper",
                            "--hostname", f"w{len(self.procs)}-{self.queue}@localhost"], "worker", env)

    def trainer_pid(self, job_id: str, attempt: int, timeout: float = 60.0) -> int:
        """The pid of the trainer of `job_id`'s `attempt` (found in /proc by its command line, which names
        the job's spec file, and its `PEAGLE_ATTEMPT`): the job's events name no pid."""
        spec_file = str(self.settings.resolved_artifact_root() / job_id / "job_spec.json")
        deadline = time.monotonic() + timeout
        while True:
            found = sorted(pid for pid in _pids() if spec_file in _cmdline(pid)
                           and process_environ(pid).get("PEAGLE_ATTEMPT") == str(attempt))
            if found:
                return found[0]  # the first started (torchrun's ranks come after it)
            if time.monotonic() > deadline:
                job = self.job(job_id)
                pytest.fail(f"no trainer of attempt {attempt} found: status={job.status} attempt={job.attempt}"
                            f"\n{self.logs()}")
            time.sleep(0.05)

    def wait_workers_ready(self, count: int, timeout: float = 60.0) -> None:
        """Block until `count` worker logs say Celery is consuming (`... ready.`)."""
        deadline = time.monotonic() + timeout
        while True:
            ready = sum(" ready." in p.read_text(errors="replace") for p in self.tmp.glob("worker-*.log"))
            if ready >= count:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"only {ready} of {count} workers became ready\n{self.logs()}")
            time.sleep(0.1)

    def start_reaper(self) -> subprocess.Popen[Any]:
        """The reaper loop (`python -m worker.reaper`), passes every 0.5 s."""
        return self._spawn(["-m", "worker.reaper", "--interval", "0.5"], "reaper")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-6000:]}" for p in sorted(self.tmp.glob("*.log")))

    def close(self) -> None:
        for proc in self.procs:  # test processes: no graceful stop needed (trainers die with them)
            kill_group(proc)
        for proc in self.procs:
            proc.wait(timeout=10)
        if self.producer is not None:
            self.producer.close()
        self.engine.dispose()

    # ------------------------------------------------------------------ jobs

    def submit(self, spec: dict[str, Any], *, max_restarts: int | None = None) -> str:
        """Create a queued job of a test owner and send it to the broker, through the service's `create_job`
        (what the API does)."""
        from service.db.jobs import create_job
        from service.queue import make_producer

        if self.producer is None:
            self.producer = make_producer(self.settings)
        with self.factory() as s:
            job = create_job(
                s, owner_id=self.owner_id(), spec=spec, name=spec.get("name") or "", tags=[], queue=self.queue,
                max_restarts=spec["resources"]["max_restarts"] if max_restarts is None else max_restarts,
                send=self.producer.send_train)
        return job.id

    def owner_id(self) -> int:
        """The id of owner `tests` (created on first use)."""
        from service.db.models import Owner
        from service.db.session import session_scope

        with session_scope(self.factory) as s:
            owner = s.execute(sa.select(Owner).where(Owner.name == "tests")).scalar()
            if owner is None:
                owner = Owner(name="tests")
                s.add(owner)
                s.flush()
            return int(owner.id)

    def act(self, job_id: str, action: str) -> None:
        """Apply a user action (`cancel`, `pause`, `resume`) through the service's `apply_action`."""
        from service.db.jobs import apply_action
        from service.queue import make_producer

        if self.producer is None:
            self.producer = make_producer(self.settings)
        with self.factory() as s:
            assert apply_action(s, owner_id=self.owner_id(), job_id=job_id, action=action,
                                send=self.producer.send_train) is not None

    def add_dataset(self, path: Path) -> str:
        """A `dataset` row of owner `tests` for a local file; returns its id."""
        from service.db.models import Dataset
        from service.db.session import session_scope

        owner_id = self.owner_id()
        with session_scope(self.factory) as s:
            ds = Dataset(owner_id=owner_id, filename=path.name, path=str(path), size=path.stat().st_size,
                         sha256="0" * 64, format="messages", status="ready", report={})
            s.add(ds)
            s.flush()
            return ds.id

    def set(self, job_id: str, **values: Any) -> None:
        from service.db.models import Job
        from service.db.session import session_scope

        with session_scope(self.factory) as s:
            s.execute(sa.update(Job).where(Job.id == job_id).values(**values))

    def job(self, job_id: str) -> Any:
        from service.db.models import Job

        with self.factory() as s:
            return s.get(Job, job_id)

    def rows(self, model: Any, job_id: str) -> list[Any]:
        with self.factory() as s:
            return list(s.execute(sa.select(model).where(model.job_id == job_id).order_by(model.seq)).scalars())

    def wait(self, job_id: str, pred: Callable[[Any], bool], timeout: float = 60.0, what: str = "") -> Any:
        """Poll the job row until `pred(job)`; fail with the job and the process logs on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if pred(job):
                return job
            if time.monotonic() > deadline:
                pytest.fail(f"timeout waiting for {what or 'condition'}: status={job.status} phase={job.phase} "
                            f"attempt={job.attempt} error={job.error_code}: {job.error_message}\n{self.logs()}")
            time.sleep(0.1)

    def wait_status(self, job_id: str, *statuses: str, timeout: float = 60.0) -> Any:
        return self.wait(job_id, lambda j: j.status in statuses, timeout, f"status in {statuses}")


@pytest.fixture(params=["embedded", "services"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Stack]]:
    """`make_stack(backend, fake_trainer=True, redis_url=None)` -> a `Stack` (closed at teardown)."""
    stacks: list[Stack] = []

    def make(backend: str = "embedded", *, fake_trainer: bool = True, redis_url: str | None = None) -> Stack:
        if backend == "embedded":
            url = f"sqlite:///{tmp_path / 'home' / 'peagle.db'}"
            stack = Stack(tmp_path, database_url=url, broker_url=None, redis_url=redis_url,
                          fake_trainer=fake_trainer)
        else:
            pg = request.getfixturevalue("postgres_url")
            redis = redis_url or request.getfixturevalue("redis_url")
            stack = Stack(tmp_path, database_url=pg, broker_url=redis, redis_url=redis, fake_trainer=fake_trainer)
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.close()


@pytest.fixture
def api(tiny_target_path: Path) -> Iterator[Callable[[Stack], Any]]:
    """`api(stack)` -> an httpx-style TestClient on the API app with a read and write key of owner `tests`
    (the target fixture built first: the jobs it submits train it)."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from service.db import repo
    from service.db.session import session_scope

    clients: list[Any] = []

    def make(stack: Stack) -> Any:
        with session_scope(stack.factory) as s:
            _row, key = repo.create_key(s, "tests", ["read", "write"])
        client = TestClient(create_app(stack.settings))
        client.__enter__()
        client.headers["Authorization"] = f"Bearer {key}"
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def spec_for() -> Callable[..., dict[str, Any]]:
    """`spec_for(steps=, every=, max_restarts=, data_path=)`: a job spec (see `fake_spec`)."""
    return fake_spec


def fake_spec(steps: int = 12, every: int = 4, max_restarts: int = 2, data_path: str | None = None) -> dict[str, Any]:
    """The tiny preset with a given number of steps (the fake trainer reads optim/checkpoints/data)."""
    from peagle.spec import preset

    spec = preset("tiny").model_dump(mode="json")
    spec["optim"]["max_steps"] = steps
    spec["checkpoints"]["every_steps"] = every
    spec["resources"]["max_restarts"] = max_restarts
    if data_path:
        spec["data"]["sources"] = [{"path": data_path, "format": "auto", "max_samples": None, "skip": 0}]
    return spec
