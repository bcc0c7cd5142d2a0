"""One error envelope for every failure: `{"error": {"code", "message", "param", "details"}}`.

`param` is a JSON pointer into the request (for job specs: into the spec, e.g. `/peagle/num_depths`);
`details` lists every problem of a 422 at once (`[{"param", "message"}]`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount

from peagle.errors import PeagleError
from peagle.spec import SpecInvalidError
from service.db.states import IllegalTransition

__all__ = ["ApiError", "allow_header", "envelope", "install_error_handlers", "pointer"]

log = logging.getLogger("peagle.api")

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    411: "length_required",
    413: "payload_too_large",
    415: "unsupported_media_type",
    416: "range_not_satisfiable",
    422: "validation_error",
    429: "rate_limited",
    500: "internal_error",
    503: "unavailable",
}


def pointer(loc: tuple[Any, ...] | list[Any]) -> str:
    """JSON pointer for a location path: `("spec", "peagle", 0)` -> `/spec/peagle/0`."""
    return "/" + "/".join(str(x).replace("~", "~0").replace("/", "~1") for x in loc) if loc else ""


class ApiError(PeagleError):
    """An HTTP error rendered as the envelope (raise it anywhere in the API)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        details: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.details = details or []
        self.headers = headers or {}


def envelope(code: str, message: str, param: str | None = None, details: list[Any] | None = None) -> dict:
    """The error body."""
    return {"error": {"code": code, "message": message, "param": param, "details": details or []}}


def _json(status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def spec_error(exc: SpecInvalidError, *, prefix: tuple[str, ...] = ()) -> ApiError:
    """422 listing every spec problem; pointers are relative to the spec document (plus `prefix`)."""
    details = [{"param": pointer(prefix + tuple(p.loc)), "message": p.message} for p in exc.problems]
    first = details[0]["param"] if details else None
    return ApiError(422, "spec_invalid", str(exc), param=first, details=details)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allow_header(request: Request) -> dict[str, str]:
    """`{"Allow": ...}` for a 405: every method the app's routes serve on this path (RFC 9110 15.5.6).

    Starlette names only the methods of the first route matching the path (`GET` of `GET /v1/jobs`, not
    `POST`), or `GET, HEAD` when the frontend's static mount at `/` took the request; this names them all,
    asking each route (mounts aside) whether it fully matches the path with each method. Empty when no
    route but a mount matches the path (the mount's own `Allow` stands).
    """
    methods = [m for m in _METHODS if any(
        not isinstance(route, Mount) and route.matches({**request.scope, "method": m})[0] is Match.FULL
        for route in request.app.router.routes)]
    return {"Allow": ", ".join(methods)} if methods else {}


def _json_position(err: dict[str, Any], doc: Any) -> str:
    """`line L, column C: why` of a malformed JSON body (FastAPI's error carries the offset into `doc`)."""
    why = str((err.get("ctx") or {}).get("error") or err.get("msg") or "invalid JSON")
    loc = err.get("loc") or ()
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if pos is None or not isinstance(doc, str | bytes):
        return f"invalid JSON: {why}"
    text = doc if isinstance(doc, str) else doc.decode("utf-8", "replace")
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)  # as json.JSONDecodeError counts: 1-based, in characters
    return f"line {line}, column {column}: {why}"


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type the API raises through the envelope."""

    async def api_error(_req: Request, exc: ApiError) -> JSONResponse:
        return _json(exc.status, envelope(exc.code, exc.message, exc.param, exc.details), exc.headers)

    async def validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        details = []
        for err in exc.errors():
            loc = list(err.get("loc", ()))
            where = loc[0] if loc else "body"
            rest = loc[1:] if where in ("body", "query", "path", "header", "cookie") else loc
            if err.get("type") == "json_invalid":  # FastAPI's loc is the byte offset: say line and column
                details.append({"param": "", "in": "body", "message": _json_position(err, exc.body)})
                continue
            details.append({"param": pointer(rest), "in": where, "message": str(err.get("msg", "invalid"))})
        n = len(details)
        msg = f"{n} problem{'s' if n != 1 else ''} in the request: " + "; ".join(
            f"{d['in']} {d['param'] or '(root)'}: {d['message']}" for d in details
        )
        return _json(422, envelope("validation_error", msg, details[0]["param"] if details else None, details))

    async def http_error(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        status, detail = exc.status_code, str(exc.detail)
        if status in (404, 405):
            # A path the API serves with other methods is 405 + `Allow`, also where the frontend's static
            # mount at `/` took the request (it answers 404 to a GET of e.g. /v1/jobs/{id}/cancel).
            allow = allow_header(req)
            if allow and req.method not in allow["Allow"].split(", "):
                status, code, detail = 405, _STATUS_CODES[405], "Method Not Allowed"
                headers = {**(headers or {}), **allow}
        return _json(status, envelope(code, detail), headers)

    async def illegal(_req: Request, exc: IllegalTransition) -> JSONResponse:
        body = envelope("illegal_transition", str(exc), None,
                        [{"param": None, "message": f"the job is {exc.current}", "current_state": exc.current}])
        return _json(409, body)

    async def spec_invalid(_req: Request, exc: SpecInvalidError) -> JSONResponse:
        err = spec_error(exc)
        return _json(422, envelope(err.code, err.message, err.param, err.details))

    async def unexpected(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error: %s", exc)
        return _json(500, envelope("internal_error", "internal server error"))

    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(IllegalTransition, illegal)  # type: ignore[arg-type]
    app.add_exception_handler(SpecInvalidError, spec_invalid)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
