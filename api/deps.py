"""FastAPI dependencies: the app's typed state, database sessions, and the caller (`Reader`, `Writer`, ...).

Who the caller is (API keys, tokens, the principal cache) is decided in `api.auth`; JSON responses are
written by `api.responses`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import sqlalchemy as sa
from fastapi import Depends, Query, Request
from sqlalchemy.orm import Session, sessionmaker

from api.auth import PrincipalCache, authenticate, authorize, check_scope
from api.target_checks import HubProbe
from api.uploads import QuotaLedger
from service.db import repo
from service.queue import Producer
from service.settings import Settings

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from psycopg_pool import AsyncConnectionPool
    from redis import Redis as SyncRedis

    from api.live import LiveHub
    from api.metrics import ServiceMetrics

__all__ = [
    "DB",
    "AppState",
    "DownloadReader",
    "ReadDB",
    "Reader",
    "State",
    "TokenReader",
    "Writer",
    "auth",
    "get_db",
    "get_read_db",
    "get_state",
    "releases_db",
]

#: Seconds between keep-alive comments on an idle SSE stream (`AppState.keepalive_s`).
KEEPALIVE_S = 10.0


@dataclass
class AppState:
    """Everything `create_app` builds in its lifespan (no module-level singletons)."""

    settings: Settings
    engine: sa.Engine
    sessions: sessionmaker[Session]
    producer: Producer
    metrics: ServiceMetrics
    validator_slots: asyncio.Semaphore  # sandboxed validations at once, every kind (`api.uploads.run_sandboxed`)
    hub: LiveHub  # live tails of job rows (started by the lifespan before the first request)
    read_sessions: sessionmaker[Session] | None = None  # autocommit sessions for read-only handlers
    read_engine: sa.Engine | None = None  # the same pool in autocommit mode (Core reads, no BEGIN/ROLLBACK)
    read_pool: AsyncConnectionPool | None = None  # PostgreSQL: async psycopg pool for reads on the event loop
    redis: aioredis.Redis | None = None  # live-stream wake-ups (pub/sub listener, `/readyz`)
    redis_sync: SyncRedis | None = None  # publishes wake-ups from sync handlers (`api.routes.jobs.publish`)
    principals: PrincipalCache = field(default_factory=PrincipalCache)  # `api.auth`'s cache of callers
    keepalive_s: float = KEEPALIVE_S  # SSE keep-alive interval (tests shorten it)
    vllm_available: bool = False  # the workers can run the vLLM target engine (`Settings.vllm_available`)
    hub_probe: HubProbe = field(default_factory=HubProbe)  # can the workers fetch a hub id (`api.preflight`)
    quotas: QuotaLedger = field(default_factory=QuotaLedger)  # uploads in flight per owner (`api.uploads`)


async def get_state(request: Request) -> AppState:
    """The app's state (built in the lifespan).

    Async on purpose: FastAPI runs a plain `def` dependency in its threadpool, and this one is in
    every request (a thread hop each time showed up in the profile of `GET /v1/jobs`).
    """
    return request.app.state.peagle


State = Annotated[AppState, Depends(get_state)]


async def get_db(state: State) -> AsyncIterator[Session]:
    """A session per request (the handler commits what it writes).

    An async generator on purpose: its teardown (returning the connection to the pool) runs on the event
    loop, not in a threadpool thread. A sync teardown would need a free thread while every thread may be
    waiting for a pooled connection held by a session waiting for its teardown: a deadlock under load.
    """
    session = state.sessions()
    try:
        yield session
    finally:
        session.close()


DB = Annotated[Session, Depends(get_db)]


async def get_read_db(state: State) -> Session:
    """A read-only session in autocommit mode (no BEGIN/ROLLBACK round trips) for `releases_db` handlers.

    Not a generator: the handler's `releases_db` wrapper closes it in the handler's own thread (a
    generator teardown would run on the event loop for every request). A session takes a connection
    only when first used, so one the handler never reaches (401, 422) holds nothing.
    """
    return (state.read_sessions or state.sessions)()


ReadDB = Annotated[Session, Depends(get_read_db)]


def releases_db(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Close the handler's session as soon as it returns (before FastAPI serializes in another thread).

    Sync handlers and their response serialization run in different threadpool threads; a pooled
    connection must never be held across that hop (threads <= connections is not enough otherwise).
    Handlers commit their writes and return plain data (no ORM objects).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            session = kwargs.get("session")
            if session is not None:
                session.close()

    return wrapper


def auth(scope: str, *, allow_token: str | None = None) -> Callable[..., Any]:
    """Dependency: the caller, required to hold `scope` (403 otherwise).

    Async and database-free on a cache hit (keys are cached per app for `AUTH_CACHE_S` seconds, so a
    revocation takes effect within that time); a miss looks the key up in a threadpool thread with its
    own short session, so no pooled connection is held across thread hops.

    Args:
        scope: `read`, `write` or `admin`.
        allow_token: also accept a `?token=` minted for this purpose (`stream` or `download`) and for the
            route's `job_id`.
    """
    if allow_token:

        async def dep_token(
            request: Request,
            state: State,
            token: Annotated[str | None, Query(description="Short-lived stream token (browsers).")] = None,
        ) -> repo.Principal:
            return check_scope(await authenticate(request, state, token, allow_token), scope)

        return dep_token

    async def dep(request: Request) -> repo.Principal:  # no sub-dependencies: each costs per request
        return await authorize(request, scope)

    return dep


Reader = Annotated[repo.Principal, Depends(auth("read"))]
Writer = Annotated[repo.Principal, Depends(auth("write"))]
TokenReader = Annotated[repo.Principal, Depends(auth("read", allow_token="stream"))]  # SSE streams
DownloadReader = Annotated[repo.Principal, Depends(auth("read", allow_token="download"))]  # checkpoint files
