"""Who is calling: API keys, signed browser tokens, and a per-process cache of principals.

Credentials, in order: `Authorization: Bearer <api key>`; on streams and downloads only, `?token=` from
`POST /v1/auth/stream-token` (EventSource and `<a download>` cannot send headers); the signed session cookie
(`POST /v1/auth/session`). Tokens are `base64url(json).base64url(hmac_sha256(secret_key, json))`.
A session cookie names a server-side `auth_session` row: sign-out revokes it (this process forgets it at
once, other API processes within `AUTH_CACHE_S`), and a cookie signed with a leaked key but naming no live
session is refused. A stream token names its key, ONE job and ONE purpose (`stream` or `download`); it is
refused on any other job's routes, on routes of the other purpose, and as a cookie. Revoking the API key
invalidates both; a token minted by a browser session also names the session and dies with it (sign-out).

The FastAPI dependencies built on this (`Reader`, `Writer`, ...) are in `api.deps`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from api.retry import is_dropped_connection
from service.db import repo
from service.db.models import ApiKey, AuthSession, utcnow

if TYPE_CHECKING:
    from sqlalchemy.orm import sessionmaker

    from service.settings import Settings

__all__ = [
    "AUTH_CACHE_S",
    "SESSION_COOKIE",
    "AuthState",
    "PrincipalCache",
    "authenticate",
    "authorize",
    "check_scope",
    "forget_session",
    "sign_token",
    "verify_token",
]

SESSION_COOKIE = "peagle_session"
AUTH_CACHE_S = 5.0  # API keys are re-checked against the database at least this often

Load = Callable[[Session], repo.Principal | None]


@dataclass
class PrincipalCache:
    """This process's principals by credential (`b:<key hash>`, `k:<key id>`, `s:<session id>`).

    `entries` maps a credential to `(principal or None for refused, monotonic expiry)`; `inflight` holds
    the one database lookup running per credential (`_lookup_once`). `ttl_s` 0 caches nothing.
    """

    ttl_s: float = AUTH_CACHE_S
    entries: dict[str, tuple[repo.Principal | None, float]] = field(default_factory=dict)
    inflight: dict[str, asyncio.Future[repo.Principal | None]] = field(default_factory=dict)


class AuthState(Protocol):
    """What authentication uses of the app's state (`api.deps.AppState` is one): stated here, so this
    module stands below `api.deps` and imports nothing of it."""

    settings: Settings
    sessions: sessionmaker[Session]
    principals: PrincipalCache


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


def forget_session(state: AuthState, session_id: str) -> None:
    """Drop a signed-out session from this process's auth cache (other processes: within `AUTH_CACHE_S`)."""
    state.principals.entries.pop(f"s:{session_id}", None)


def _lookup(state: AuthState, cache_key: str, load: Load) -> repo.Principal | None:
    """Principal from the per-app TTL cache, else from the database (own short session, in a thread)."""
    cache = state.principals
    hit = cache.entries.get(cache_key)
    now = time.monotonic()
    if hit is not None and hit[1] > now:
        return hit[0]
    with state.sessions() as session:
        principal = load(session)
        session.commit()
    if cache.ttl_s > 0:
        if len(cache.entries) > 10_000:
            cache.entries.clear()
        cache.entries[cache_key] = (principal, now + cache.ttl_s)
    return principal


async def authenticate(request: Request, state: AuthState, token: str | None, purpose: str | None = None
                       ) -> repo.Principal:
    """The caller of `request` by its credentials (see the module docstring), else `ApiError` 401.

    Args:
        token: the `?token=` of the request, accepted only when `purpose` names what it was minted for.
    """
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
        key_id, session_id = int(payload["k"]), payload.get("s")
        # A token minted by a browser session names it: it dies with the session (sign-out), through the
        # same `s:` cache entry as the cookie, which sign-out drops. One minted with an API key names none.
        load: Load = (functools.partial(_principal_from_session, session_id=session_id) if isinstance(session_id, str)
                      else functools.partial(_principal_from_key_id, key_id=key_id))
        cache_key = f"s:{session_id}" if isinstance(session_id, str) else f"k:{key_id}"
        principal = _cached(state, cache_key)
        if principal is _MISS:
            principal = await _lookup_once(state, cache_key, load)
        if principal is None or principal.key_id != key_id:
            raise ApiError(401, "unauthorized", "the session or API key behind this token was signed out or revoked")
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


async def _lookup_once(state: AuthState, cache_key: str, load: Load) -> repo.Principal | None:
    """`_lookup` in a threadpool thread, at most one at a time per key in this process.

    When a key's entry expires, every request in flight with that key misses at once (100 closed-loop
    clients: 100 thread hops and ORM lookups in the same millisecond, a stall of the event loop every
    `AUTH_CACHE_S`). They all await the one lookup instead. It runs as its own task, so a client that
    disconnects does not cancel it for the others; a lookup that fails fails them all (no entry is cached).
    The bound on revocation is unchanged: the entry expires `AUTH_CACHE_S` after its lookup started.
    """
    inflight = state.principals.inflight
    joined = inflight.get(cache_key)
    if joined is not None:
        try:
            return await asyncio.shield(joined)
        except Exception as exc:
            # The lookup this request joined started before it, maybe on a pooled connection PostgreSQL had
            # already dropped: its failure is not this request's (a request retried by `RetryMiddleware`
            # would otherwise fail again on its predecessor's stale connection). That failure discarded the
            # stale pool, so a lookup started now gets a fresh connection.
            if not is_dropped_connection(exc):
                raise
    task = inflight.get(cache_key)
    if task is None or task is joined:
        task = asyncio.ensure_future(run_in_threadpool(_lookup, state, cache_key, load))
        inflight[cache_key] = task
        task.add_done_callback(lambda t: inflight.pop(cache_key, None) if inflight.get(cache_key) is t else None)
    return await asyncio.shield(task)


def _cached(state: AuthState, cache_key: str) -> Any:
    hit = state.principals.entries.get(cache_key)
    if hit is not None and hit[1] > time.monotonic():
        return hit[0]
    return _MISS


async def authorize(request: Request, scope: str) -> repo.Principal:
    """The caller of `request` (API key or session cookie), required to hold `scope`; else 401/403.

    What the `Reader`/`Writer` dependencies do, callable from a handler that takes only the request.
    """
    return check_scope(await authenticate(request, request.app.state.peagle, None), scope)


def check_scope(principal: repo.Principal, scope: str) -> repo.Principal:
    """`principal` if it holds `scope`, else `ApiError` 403."""
    if not principal.has(scope):
        raise ApiError(403, "forbidden", f"this key lacks the '{scope}' scope")
    return principal
