"""Schema from migrations only: up/down/up on SQLite and PostgreSQL; models == migrated schema.
Also: the API imports no torch; the queue producer puts `peagle.train` on a real Redis broker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from service.db import downgrade, upgrade
from service.db.models import Base
from service.db.session import make_engine
from service.queue import broker_folders, make_producer
from service.settings import get_settings


def _diff(url: str) -> list[Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": False})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An EMPTY database (fresh PostgreSQL database from the shared fixture, or a new SQLite file)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return request.getfixturevalue("postgres_url")


def test_migrations_round_trip(fresh_url: str) -> None:
    db_url = fresh_url
    assert _tables(db_url) == set()
    upgrade(db_url)
    assert _tables(db_url) == set(Base.metadata.tables)
    assert _diff(db_url) == []
    downgrade(db_url, "base")
    assert _tables(db_url) == set()
    upgrade(db_url)
    assert _tables(db_url) == set(Base.metadata.tables)
    assert _diff(db_url) == []


def test_api_does_not_import_torch() -> None:
    code = ("import sys, api.main, api.admin, service.db.lease, peagle.client, peagle.cli.jobs; "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'worker') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert json.loads(out.stdout) == []


def test_filesystem_broker_gets_the_task(tmp_path: Path) -> None:
    s = get_settings(home=tmp_path, embedded=False)
    p = make_producer(s)
    try:
        p.send_train("job_X", "cpu")
        assert p.ping()
    finally:
        p.close()
    files = list(broker_folders(s)["queue"].iterdir())
    assert len(files) == 1
    body = json.loads(files[0].read_text())
    assert body["headers"]["task"] == "peagle.train" and body["headers"]["argsrepr"] == "['job_X']"


@pytest.mark.integration
def test_redis_broker_gets_the_task(tmp_path: Path, redis_url: str) -> None:
    import redis

    s = get_settings(home=tmp_path, embedded=False, broker_url=redis_url)
    r = redis.Redis.from_url(redis_url)
    r.delete("gpu-test")
    p = make_producer(s)
    try:
        task_id = p.send_train("job_Y", "gpu-test")
        assert p.ping()
    finally:
        p.close()
    raw = r.lpop("gpu-test")
    r.close()
    msg = json.loads(raw)
    assert msg["headers"]["task"] == "peagle.train" and msg["headers"]["id"] == task_id
    assert msg["headers"]["argsrepr"] == "['job_Y']"
