"""Issue 19: after PostgreSQL dropped the API's connections (restart, failover, pg_terminate_backend),
idempotent reads succeed (retried once on a fresh connection) instead of answering 500."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

#: Answers between two kills of the API's connections while writes run (test_writes_survive_...).
KILL_EVERY = 20

Sim = Any


def _drop_connections(url: str) -> int:
    import psycopg

    plain = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                            "current_database() AND pid <> pg_backend_pid()").fetchall()
    return len(rows)


@pytest.mark.integration
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_reads_survive_dropped_database_connections(client: TestClient, alice: dict, submit: Any,
                                                    db_url: str) -> None:
    client.app.state.peagle.principals.ttl_s = 0  # every request looks its key up (sync pool)
    job = submit(client, alice, preset="tiny")
    for _ in range(8):  # open the sync pool's and the async read pool's connections
        assert client.get("/v1/jobs", headers=alice).status_code == 200
        assert client.get(f"/v1/jobs/{job['id']}", headers=alice).status_code == 200
    assert _drop_connections(db_url) >= 2
    for _ in range(3):
        statuses = [client.get(path, headers=alice).status_code
                    for path in ("/v1/jobs", f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/events",
                                 "/v1/jobs", "/v1/jobs", "/v1/jobs")]
        assert statuses == [200] * 6
        assert _drop_connections(db_url) >= 1


def _post_webhooks(url: str, headers: dict, n: int, *, workers: int = 24,
                   answered: Callable[[], None] | None = None) -> list[int]:
    """`n` POST /v1/webhooks (a non-idempotent write) from `workers` threads at once; their statuses
    (`answered()` is called after each answer)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(i: int) -> int:
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            status = c.post("/v1/webhooks", json={"url": f"https://example.com/h{i}", "events": ["job.failed"]}
                            ).status_code
        if answered is not None:
            answered()
        return status

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.integration
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_writes_survive_dropped_database_connections(settings_factory: Any, live_server: Any, sim: Sim,
                                                     db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A real uvicorn API process on PostgreSQL, 24 clients writing at once (POST /v1/webhooks, not
    idempotent). Its pooled connections are killed (pg_terminate_backend) between two bursts: every write
    that met a stale connection is retried once on a fresh one, so none answers 500 (79 of 150 did). Then
    they are killed every 20 answers while writes run: a 500 only where the retry met a second kill, a 503 only
    where a COMMIT was under way (outcome unknown); every 201 is exactly one row, nothing is written twice."""
    import logging
    import threading

    import sqlalchemy as sa

    from api.main import create_app

    alice = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    app = create_app(settings_factory(max_webhooks_per_owner=10_000))
    caplog.set_level(logging.WARNING, logger="peagle.api")
    with live_server(app) as srv:
        app.state.peagle.principals.ttl_s = 0  # every request looks its key up too
        warm = _post_webhooks(srv.url, alice, 48)  # fills the pool
        assert _drop_connections(db_url) >= 2
        stale = _post_webhooks(srv.url, alice, 150)  # every pooled connection is stale
        assert warm.count(201) == 48 and stale.count(201) == 150, {s: stale.count(s) for s in set(stale)}
        assert "retrying once" in caplog.text
        # A kill after every KILL_EVERY answers, not by the clock: how many writes meet two kills then does not
        # depend on the machine's speed (every 150 ms, a loaded 2-core machine got 93 of 150 through, an idle one
        # over 100). 150 answers: 7 kills while 24 clients write, each by the client whose answer was due.
        lock = threading.Lock()
        answers = [0]

        def answered() -> None:
            with lock:
                answers[0] += 1
                due = answers[0] % KILL_EVERY == 0
            if due:
                _drop_connections(db_url)

        during = _post_webhooks(srv.url, alice, 150, answered=answered)
    again = caplog.text.count("dropped again on the retry")
    assert during.count(500) <= again and set(during) <= {201, 500, 503}, {s: during.count(s) for s in set(during)}
    assert during.count(201) >= 100
    with sim.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT count(*) FROM webhook_endpoint")).scalar_one()
    created = 48 + 150 + during.count(201)
    assert created <= rows <= created + during.count(503)  # a 503 may have been applied; nothing twice


@pytest.mark.integration
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_key_lookup_joined_on_a_dropped_connection_is_redone(db_url: str) -> None:
    """The CI failure {201: 149, 500: 1}: a retried request's key lookup joined one that another request had
    started earlier on a stale pooled connection, and failed with it. The joiner now looks up again (the
    failure discarded the stale pool), while the request that started it fails as before (its own retry)."""
    import asyncio
    import threading

    import sqlalchemy as sa

    from api import auth
    from service.db import repo
    from service.db.session import make_engine, make_session_factory

    engine = make_engine(db_url, pool_pre_ping=False)
    try:
        with engine.connect() as conn:  # a pooled connection, then dropped under the pool
            conn.execute(sa.text("SELECT 1"))
        assert _drop_connections(db_url) >= 1
        state: Any = type("S", (), {"principals": auth.PrincipalCache(ttl_s=0),
                                    "sessions": make_session_factory(engine)})()
        release = threading.Event()
        principal = repo.Principal(1, "o", 1, frozenset({"read"}))

        def first(session: Any) -> repo.Principal:
            release.wait(10)  # the second request joins meanwhile
            session.execute(sa.text("SELECT 1"))  # the stale connection
            return principal

        def second(session: Any) -> repo.Principal:
            session.execute(sa.text("SELECT 1"))
            return principal

        async def main() -> list[Any]:
            a = asyncio.ensure_future(auth._lookup_once(state, "b:k", first))
            await asyncio.sleep(0.05)
            assert "b:k" in state.principals.inflight
            b = asyncio.ensure_future(auth._lookup_once(state, "b:k", second))
            await asyncio.sleep(0.05)
            release.set()
            return await asyncio.gather(a, b, return_exceptions=True)

        a, b = asyncio.run(main())
        assert isinstance(a, sa.exc.OperationalError) and a.connection_invalidated, a
        assert b == principal
        assert state.principals.inflight == {}
    finally:
        engine.dispose()
