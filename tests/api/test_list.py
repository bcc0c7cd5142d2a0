"""`GET /v1/jobs` and what makes it fast: the async PostgreSQL reader (same answers as the sync path),
the lean handler (same parameters, same 422s), the API-key cache (revocation bound, one lookup per miss),
and the lifespan's GC settings. No timings here: bench/bench_api.py measures."""

from __future__ import annotations

import asyncio
import gc
import threading
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import pytest
from fastapi import FastAPI, Query
from fastapi.testclient import TestClient

from api import auth, responses
from api.main import GC_YOUNG_THRESHOLD, create_app
from api.routes.jobs import _query_parameters
from api.schemas import JobListParams
from service.db import aio, repo
from service.db.session import make_engine, make_read_engine

Sim = Any


def test_list_sees_writes_at_once(client: TestClient, alice: dict, submit: Any) -> None:
    """Read-your-writes: nothing is cached, a create or a cancel shows in the very next list."""
    job = submit(client, alice)
    assert client.get("/v1/jobs", headers=alice).json()["data"][0]["status"] == "queued"
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=alice).status_code == 200
    page = client.get("/v1/jobs", headers=alice).json()
    assert [(j["id"], j["status"]) for j in page["data"]] == [(job["id"], "cancelled")]


def test_list_uses_async_reader_on_postgres_only(client: TestClient, db_url: str) -> None:
    state = client.app.state.peagle
    assert (state.read_pool is not None) == db_url.startswith("postgresql")


@pytest.mark.integration
def test_async_reader_matches_sync_path(db_url: str, sim: Sim, client: TestClient, submit: Any) -> None:
    """Every filter shape gives the same page from `aio.list_jobs` as from `repo.list_jobs`."""
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only")
    key = sim.key("carol", "write")
    h = {"Authorization": f"Bearer {key}"}
    names = ["plain", "100% done", "under_score", "slash/name", "Mixed Case"]
    ids = [submit(client, h, preset="tiny", name=n, tags=["x" if i % 2 else "y", f"t{i}"])["id"]
           for i, n in enumerate(names)]
    sim.set(ids[1], status="failed", progress={"step": 3, "percent": 12.5})
    owner_id = sim.job(ids[0]).owner_id
    cases = [
        repo.JobPageQuery(owner_id=owner_id),
        repo.JobPageQuery(owner_id=owner_id, limit=2),
        repo.JobPageQuery(owner_id=owner_id, limit=2, after=ids[3]),
        repo.JobPageQuery(owner_id=owner_id, statuses=("failed", "queued")),
        repo.JobPageQuery(owner_id=owner_id, statuses=("failed",)),
        repo.JobPageQuery(owner_id=owner_id, tag="x"),
        repo.JobPageQuery(owner_id=owner_id, q="%"),  # wildcards are literal
        repo.JobPageQuery(owner_id=owner_id, q="_"),
        repo.JobPageQuery(owner_id=owner_id, q="/"),
        repo.JobPageQuery(owner_id=owner_id, q="mixed"),  # case-insensitive
        repo.JobPageQuery(owner_id=owner_id, created_after=datetime(2000, 1, 1)),  # naive = UTC
        repo.JobPageQuery(owner_id=owner_id, created_after=datetime.now(UTC) + timedelta(days=1)),
        repo.JobPageQuery(owner_id=owner_id, after=ids[4], statuses=("queued",), tag="y", q="A",
                          created_after=datetime(2000, 1, 1, tzinfo=UTC)),
    ]
    engine = make_engine(db_url)
    pool = aio.make_read_pool(db_url, size=1)

    async def run_async() -> list[tuple[list[dict[str, Any]], bool]]:
        await pool.open()
        try:
            return [await aio.list_jobs(pool, c) for c in cases]
        finally:
            await pool.close()

    try:
        with make_read_engine(engine).connect() as conn:
            sync = [repo.list_jobs(conn, c) for c in cases]
        assert asyncio.run(run_async()) == sync
    finally:
        engine.dispose()
    by_case = dict(zip(range(len(cases)), sync, strict=True))
    assert [r["id"] for r in by_case[0][0]] == ids[::-1] and by_case[0][1] is False
    assert by_case[1][1] is True and [r["id"] for r in by_case[2][0]] == [ids[2], ids[1]]
    assert [r["id"] for r in by_case[4][0]] == [ids[1]] and by_case[4][0][0]["progress"]["percent"] == 12.5
    assert [r["name"] for r in by_case[6][0]] == ["100% done"]
    assert [r["name"] for r in by_case[7][0]] == ["under_score"]
    assert [r["name"] for r in by_case[8][0]] == ["slash/name"]
    assert [r["name"] for r in by_case[9][0]] == ["Mixed Case"]
    assert len(by_case[10][0]) == 5 and by_case[11][0] == []
    assert [r["id"] for r in by_case[12][0]] == [ids[0]]  # "plain": before ids[4], queued, tag y, has an a
    assert isinstance(by_case[0][0][0]["created_at"], datetime) and by_case[0][0][0]["created_at"].tzinfo


def test_documented_parameters_are_fastapis(client: TestClient) -> None:
    """The lean handler's OpenAPI parameters equal what FastAPI renders for the same model."""
    ref = FastAPI()

    @ref.get("/v1/jobs")
    def listing(params: Annotated[JobListParams, Query()]) -> None: ...

    expected = ref.openapi()["paths"]["/v1/jobs"]["get"]["parameters"]
    assert [p["name"] for p in _query_parameters(JobListParams)] == [p["name"] for p in expected]
    assert client.app.openapi()["paths"]["/v1/jobs"]["get"]["parameters"] == expected  # as rendered


def test_list_parameter_errors_use_the_envelope(client: TestClient, alice: dict) -> None:
    r = client.get("/v1/jobs?limit=0&after=bad!&created_after=nope&extra=ignored", headers=alice)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "validation_error"
    assert {(d["in"], d["param"]) for d in err["details"]} == {("query", "/limit"), ("query", "/after"),
                                                                ("query", "/created_after")}
    assert client.get("/v1/jobs?limit=201", headers=alice).status_code == 422
    assert client.get("/v1/jobs?status=queued&status=queued&limit=200", headers=alice).status_code == 200
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_revoked_key_refused_after_cache_bound(client: TestClient, sim: Sim, monkeypatch: Any) -> None:
    """A revoked key keeps working for at most AUTH_CACHE_S (per process), then is refused."""
    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    key = sim.key("dora", "write")
    h = {"Authorization": f"Bearer {key}"}
    assert client.get("/v1/jobs", headers=h).status_code == 200  # looked up and cached at t=1000
    with repo_session(sim) as s:
        assert repo.revoke_key(s, repo.parse_key(key))
    now[0] += auth.AUTH_CACHE_S - 0.01
    assert client.get("/v1/jobs", headers=h).status_code == 200  # still inside the bound
    now[0] += 0.02
    r = client.get("/v1/jobs", headers=h)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


def test_unknown_key_is_cached_as_refused_too(client: TestClient, sim: Sim, monkeypatch: Any) -> None:
    calls = []
    real = repo.authenticate
    monkeypatch.setattr(repo, "authenticate", lambda s, k: calls.append(k) or real(s, k))
    h = {"Authorization": "Bearer peagle_0123456789abcdef_nope"}
    for _ in range(3):
        assert client.get("/v1/jobs", headers=h).status_code == 401
    assert len(calls) == 1


def test_concurrent_misses_share_one_lookup(monkeypatch: Any) -> None:
    """When an entry expires under load, the requests in flight wait for one database lookup."""
    release = threading.Event()
    calls: list[str] = []
    principal = repo.Principal(1, "o", 1, frozenset({"read"}))

    def slow_lookup(state: Any, cache_key: str, load: Any) -> repo.Principal:
        calls.append(cache_key)
        release.wait(10)
        return principal

    monkeypatch.setattr(auth, "_lookup", slow_lookup)
    state: Any = type("S", (), {"principals": auth.PrincipalCache()})()

    async def main() -> list[Any]:
        waiters = [asyncio.ensure_future(auth._lookup_once(state, "b:k", lambda s: None)) for _ in range(20)]
        await asyncio.sleep(0.05)
        release.set()
        out = await asyncio.gather(*waiters)
        assert state.principals.inflight == {}  # forgotten once done: the next miss looks up again
        return out

    assert asyncio.run(main()) == [principal] * 20
    assert calls == ["b:k"]


def test_failed_lookup_fails_waiters_and_is_retried(monkeypatch: Any) -> None:
    attempts = []

    def broken(state: Any, cache_key: str, load: Any) -> Any:
        attempts.append(1)
        raise RuntimeError("database down")

    monkeypatch.setattr(auth, "_lookup", broken)
    state: Any = type("S", (), {"principals": auth.PrincipalCache()})()

    async def main() -> None:
        for _ in range(2):
            results = await asyncio.gather(*(auth._lookup_once(state, "b:k", lambda s: None) for _ in range(5)),
                                           return_exceptions=True)
            assert all(isinstance(r, RuntimeError) for r in results)

    asyncio.run(main())
    assert len(attempts) == 2  # one per burst, nothing cached in between


def test_lifespan_gc_settings_are_restored(settings: Any) -> None:
    before = gc.get_threshold()
    with TestClient(create_app(settings)):
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def repo_session(sim: Sim) -> Any:
    from service.db.session import session_scope

    return session_scope(sim.sessions)


def test_json_writer() -> None:
    """`json_ok`'s bytes: orjson's, with the stdlib's output where orjson refuses valid JSON."""
    at = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert responses.dumps({"t": at, "x": [1.5, None]}) == b'{"t":"2026-01-02T03:04:05.000006Z","x":[1.5,null]}'
    assert responses.dumps({"t": at.replace(microsecond=0)}) == b'{"t":"2026-01-02T03:04:05Z"}'
    assert responses.dumps({"big": 2**70, 1: "k"}) == b'{"big":1180591620717411303424,"1":"k"}'
    assert responses.dumps({"nan": float("nan")}) == b'{"nan":null}'
    assert responses.jsonable({"big": 2**70, "t": at}) == {"big": 2**70, "t": "2026-01-02T03:04:05.000006Z"}
    with pytest.raises(TypeError):
        responses.dumps({"x": object()})
