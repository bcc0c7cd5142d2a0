"""FastAPI dependencies: app state, database sessions, authentication and signed browser tokens.

Credentials, in order: `Authorization: Bearer <api key>`; on streams and downloads only, `?token=` from
`POST /v1/auth/stream-token` (EventSource and `<a download>` cannot send headers); the signed session cookie
(`POST /v1/auth/session`). Tokens are `base64url(json).base64url(hmac_sha256(secret_key, json))`.
A session cookie names a server-side `auth_session` row: sign-out revokes it (this process forgets it at
once, other API processes within `AUTH_CACHE_S`), and a cookie signed with a leaked key but naming no live
session is refused. A stream token names its key, ONE job and ONE purpose (`stream` or `download`); it is
refused on any other job's routes, on routes of the other purpose, and as a cookie. Revoking the API key
invalidates both.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any

import orjson
import sqlalchemy as sa
from fastapi import Depends, Query, Request, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from service.db import repo
from service.db.models import ApiKey, AuthSession, utcnow
from service.settings import Settings

__all__ = [
    "SESSION_COOKIE",
    "AppState",
    "auth",
    "authorize",
    "dumps",
    "forget_session",
    "get_db",
    "get_read_db",
    "get_state",
    "json_ok",
    "releases_db",
    "sign_token",
    "verify_token",
]

SESSION_COOKIE = "peagle_session"
AUTH_CACHE_S = 5.0  # API keys are re-checked against the database at least this often


@dataclass
class AppState:
    """Everything `create_app` builds in its lifespan (no module-level singletons)."""

    settings: Settings
    engine: sa.Engine
    sessions: sessionmaker[Session]
    producer: Any
    read_sessions: sessionmaker[Session] | None = None  # autocommit sessions for read-only handlers
    read_engine: sa.Engine | None = None  # the same pool in autocommit mode (Core reads, no BEGIN/ROLLBACK)
    read_pool: Any = None  # PostgreSQL: async psycopg pool for reads on the event loop (service.db.aio)
    redis: Any = None
    hub: Any = None
    metrics: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    vllm_available: bool = False  # the workers can run the vLLM target engine (`Settings.vllm_available`)


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


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign_token(secret: str, payload: dict[str, Any]) -> str:
    """Sign a JSON payload (must contain `exp`, unix seconds)."""
    body = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    mac = hmac.new(secret.encode(), body, hashlib.sha256).digest()
    return f"{_b64(body)}.{_b64(mac)}"


def verify_token(secret: str, token: str, kind: str) -> dict[str, Any] | None:
    """Payload of a valid, unexpired token of `kind`, else None."""
    try:
        body_s, mac_s = token.split(".", 1)
        body = _unb64(body_s)
        mac = _unb64(mac_s)
    except (ValueError, TypeError):
        return None
    if not hmac.compare_digest(mac, hmac.new(secret.encode(), body, hashlib.sha256).digest()):
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("t") != kind or float(payload.get("exp", 0)) < time.time():
        return None
    return payload


def _principal_from_key_id(session: Session, key_id: int) -> repo.Principal | None:
    row = session.get(ApiKey, key_id)
    if row is None or row.revoked_at is not None:
        return None
    scopes: set[str] = set()
    for s in row.scopes or []:
        scopes |= repo._IMPLIED.get(s, set())
    return repo.Principal(row.owner_id, row.owner.name, row.id, frozenset(scopes))


def _principal_from_session(session: Session, session_id: str) -> repo.Principal | None:
    row = session.get(AuthSession, session_id)
    if row is None or row.revoked_at is not None or row.expires_at <= utcnow():
        return None
    return _principal_from_key_id(session, row.key_id)


def forget_session(state: AppState, session_id: str) -> None:
    """Drop a signed-out session from this process's auth cache (other processes: within `AUTH_CACHE_S`)."""
    state.extra.get("auth_cache", {}).pop(f"s:{session_id}", None)


def _lookup(state: AppState, cache_key: str, load: Callable[[Session], repo.Principal | None]
            ) -> repo.Principal | None:
    """Principal from the per-app TTL cache, else from the database (own short session, in a thread)."""
    ttl = float(state.extra.get("auth_cache_s", AUTH_CACHE_S))
    cache: dict[str, tuple[repo.Principal | None, float]] = state.extra.setdefault("auth_cache", {})
    hit = cache.get(cache_key)
    now = time.monotonic()
    if hit is not None and hit[1] > now:
        return hit[0]
    with state.sessions() as session:
        principal = load(session)
        session.commit()
    if ttl > 0:
        if len(cache) > 10_000:
            cache.clear()
        cache[cache_key] = (principal, now + ttl)
    return principal


async def _authenticate(request: Request, state: AppState, token: str | None, purpose: str | None = None
                        ) -> repo.Principal:
    header = request.headers.get("authorization")
    if header:
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "unauthorized", "Authorization must be 'Bearer <api key>'")
        cache_key = "b:" + repo.hash_key(key)
        principal = _cached(state, cache_key)
        if principal is _MISS:
            principal = await _lookup_once(state, cache_key, lambda s: repo.authenticate(s, key))
        if principal is None:
            raise ApiError(401, "unauthorized", "invalid or revoked API key",
                           headers={"WWW-Authenticate": "Bearer"})
        return principal
    secret = state.settings.secret_key
    if token:
        payload = verify_token(secret, token, "stream")
        if (payload is None or purpose is None or payload.get("p") != purpose
                or payload.get("j") != request.path_params.get("job_id") or not isinstance(payload.get("k"), int)):
            raise ApiError(401, "unauthorized", "invalid or expired stream token (a token is for one job and "
                           "one purpose)")
        key_id = int(payload["k"])
        cache_key = f"k:{key_id}"
        principal = _cached(state, cache_key)
        if principal is _MISS:
            principal = await _lookup_once(state, cache_key, functools.partial(_principal_from_key_id, key_id=key_id))
        if principal is None:
            raise ApiError(401, "unauthorized", "the API key behind this token was revoked")
        return repo.Principal(principal.owner_id, principal.owner_name, principal.key_id,
                              principal.scopes & {"read"})
    raw = request.cookies.get(SESSION_COOKIE)
    if raw:
        payload = verify_token(secret, raw, "session")
        session_id = payload.get("s") if payload is not None else None
        if not isinstance(session_id, str):
            raise ApiError(401, "unauthorized", "invalid or expired session")
        cache_key = f"s:{session_id}"
        principal = _cached(state, cache_key)
        if principal is _MISS:
            principal = await _lookup_once(state, cache_key,
                                           functools.partial(_principal_from_session, session_id=session_id))
        if principal is None:
            raise ApiError(401, "unauthorized", "the session was signed out, expired, or its API key revoked")
        return principal
    raise ApiError(401, "unauthorized", "missing credentials: send 'Authorization: Bearer <api key>'",
                   headers={"WWW-Authenticate": "Bearer"})


_MISS: Any = object()


async def _lookup_once(state: AppState, cache_key: str, load: Callable[[Session], repo.Principal | None]
                       ) -> repo.Principal | None:
    """`_lookup` in a threadpool thread, at most one at a time per key in this process.

    When a key's entry expires, every request in flight with that key misses at once (100 closed-loop
    clients: 100 thread hops and ORM lookups in the same millisecond, a stall of the event loop every
    `AUTH_CACHE_S`). They all await the one lookup instead. It runs as its own task, so a client that
    disconnects does not cancel it for the others; a lookup that fails fails them all (no entry is cached).
    The bound on revocation is unchanged: the entry expires `AUTH_CACHE_S` after its lookup started.
    """
    inflight: dict[str, asyncio.Future[repo.Principal | None]] = state.extra.setdefault("auth_inflight", {})
    task = inflight.get(cache_key)
    if task is None:
        task = asyncio.ensure_future(run_in_threadpool(_lookup, state, cache_key, load))
        inflight[cache_key] = task
        task.add_done_callback(lambda _t: inflight.pop(cache_key, None))
    return await asyncio.shield(task)


def _cached(state: AppState, cache_key: str) -> Any:
    hit = state.extra.get("auth_cache", {}).get(cache_key)
    if hit is not None and hit[1] > time.monotonic():
        return hit[0]
    return _MISS


def _iso(obj: Any) -> Any:
    if isinstance(obj, datetime):
        return obj.isoformat().replace("+00:00", "Z")
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def dumps(data: Any) -> bytes:
    """Compact JSON with datetimes as ISO 8601 (`Z` for UTC); NaN and infinities are written as null.

    orjson, and the stdlib for what orjson refuses but JSON allows (integers beyond 64 bits, non-string
    keys); a value neither can write raises TypeError, as before.
    """
    try:
        return orjson.dumps(data, option=orjson.OPT_UTC_Z)
    except orjson.JSONEncodeError:
        return json.dumps(data, default=_iso, separators=(",", ":"), allow_nan=False).encode()


def jsonable(data: Any) -> Any:
    """`data` with datetimes as ISO strings (`Z` for UTC), exactly as `json_ok` writes them."""
    return json.loads(dumps(data))  # the stdlib reads integers beyond 64 bits exactly


def json_ok(data: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response built without a second validation pass (hot paths; shapes match the models).

    orjson, not FastAPI's encoder or the stdlib: a 20-job page costs ~20 us instead of ~100 us.
    """
    return Response(dumps(data), status_code=status_code, headers=headers, media_type="application/json")


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
            return _check(await _authenticate(request, state, token, allow_token), scope)

        return dep_token

    async def dep(request: Request) -> repo.Principal:  # no sub-dependencies: each costs per request
        return await authorize(request, scope)

    return dep


async def authorize(request: Request, scope: str) -> repo.Principal:
    """The caller of `request` (API key or session cookie), required to hold `scope`; else 401/403.

    What the `Reader`/`Writer` dependencies do, callable from a handler that takes only the request.
    """
    return _check(await _authenticate(request, request.app.state.peagle, None), scope)


def _check(principal: repo.Principal, scope: str) -> repo.Principal:
    if not principal.has(scope):
        raise ApiError(403, "forbidden", f"this key lacks the '{scope}' scope")
    return principal


Reader = Annotated[repo.Principal, Depends(auth("read"))]
Writer = Annotated[repo.Principal, Depends(auth("write"))]
TokenReader = Annotated[repo.Principal, Depends(auth("read", allow_token="stream"))]  # SSE streams
DownloadReader = Annotated[repo.Principal, Depends(auth("read", allow_token="download"))]  # checkpoint files
