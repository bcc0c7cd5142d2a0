"""Browser auth: API key -> signed httponly session cookie; short-lived stream tokens for EventSource."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response

from api.deps import DB, SESSION_COOKIE, Reader, State, releases_db, sign_token
from api.errors import ApiError
from api.schemas import SessionCreate, TokenOut, WhoAmI
from service.db import repo

router = APIRouter(prefix="/v1/auth", tags=["auth"])

SESSION_TTL_S = 12 * 3600
STREAM_TOKEN_TTL_S = 300


@router.post("/session", response_model=WhoAmI, operation_id="auth-session-create",
             summary="Sign in a browser: exchange an API key for a signed httponly cookie")
@releases_db
def create_session(body: SessionCreate, request: Request, response: Response, state: State, session: DB) -> Any:
    principal = repo.authenticate(session, body.api_key)
    if principal is None:
        raise ApiError(401, "unauthorized", "invalid or revoked API key", param="/api_key")
    token = sign_token(state.settings.secret_key, {"t": "session", "k": principal.key_id,
                                                   "exp": int(time.time()) + SESSION_TTL_S})
    response.set_cookie(SESSION_COOKIE, token, max_age=SESSION_TTL_S, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/")
    return {"owner": principal.owner_name, "scopes": sorted(principal.scopes)}


@router.delete("/session", status_code=204, operation_id="auth-session-delete", summary="Sign out")
def delete_session(response: Response) -> Response:
    response.delete_cookie(SESSION_COOKIE, path="/")
    response.status_code = 204
    return response


@router.get("/session", response_model=WhoAmI, operation_id="auth-session-get", summary="Who am I")
def whoami(principal: Reader) -> Any:
    return {"owner": principal.owner_name, "scopes": sorted(principal.scopes)}


@router.post("/stream-token", response_model=TokenOut, operation_id="auth-stream-token",
             summary="A short-lived read-only token for `?token=` on streams and downloads")
def stream_token(state: State, principal: Reader) -> Any:
    exp = int(time.time()) + STREAM_TOKEN_TTL_S
    token = sign_token(state.settings.secret_key, {"t": "stream", "k": principal.key_id, "exp": exp})
    return {"token": token, "expires_at": datetime.fromtimestamp(exp, UTC)}
