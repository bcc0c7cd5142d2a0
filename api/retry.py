"""Idempotent reads survive a dropped database connection: `ReadRetryMiddleware`.

The API's engine has no pre-ping (a round trip per request): after PostgreSQL drops its connections
(restart, failover, `pg_terminate_backend`), the first query on a stale pooled connection fails, and
SQLAlchemy then invalidates the whole stale pool. A GET or HEAD that fails that way before anything was
sent is run once more, on a fresh connection, so the client sees 200 instead of 500. Writes are never
retried (not idempotent): a POST that meets a dropped connection still answers 500, once per process.
The async read pool (`service.db.aio`) does its own check-and-retry.
"""

from __future__ import annotations

import logging
from typing import Any

from psycopg import OperationalError as PsycopgOperationalError
from sqlalchemy.exc import DBAPIError

__all__ = ["ReadRetryMiddleware", "is_dropped_connection"]

log = logging.getLogger("peagle.api")
IDEMPOTENT = frozenset({"GET", "HEAD"})


def is_dropped_connection(exc: BaseException) -> bool:
    """The database connection broke under the query (not a query error)."""
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated)
    return isinstance(exc, PsycopgOperationalError)


class ReadRetryMiddleware:
    """Pure ASGI middleware: one retry of a GET/HEAD that failed on a dropped database connection before
    its response started (the request body, if any, is replayed)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in IDEMPOTENT:
            await self.app(scope, receive, send)
            return
        received: list[dict[str, Any]] = []
        started = False

        async def recording_receive() -> dict[str, Any]:
            msg = await receive()
            received.append(msg)
            return msg

        async def tracking_send(msg: dict[str, Any]) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, recording_receive, tracking_send)
            return
        except Exception as exc:
            if started or not is_dropped_connection(exc):
                raise
            log.warning("%s %s: database connection dropped (%s); retrying once", scope["method"],
                        scope.get("path"), type(exc).__name__)
        replay = list(received)

        async def replay_receive() -> dict[str, Any]:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replay_receive, send)
