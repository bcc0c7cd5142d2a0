"""Browser auth: API key -> signed httponly session cookie naming a server-side session (sign-out revokes
it); short-lived stream/download tokens for one job, for EventSource and `<a download>`."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import sqlalchemy as sa
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from api.auth import SESSION_COOKIE, forget_session, sign_token, verify_token
from api.deps import DB, Reader, State, releases_db
from api.errors import ApiError
from api.job_lookup import load_job
from api.openapi import AUTH, error_responses, header
from api.schemas import SessionCreate, TokenOut, WhoAmI
from service.db import repo
from service.db.models import AuthSession, new_id, utcnow

router = APIRouter(prefix="/v1/auth", tags=["auth"])

SESSION_TTL_S = 12 * 3600
STREAM_TOKEN_TTL_S = 300


class StreamTokenCreate(BaseModel):
    """What a stream token is for: one job, and either its SSE streams or its checkpoint downloads."""

    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_]+$")
    purpose: Literal["stream", "download"] = Field(
        default="stream", description="`stream`: the job's `/events|metrics|logs/stream`; `download`: its "
        "checkpoint files and archives.")


@router.post("/session", response_model=WhoAmI, operation_id="auth-session-create",
             summary="Sign in a browser: exchange an API key for a signed httponly cookie",
             responses={200: {"description": "Signed in.", "headers": {"Set-Cookie": header(
                 f"`{SESSION_COOKIE}`: the signed, httponly session cookie.")}},
                 **error_responses(400, 401, 422, descriptions={401: "Invalid or revoked API key."})})
@releases_db
def create_session(body: SessionCreate, request: Request, response: Response, state: State, session: DB) -> Any:
    principal = repo.authenticate(session, body.api_key)
    if principal is None:
        raise ApiError(401, "unauthorized", "invalid or revoked API key", param="/api_key")
    now = utcnow()
    session.execute(sa.delete(AuthSession).where(AuthSession.expires_at < now - timedelta(days=1)))
    row = AuthSession(id=new_id("ses"), key_id=principal.key_id, created_at=now,
                      expires_at=now + timedelta(seconds=SESSION_TTL_S))
    session.add(row)
    session.commit()
    token = sign_token(state.settings.secret_key, {"t": "session", "s": row.id, "k": principal.key_id,
                                                   "exp": int(time.time()) + SESSION_TTL_S})
    response.set_cookie(SESSION_COOKIE, token, max_age=SESSION_TTL_S, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/")
    return {"owner": principal.owner_name, "scopes": sorted(principal.scopes)}


@router.delete("/session", status_code=204, operation_id="auth-session-delete",
               summary="Sign out (the session is revoked server-side: the cookie stops working everywhere)",
               responses={204: {"description": "Signed out.", "headers": {"Set-Cookie": header(
                   f"Clears `{SESSION_COOKIE}`.")}}})
@releases_db
def delete_session(request: Request, response: Response, state: State, session: DB) -> Response:
    raw = request.cookies.get(SESSION_COOKIE)
    payload = verify_token(state.settings.secret_key, raw, "session") if raw else None
    if payload is not None and isinstance(payload.get("s"), str):
        session.execute(sa.update(AuthSession).where(AuthSession.id == payload["s"], AuthSession.revoked_at.is_(None))
                        .values(revoked_at=utcnow()))
        session.commit()
        forget_session(state, payload["s"])
    response.delete_cookie(SESSION_COOKIE, path="/")
    response.status_code = 204
    return response


@router.get("/session", response_model=WhoAmI, operation_id="auth-session-get", summary="Who am I",
            responses=error_responses(*AUTH))
def whoami(principal: Reader) -> Any:
    return {"owner": principal.owner_name, "scopes": sorted(principal.scopes)}


@router.post("/stream-token", response_model=TokenOut, operation_id="auth-stream-token",
             summary="A short-lived read-only `?token=` for one job's streams or checkpoint downloads",
             responses=error_responses(400, *AUTH, 404, 422))
@releases_db
def stream_token(body: StreamTokenCreate, request: Request, state: State, session: DB, principal: Reader) -> Any:
    """Minted by a browser session, the token names the session too: signing out revokes it."""
    load_job(session, principal, body.job_id)  # 404 unless the caller may read it
    exp = int(time.time()) + STREAM_TOKEN_TTL_S
    claims: dict[str, Any] = {"t": "stream", "k": principal.key_id, "j": body.job_id, "p": body.purpose, "exp": exp}
    raw = None if request.headers.get("authorization") else request.cookies.get(SESSION_COOKIE)
    signed_in = verify_token(state.settings.secret_key, raw, "session") if raw else None
    if signed_in is not None and isinstance(signed_in.get("s"), str):  # the caller authenticated by this cookie
        claims["s"] = signed_in["s"]
    token = sign_token(state.settings.secret_key, claims)
    return {"token": token, "expires_at": datetime.fromtimestamp(exp, UTC)}
