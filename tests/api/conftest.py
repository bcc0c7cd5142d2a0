"""API fixtures: the app on SQLite AND PostgreSQL, API keys, and a worker simulator writing rows directly."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
from fastapi.testclient import TestClient

from api.main import create_app
from api.timeouts import HTTP_PROTOCOL
from service.db import repo, upgrade
from service.db.models import Checkpoint, Job, JobEvent, JobLog, JobMetric, utcnow
from service.db.session import make_engine, make_session_factory, session_scope
from service.settings import Settings, get_settings

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]


@pytest.fixture(scope="session")
def pg_api_url(postgres_admin_url: str) -> Iterator[str]:
    """One migrated PostgreSQL database for the API tests (emptied before each test by `db_url`)."""
    import uuid

    import psycopg

    name = f"peagle_api_{uuid.uuid4().hex[:10]}"
    plain = postgres_admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{postgres_admin_url.rsplit('/', 1)[0]}/{name}"
    upgrade(url)
    try:
        yield url
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database: a SQLite file, or the session's PostgreSQL database truncated."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'service.db'}"
        upgrade(url)
        return url
    url = request.getfixturevalue("pg_api_url")
    engine = make_engine(url)
    with engine.begin() as conn:
        from service.db.models import Base

        names = ", ".join(f'"{t}"' for t in Base.metadata.tables)
        conn.execute(sa.text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return url


def make_settings(tmp_path: Path, db_url: str, **over: Any) -> Settings:
    kw: dict[str, Any] = dict(home=tmp_path / "home", database_url=db_url, embedded=False,
                              artifact_root=tmp_path / "artifacts", dataset_root=tmp_path / "datasets",
                              secret_key="test-secret-key-of-at-least-32-characters")
    kw.update(over)
    return get_settings(**kw)


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:
    return make_settings(tmp_path, db_url)


class Sim:
    """Plays the worker: writes job rows through the DB layer (sequence numbers as the contract says)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = make_engine(settings.resolved_database_url())
        self.sessions = make_session_factory(self.engine)

    def key(self, owner: str, *scopes: str) -> str:
        with session_scope(self.sessions) as s:
            return repo.create_key(s, owner, list(scopes) or ["write"])[1]

    def set(self, job_id: str, **values: Any) -> None:
        with session_scope(self.sessions) as s:
            s.execute(sa.update(Job).where(Job.id == job_id).values(**values))

    def job(self, job_id: str) -> Job:
        with session_scope(self.sessions) as s:
            return s.get(Job, job_id)

    def emit(self, job_id: str, kind: str, n: int = 1, *, start_step: int | None = None) -> list[int]:
        """Insert `n` rows of `kind` (events|metrics|logs) in one transaction; returns their seqs."""
        col = repo.SEQ_COLUMNS[kind]
        with session_scope(self.sessions) as s:
            last = s.scalar(sa.update(Job).where(Job.id == job_id).values({col: getattr(Job, col) + n})
                            .returning(getattr(Job, col)))
            seqs = list(range(last - n + 1, last + 1))
            for i, seq in enumerate(seqs):
                if kind == "metrics":
                    step = (start_step if start_step is not None else seq) + i * (start_step is not None)
                    s.add(JobMetric(job_id=job_id, seq=seq, step=step, values={"loss": 10.0 / (1 + step),
                                                                               "acc_0": step / 100}))
                elif kind == "events":
                    s.add(JobEvent(job_id=job_id, seq=seq, kind="progress", message=f"e{seq}", data={"step": seq}))
                else:
                    s.add(JobLog(job_id=job_id, seq=seq, level="info", message=f"line {seq}"))
        return seqs

    def checkpoint(self, job_id: str, step: int, files: dict[str, bytes], *, best: bool = True) -> Path:
        """Write a COMPLETE checkpoint folder and its row (+ best/latest on the job)."""
        run = self.settings.resolved_artifact_root() / job_id
        d = run / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True, exist_ok=True)
        entries = []
        for name, data in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)
            entries.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        (d / "COMPLETE").write_text("ok")
        (d / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "t/v"},
                                                                          "proposal_methods": [
                                                                              {"speculative_tokens": 3}]}}))
        with session_scope(self.sessions) as s:
            s.add(Checkpoint(job_id=job_id, step=step, dir=f"checkpoints/step_{step:06d}", metrics={"tau_sim": 1.5},
                             files=entries, complete=True, is_best=best, created_at=utcnow()))
            vals: dict[str, Any] = {"latest_checkpoint_step": step, "artifact_dir": str(run)}
            if best:
                vals["best_checkpoint_step"] = step
            s.execute(sa.update(Job).where(Job.id == job_id).values(**vals))
        return d

    def close(self) -> None:
        self.engine.dispose()


@pytest.fixture
def sim(settings: Settings) -> Iterator[Sim]:
    s = Sim(settings)
    yield s
    s.close()


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def alice(sim: Sim) -> dict[str, str]:
    return {"Authorization": f"Bearer {sim.key('alice', 'write')}"}


@pytest.fixture
def bob(sim: Sim) -> dict[str, str]:
    return {"Authorization": f"Bearer {sim.key('bob', 'write')}"}


def _submit(client: TestClient, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    body = body or {"preset": "tiny"}
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


@pytest.fixture
def submit() -> Any:
    """`submit(client, headers, **body)` -> the created job (asserts 201)."""
    return _submit


@pytest.fixture
def settings_factory(tmp_path: Path, db_url: str) -> Any:
    """`settings_factory(**overrides)` -> Settings on the test database."""
    return lambda **over: make_settings(tmp_path, db_url, **over)


class Server:
    """uvicorn in a thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def live_server() -> Any:
    """`with live_server(app) as srv:` runs uvicorn on a free loopback port (`srv.url`)."""
    return Server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiProcess:
    """`uvicorn --factory api.main:create_app` in a subprocess, started as production starts it (`worker/run.py`:
    the server protocol with header and body timeouts, `api.timeouts`), configured through PEAGLE_* variables."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.port = _free_port()
        self.log = tmp_path / f"api-{self.port}.log"
        full = {**os.environ, "PEAGLE_EMBEDDED": "false", "PEAGLE_HOME": str(tmp_path / "home"),
                "PEAGLE_ARTIFACT_ROOT": str(tmp_path / "artifacts"), "PEAGLE_DATASET_ROOT": str(tmp_path / "datasets"),
                "PEAGLE_SECRET_KEY": "test-secret-key-of-at-least-32-characters", **env}
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app", "--host", "127.0.0.1",
             "--port", str(self.port), "--http", HTTP_PROTOCOL, "--log-level", "warning"],
            cwd=ROOT, env=full, stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the API did not start:\n" + self.log.read_text()
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_kib(self) -> int:
        """VmRSS of the server process (KiB)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def api_key(db: str, owner: str = "alice") -> dict[str, str]:
    engine = make_engine(db)
    try:
        with session_scope(make_session_factory(engine)) as s:
            return {"Authorization": f"Bearer {repo.create_key(s, owner, ['write'])[1]}"}
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory, tiny_target_path: Path) -> Path:
    """A valid export of a `tiny`-preset draft of tiny-llama (1 layer, Vd 512, aux [1, 2, 3], mask token 3)."""
    import torch
    from transformers import AutoModelForCausalLM

    from peagle.export.writer import export_draft
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target

    target = AutoModelForCausalLM.from_pretrained(str(tiny_target_path), dtype=torch.float32)
    cfg = DraftConfig.from_target(target.config, num_layers=1, draft_vocab_size=512, mask_token_id=3,
                                  aux_layer_ids=[1, 2, 3])
    draft = PEagleDraft(cfg)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[:512] = True
    init_from_target(draft, target, t2d)
    out = tmp_path_factory.mktemp("drafts") / "my-draft"
    export_draft(draft, out, num_speculative_tokens=3, verifier_name_or_path="builtin:tiny-llama",
                 verifier_architectures=["LlamaForCausalLM"])
    return out
