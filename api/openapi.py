"""The one builder of the OpenAPI `responses=` of every route: `error_responses(401, 403, 404, 422)`.

Every error answer is the `ErrorEnvelope` (api/errors.py renders them all, FastAPI's own 422 included), so a
route lists only which statuses it can produce; descriptions and headers (`Retry-After` on 429/503,
`WWW-Authenticate` on 401) come from here. tests/api/test_openapi_conformance.py runs schemathesis against
the document: an answer whose status, content type, headers or body the document does not state fails it.
"""

from __future__ import annotations

from typing import Any

from api.schemas import ErrorEnvelope

__all__ = ["AUTH", "ERROR_DESCRIPTIONS", "RETRY_AFTER", "error_responses", "header"]

ERROR_DESCRIPTIONS = {
    400: "Malformed request body (not decodable as JSON, or a malformed multipart body).",
    401: "Missing, invalid, expired or revoked credentials.",
    403: "The API key lacks the scope this operation needs.",
    404: "No such resource (or it belongs to another owner).",
    405: "Method not allowed on this path (`Allow` lists the ones that are).",
    409: "Conflict with the current state of the resource.",
    413: "Payload too large.",
    415: "Unsupported media type.",
    416: "Range not satisfiable.",
    422: "Validation error: every problem is listed in `details` (`param` is a JSON pointer).",
    429: "Quota or rate limit reached: retry after `Retry-After` seconds.",
    503: "A dependency is unavailable: retry after `Retry-After` seconds.",
}

#: An authenticated route's answers when the credentials are missing or lack the scope.
AUTH = (401, 403)


def header(description: str, *, required: bool = True, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """An OpenAPI response header object."""
    return {"description": description, "required": required, "schema": schema or {"type": "string"}}


RETRY_AFTER = {"Retry-After": header("Seconds to wait before retrying.", schema={"type": "integer", "minimum": 0})}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": header("`Bearer` (when no or an unknown API key was sent).", required=False)},
    405: {"Allow": header("The methods this path serves.")},
    429: RETRY_AFTER,
    503: RETRY_AFTER,
}


def error_responses(*codes: int, descriptions: dict[int, str] | None = None, by_ref: bool = False
                    ) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for the error statuses `codes`, each an `ErrorEnvelope` (plus its headers).

    `descriptions` overrides the generic description of a status for this route. `by_ref`: for a route
    whose own media type is not JSON (SSE): FastAPI would file a `model` under that media type, so the
    envelope is named by reference under `application/json` instead (the other routes' `model` entries
    put `ErrorEnvelope` in the components).
    """
    out: dict[int | str, dict[str, Any]] = {}
    for code in dict.fromkeys(codes):
        entry: dict[str, Any] = {"description": (descriptions or {}).get(code, ERROR_DESCRIPTIONS[code])}
        if by_ref:
            entry["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}
        else:
            entry["model"] = ErrorEnvelope
        if code in _HEADERS:
            entry["headers"] = _HEADERS[code]
        out[code] = entry
    return out
