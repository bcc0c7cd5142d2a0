"""Requests survive a dropped database connection: `RetryMiddleware`.

The API's engine has no pre-ping (a round trip per request): after PostgreSQL drops its connections
(restart, failover, `pg_terminate_backend`), the first query on each stale pooled connection fails, and
SQLAlchemy invalidates the stale pool (connections checked out at that moment fail on their own: under
concurrent load, one request per checked-out connection). A request that fails that way before its
response started is run once more, on a fresh connection, with its body replayed:

- GET and HEAD always (idempotent).
- Writes unless a transaction that wrote had started to COMMIT in the failed attempt (`track_commits`
  watches the engine): before that, PostgreSQL rolled the dead connection's transaction back, so the
  retry writes once. A connection lost during such a COMMIT leaves the outcome unknown: that answer is a
  503 `database_connection_lost` saying so, never a blind second write. Bodies over `REPLAY_LIMIT`
  (dataset uploads) are not held for a replay: those requests are not retried.

The async read pool (`service.db.aio`) does its own check-and-retry.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

import sqlalchemy as sa
from psycopg import OperationalError as PsycopgOperationalError
from sqlalchemy.exc import DBAPIError
from starlette.responses import JSONResponse

from api.errors import envelope

__all__ = ["REPLAY_LIMIT", "RetryMiddleware", "is_dropped_connection", "track_commits"]

log = logging.getLogger("peagle.api")
IDEMPOTENT = frozenset({"GET", "HEAD"})
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
REPLAY_LIMIT = 1 << 20  # bytes of request body held for a replay (the JSON bodies; not dataset uploads)

#: Per request attempt: {"wrote": a write statement ran, "committed": a COMMIT of a writing transaction
#: started}. A mutable dict, so what the handler's threadpool thread sets is seen here.
_ATTEMPT: ContextVar[dict[str, bool] | None] = ContextVar("peagle_db_attempt", default=None)


def is_dropped_connection(exc: BaseException) -> bool:
    """The database connection broke under the query (not a query error)."""
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated)
    return isinstance(exc, PsycopgOperationalError)


def _on_execute(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
    attempt = _ATTEMPT.get()
    if attempt is not None and not attempt["wrote"] and statement.lstrip()[:6].upper() != "SELECT":
        attempt["wrote"] = True


def _on_commit(_conn: Any) -> None:
    attempt = _ATTEMPT.get()
    if attempt is not None and attempt["wrote"]:
        attempt["committed"] = True


def track_commits(engine: sa.Engine) -> None:
    """Let `RetryMiddleware` see whether a write request reached a COMMIT (idempotent; cheap per statement)."""
    if not sa.event.contains(engine, "commit", _on_commit):
        sa.event.listen(engine, "before_cursor_execute", _on_execute)
        sa.event.listen(engine, "commit", _on_commit)


class RetryMiddleware:
    """Pure ASGI middleware: one retry of a request that failed on a dropped database connection before its
    response started (see the module docstring for which writes)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        method = scope.get("method")
        if scope["type"] != "http" or method not in IDEMPOTENT | WRITES:
            await self.app(scope, receive, send)
            return
        write = method in WRITES
        state = getattr(scope["app"].state, "peagle", None) if "app" in scope else None
        if write and state is not None:
            track_commits(state.engine)
        received: list[dict[str, Any]] = []
        held = 0
        started = False

        async def recording_receive() -> dict[str, Any]:
            nonlocal held
            msg = await receive()
            if held <= REPLAY_LIMIT:
                held += len(msg.get("body", b""))
                received.append(msg)
            return msg

        async def tracking_send(msg: dict[str, Any]) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        attempt = {"wrote": False, "committed": False}
        token = _ATTEMPT.set(attempt)
        try:
            await self.app(scope, recording_receive, tracking_send)
            return
        except Exception as exc:
            if started or not is_dropped_connection(exc) or held > REPLAY_LIMIT:
                raise
            if attempt["committed"]:
                log.warning("%s %s: database connection dropped while committing (%s); not retried",
                            method, scope.get("path"), type(exc).__name__)
                await JSONResponse(envelope(
                    "database_connection_lost", "the database connection was lost while this write was being "
                    "committed: it may or may not have been applied; check before repeating it"),
                    status_code=503, headers={"Retry-After": "1"})(scope, receive, send)
                return
            log.warning("%s %s: database connection dropped (%s); retrying once", method, scope.get("path"),
                        type(exc).__name__)
        finally:
            _ATTEMPT.reset(token)
        replay = list(received)

        async def replay_receive() -> dict[str, Any]:
            return replay.pop(0) if replay else await receive()

        try:
            await self.app(scope, replay_receive, send)
        except Exception as exc:
            if is_dropped_connection(exc):
                log.warning("%s %s: database connection dropped again on the retry (%s)", method, scope.get("path"),
                            type(exc).__name__)
            raise
