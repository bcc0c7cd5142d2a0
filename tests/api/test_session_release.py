"""Issue 46 item 2: every route releases its database session on every path, found or not found.

The app runs on a pool of ONE connection that a request waits at most `POOL_WAIT_S` for. The test walks
every operation of the OpenAPI schema with missing ids and with another owner's ids (each answered 4xx),
repeating the walk so that a leak on any route would use up the pool, and then checks that every read
route still answers, not a 500 from a pool timeout. Before the fix, a stream request for a missing or
foreign job kept its connection: the first such request took the only connection and every database
route after it answered 500.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.conftest import make_settings

#: How long a request waits for the pool's one connection (a leak shows as a 500 after this; the pool
#: is free again within milliseconds when nothing leaks, so 3 s is far above any normal wait).
POOL_WAIT_S = 3.0
MISSING = {"job_id": "job_000000000000000000000000", "dataset_id": "ds_000000000000000000000000",
           "draft_id": "draft_000000000000000000000000", "webhook_id": "wh_000000000000000000000000",
           "step": "1", "path": "config.json"}


@pytest.fixture
def one_connection_client(tmp_path: Any, db_url: str) -> Any:
    settings = make_settings(tmp_path, db_url, db_pool_size=1, db_pool_overflow=0, db_pool_timeout_s=POOL_WAIT_S,
                             webhook_allow_hosts="example.com")
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _operations(client: TestClient) -> list[tuple[str, str, dict[str, Any]]]:
    return [(method.upper(), path, op) for path, ops in client.app.openapi()["paths"].items()
            for method, op in ops.items()]


def _fill(path: str, ids: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: ids.get(m.group(1), MISSING.get(m.group(1), "x")), path)


def test_no_route_keeps_a_connection_for_missing_or_foreign_ids(one_connection_client: TestClient, sim: Any,
                                                                submit: Any) -> None:
    client = one_connection_client
    alice_read = {"Authorization": f"Bearer {sim.key('alice', 'read')}"}
    alice = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    bob = {"Authorization": f"Bearer {sim.key('bob', 'write')}"}
    job = submit(client, bob)["id"]
    hook = client.post("/v1/webhooks", json={"url": "https://example.com/h", "events": ["job.succeeded"]},
                       headers=bob)
    assert hook.status_code == 201, hook.text
    foreign = {"job_id": job, "webhook_id": hook.json()["id"]}
    ops = [(m, p, op) for m, p, op in _operations(client) if "{" in p]
    assert len(ops) >= 20, [p for _, p, _ in ops]  # every id route of the API (30 today)
    answers: dict[str, int] = {}
    for _round in range(3):  # three times the pool's size: one leaking route would exhaust it
        for ids, who in ((MISSING, alice_read), (MISSING, alice), (foreign, alice_read), (foreign, alice)):
            for method, path, op in ops:
                url = _fill(path, ids)
                body = {} if "requestBody" in op else None
                r = client.request(method, url, headers=who, json=body)
                key = f"{method} {path} {'foreign' if ids is foreign else 'missing'}"
                answers[key] = r.status_code
                assert r.status_code < 500, (key, r.status_code, r.text[:300])
    # Missing and foreign ids answer alike, on every route.
    for key, code in answers.items():
        if key.endswith("foreign"):
            twin = answers[key.removesuffix("foreign") + "missing"]
            assert code == twin or {code, twin} <= {403, 404, 422}, (key, code, twin)
    # And every read route still answers at once (a leaked connection would make these 500 after POOL_WAIT_S).
    for method, path, _op in _operations(client):
        if method != "GET" or path.endswith("/stream"):
            continue
        r = client.get(_fill(path, foreign), headers=alice)
        assert r.status_code < 500, (path, r.status_code, r.text[:300])
    assert client.get(f"/v1/jobs/{job}", headers=bob).status_code == 200


def test_every_handler_with_a_read_session_releases_it() -> None:
    """A `ReadDB` session is closed by the handler's `releases_db` wrapper (it is not a generator
    dependency): a handler that takes one without the wrapper would keep its connection on every path."""
    import importlib
    import typing

    from fastapi.routing import APIRoute

    from api.deps import ReadDB
    from api.routes import __path__ as routes_path

    checked = []
    for info in __import__("pkgutil").iter_modules(routes_path):
        module = importlib.import_module(f"api.routes.{info.name}")
        for route in getattr(module, "router", None).routes if hasattr(module, "router") else []:
            if not isinstance(route, APIRoute):
                continue
            hints = typing.get_type_hints(route.endpoint, include_extras=True)
            if any(h == ReadDB for h in hints.values()):
                checked.append(route.path)
                assert hasattr(route.endpoint, "__wrapped__"), f"{route.path}: takes ReadDB without @releases_db"
    assert len(checked) >= 5, checked
