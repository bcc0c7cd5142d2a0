"""The FastAPI application: `create_app(settings)` builds everything in its lifespan (no module singletons).

    uvicorn --factory api.main:create_app

Importing this module never imports torch (checked by a test).
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from anyio import to_thread
from fastapi import FastAPI

from api.deps import AppState
from api.errors import install_error_handlers
from api.limits import BodyLimitMiddleware
from api.metrics import MetricsMiddleware, ServiceMetrics
from api.retry import RetryMiddleware
from service.settings import Settings, get_settings

__all__ = ["create_app", "require_secret_key"]

THREADS = 24
GC_YOUNG_THRESHOLD = 10_000
FRONTEND = Path(__file__).resolve().parents[1] / "frontend"

DESCRIPTION = """Train P-EAGLE speculative-decoding drafts as jobs.

Auth: `Authorization: Bearer <api key>` (create one with `python -m api.admin create-key --owner NAME --scope write`).
Errors: `{"error": {"code", "message", "param", "details"}}`; `param` is a JSON pointer (spec problems point
into the spec, e.g. `/peagle/num_depths`); 422 lists every problem in `details`.

Job states: queued -> running -> succeeded | failed; running -> pausing -> paused -> queued (resume);
running/pausing -> cancelling -> cancelled; queued/paused -> cancelled. Illegal transitions are 409.
"""


def _build_state(settings: Settings, metrics: ServiceMetrics) -> AppState:
    """The app's state: engines, sessions, producer, Redis clients and the live hub (started by the lifespan)."""
    import asyncio

    from api.live import LiveHub
    from api.routes.streams import serialize_raw
    from service.db import upgrade
    from service.db.aio import is_postgres, make_read_pool
    from service.db.session import make_engine, make_read_engine, make_session_factory
    from service.queue import make_producer

    url = settings.resolved_database_url()
    if settings.embedded and url.startswith("sqlite"):
        upgrade(url)  # embedded default: the schema still comes only from the migrations
    # No pre-ping (a round trip per request): after a database restart, the first query on a stale
    # connection fails (that request answers 500) and SQLAlchemy then discards the whole stale pool.
    engine = make_engine(url, pool_pre_ping=False, pool_recycle=1800, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_pool_overflow, pool_timeout=settings.db_pool_timeout_s)
    read_engine = make_read_engine(engine)
    read_sessions = make_session_factory(read_engine)
    redis_async, redis_sync = None, None
    if settings.redis_url:
        import redis
        import redis.asyncio as aioredis

        redis_async = aioredis.Redis.from_url(settings.redis_url)
        redis_sync = redis.Redis.from_url(settings.redis_url)
    return AppState(
        settings=settings, engine=engine, sessions=make_session_factory(engine), producer=make_producer(settings),
        metrics=metrics, validator_slots=asyncio.Semaphore(settings.max_concurrent_validations),
        hub=LiveHub(read_sessions, serialize_raw, redis=redis_async), read_sessions=read_sessions,
        read_engine=read_engine,  # the PostgreSQL read pool is opened by the lifespan
        read_pool=make_read_pool(url, size=settings.read_pool_size) if is_postgres(url) else None,
        redis=redis_async, redis_sync=redis_sync, vllm_available=settings.vllm_available())


def require_secret_key(settings: Settings) -> None:
    """Refuse to run outside embedded mode with the default or a short secret key (forgeable tokens)."""
    problem = settings.secret_key_problem()
    if problem:
        raise RuntimeError(f"refusing to start: {problem}. Set PEAGLE_SECRET_KEY to a random string of at least "
                           "32 characters, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(48))'`.")


def create_app(settings: Settings | None = None) -> FastAPI:
    """The API app. `settings=None` reads them from the environment (`get_settings()`) at startup.

    Raises RuntimeError (here, or at startup when `settings` is None) outside embedded mode with a default or
    short `secret_key`.
    """
    if settings is not None:
        require_secret_key(settings)
    metrics = ServiceMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Each request thread holds at most one pooled connection: keep threads <= pool size so a
        # thread never waits for a connection held by a request that waits for a thread (deadlock).
        to_thread.current_default_thread_limiter().total_tokens = THREADS
        resolved = settings or get_settings()
        require_secret_key(resolved)
        state = _build_state(resolved, metrics)
        from api.uploads import sweep_leftovers

        await to_thread.run_sync(sweep_leftovers, resolved)  # `.partial-*` of an API killed mid-upload
        hub = state.hub
        if state.read_pool is not None:
            await state.read_pool.open()
        await hub.start()
        app.state.peagle = state
        # Everything built so far (modules, routes, schemas, SQLAlchemy metadata) lives as long as the
        # process: move it out of the collector's reach. Without this, each full collection scanned it
        # all and paused the event loop for 100-250 ms (the p99 of GET /v1/jobs under load). And collect
        # the young generation after GC_YOUNG_THRESHOLD net allocations, not 700: under load a request's
        # objects live for tens of ms, and at 700 each was scanned (and promoted) several times.
        thresholds = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
        try:
            yield
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()  # (several apps in one process, as in tests: their garbage stays collectable)
            await hub.stop()
            if state.read_pool is not None:
                await state.read_pool.close()
            state.producer.close()
            if state.redis is not None:
                await state.redis.aclose()
            if state.redis_sync is not None:
                state.redis_sync.close()
            state.engine.dispose()

    # FastAPI's native OpenTelemetry hooks are off: the service exports Prometheus metrics (/metrics), and
    # with them on, every request looked up the global OTel providers (environment reads included).
    app = FastAPI(title="P-EAGLE training service", version="1", description=DESCRIPTION, lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    install_error_handlers(app)
    from api.routes import (
        auth,
        checkpoints,
        datasets,
        drafts,
        jobs,
        meta,
        promotion,
        streams,
        tasks,
        webhooks,
    )

    for module in (jobs, meta, auth, streams, checkpoints, datasets, drafts, webhooks, promotion, tasks):  # jobs first
        app.include_router(module.router)
    app.add_middleware(BodyLimitMiddleware)  # before routing: no unbounded or unauthenticated body is read
    app.add_middleware(RetryMiddleware)  # inside the metrics: they count the retried answer
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if FRONTEND.is_dir():
        from fastapi.staticfiles import StaticFiles

        app.mount("/", StaticFiles(directory=FRONTEND, html=True), name="frontend")
    return app
