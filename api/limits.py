"""Bounded request bodies: `BodyLimitMiddleware` refuses a body before the app reads it.

A request with a body (`Content-Length` above 0, or chunked) is checked before any of it is read:
- a declared `Content-Length` above the path's limit is 413 at once;
- on every path but the public ones (sign-in, outside `/v1/`), a request without valid credentials is
  401 (as the route would answer, but before FastAPI reads and parses the body);
- a body without a length (chunked) is counted while the app reads it and cut at the limit: 413.
The limit is `Settings.max_request_body_bytes`; a dataset upload (`POST /v1/datasets`) has its own,
larger one (`Settings.max_upload_bytes` plus the multipart framing), the route checking the file size, and
so does a draft upload (`POST /v1/drafts`, `Settings.max_draft_upload_bytes`).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request

from api.auth import authenticate
from api.errors import ApiError, envelope
from service.settings import Settings

__all__ = ["DRAFT_UPLOAD", "MULTIPART_OVERHEAD_BYTES", "PUBLIC_WRITES", "UPLOAD_PATHS", "BodyLimitMiddleware", "body_limit"]

#: Room for the multipart framing around an uploaded file (boundaries, part headers, small fields).
MULTIPART_OVERHEAD_BYTES = 64 * 1024
#: Dataset uploads: the body is the file (`Settings.max_upload_bytes`).
UPLOAD_PATHS = frozenset({("POST", "/v1/datasets")})
#: Draft uploads (warm starts): the body is the archive (`Settings.max_draft_upload_bytes`).
DRAFT_UPLOAD = ("POST", "/v1/drafts")
#: Requests with a body that carry no credentials by design (sign-in sends the API key in its body).
PUBLIC_WRITES = frozenset({("POST", "/v1/auth/session")})


def body_limit(settings: Settings, *, method: str, path: str) -> int:
    """The largest body (bytes) a `method` request to `path` may send."""
    if (method, path) in UPLOAD_PATHS:
        return settings.max_upload_bytes + MULTIPART_OVERHEAD_BYTES
    if (method, path) == DRAFT_UPLOAD:
        return settings.max_draft_upload_bytes + MULTIPART_OVERHEAD_BYTES
    return settings.max_request_body_bytes


class _TooLarge(Exception):
    """Raised from `receive` once a body passes its limit (the middleware answers 413, whatever the app did)."""


def _too_large(limit: int, declared: int | None = None) -> ApiError:
    what = f"a body of {declared} bytes" if declared is not None else "the body"
    return ApiError(413, "payload_too_large", f"{what} exceeds the limit of {limit} bytes for this request",
                    headers={"Connection": "close"})


async def _answer(scope: dict[str, Any], receive: Any, send: Any, exc: ApiError) -> None:
    response = JSONResponse(envelope(exc.code, exc.message, exc.param, exc.details), status_code=exc.status,
                            headers=exc.headers)
    await response(scope, receive, send)


class BodyLimitMiddleware:
    """Pure ASGI middleware: bounded bodies, and no unauthenticated body read (see the module docstring).

    It reads the settings and the principal cache from the app's state (`scope["app"].state.peagle`).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        declared = int(length) if length is not None and length.isdigit() else None
        if not chunked and not declared:
            await self.app(scope, receive, send)  # no body (or a malformed length: the server refuses it)
            return
        state = scope["app"].state.peagle
        method, path = scope["method"], scope["path"]
        limit = body_limit(state.settings, method=method, path=path)
        if declared is not None and declared > limit:
            await _answer(scope, receive, send, _too_large(limit, declared))
            return
        if path.startswith("/v1/") and (method, path) not in PUBLIC_WRITES:
            try:
                await authenticate(Request(scope), state, None)
            except ApiError as exc:
                await _answer(scope, receive, send, exc)
                return
        await self._bounded(scope, receive, send, limit)

    async def _bounded(self, scope: dict[str, Any], receive: Any, send: Any, limit: int) -> None:
        """Run the app with `receive` counting the body; past `limit`, answer 413 instead of the app."""
        seen = 0
        exceeded = started = False

        async def counting_receive() -> dict[str, Any]:
            nonlocal seen, exceeded
            msg: dict[str, Any] = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    exceeded = True
                    raise _TooLarge
            return msg

        async def guarded_send(msg: dict[str, Any]) -> None:
            nonlocal started
            if exceeded and not started:
                return  # the app's answer to a cut body (400, 500, ...) is replaced by the 413 below
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not exceeded or started:
                raise
        if exceeded and not started:
            await _answer(scope, receive, send, _too_large(limit))
