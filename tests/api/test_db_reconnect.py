"""Issue 19: after PostgreSQL dropped the API's connections (restart, failover, pg_terminate_backend),
idempotent reads succeed (retried once on a fresh connection) instead of answering 500."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

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
