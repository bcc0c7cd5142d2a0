"""Job events, metrics and logs: paged reads and Server-Sent Event streams (`.../stream`).

SSE wire format (FastAPI's native `fastapi.sse`): `id: <seq>` (per job, strictly increasing),
`event: event|metric|log`, `data: <the row as JSON>`; `: keep-alive` comments when idle; a final
`event: end` with `{"status": ...}` once the job is terminal and every row was sent, or `event: error`
(`{"code": "live_unavailable", ...}`) when the live source failed. Reconnect with `Last-Event-ID: <seq>`
(or `?after=<seq>`; both 0 .. 2**31-1, else 422) to continue without loss or duplicates.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.sse import EventSourceResponse, ServerSentEvent

from api.deps import ReadDB, Reader, TokenReader, releases_db
from api.job_lookup import load_job
from api.openapi import AUTH, error_responses
from api.records import public_record
from api.responses import json_ok
from api.schemas import EventPage, LogPage, MetricPage
from service.db import repo

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

EVENT_NAMES = {"events": "event", "metrics": "metric", "logs": "log"}


def serialize(kind: str, row: Any) -> dict[str, Any]:
    """A row as the JSON the API returns (same shape in pages and streams)."""
    out: dict[str, Any] = {"seq": row.seq, "time": row.time.isoformat().replace("+00:00", "Z"), "attempt": row.attempt}
    if kind == "events":
        out.update(kind=row.kind, phase=row.phase, message=row.message, data=public_record(row.data or {}))
    elif kind == "metrics":
        out.update(step=row.step, epoch=row.epoch, values=row.values or {})
    else:
        out.update(level=row.level, message=row.message)
    return out


def serialize_raw(kind: str, row: Any) -> tuple[int, str]:
    """(seq, JSON text) of a row: streams serialize each row once, for all their subscribers."""
    return row.seq, json.dumps(serialize(kind, row), separators=(",", ":"))


def _page(rows: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    more = len(rows) > limit
    rows = rows[:limit]
    return {"object": "list", "data": rows, "has_more": more, "next_after": str(rows[-1]["seq"]) if rows else None}


@router.get("/{job_id}/events", response_model=EventPage, operation_id="jobs-events",
            summary="Job events (phases, checkpoints, evals, state changes), ascending by seq",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def list_events(job_id: str, session: ReadDB, principal: Reader,
                after: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> Any:
    load_job(session, principal, job_id)
    rows = repo.read_rows(session, "events", job_id, after=after, limit=limit + 1)
    return json_ok(_page([serialize("events", r) for r in rows], limit))


@router.get("/{job_id}/logs", response_model=LogPage, operation_id="jobs-logs",
            summary="Job log lines, ascending by seq (or the last `tail` lines)",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def list_logs(job_id: str, session: ReadDB, principal: Reader,
              after: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
              limit: Annotated[int, Query(ge=1, le=5000)] = 500,
              tail: Annotated[int | None, Query(ge=1, le=5000, description="Last N lines instead.")] = None) -> Any:
    job = load_job(session, principal, job_id)
    if tail is not None:
        rows = [serialize("logs", r) for r in repo.tail_logs(session, job_id, tail)]
        return {"object": "list", "data": rows, "has_more": False,
                "next_after": str(rows[-1]["seq"]) if rows else str(job.log_seq)}
    rows = repo.read_rows(session, "logs", job_id, after=after, limit=limit + 1)
    return _page([serialize("logs", r) for r in rows], limit)


def downsample(points: list[dict[str, Any]], max_points: int, key: str | None) -> list[dict[str, Any]]:
    """Thin a step-ordered series to <= max_points, keeping its shape.

    The series is cut into `max_points // 4` equal buckets; each keeps its first, last, min and max
    point of `key` (the first requested key), so spikes and the ends survive. Pure; O(n).
    """
    n = len(points)
    if n <= max_points:
        return points
    buckets = max(1, max_points // 4)
    keep: set[int] = {0, n - 1}
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        keep.update((lo, hi - 1))
        if key is not None:
            vals = [(points[i]["values"].get(key), i) for i in range(lo, hi)]
            vals = [(v, i) for v, i in vals if isinstance(v, int | float)]
            if vals:
                keep.add(min(vals)[1])
                keep.add(max(vals)[1])
    return [points[i] for i in sorted(keep)][: max_points] if len(keep) > max_points else [
        points[i] for i in sorted(keep)]


@router.get("/{job_id}/metrics", response_model=MetricPage, operation_id="jobs-metrics",
            summary="Metric history with key selection, step range and server-side downsampling",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def list_metrics(job_id: str, session: ReadDB, principal: Reader,
                 keys: Annotated[str | None, Query(max_length=2000, description="Comma-separated keys.")] = None,
                 step_from: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                 step_to: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
                 after: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                 limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
                 max_points: Annotated[int | None, Query(ge=4, le=100_000)] = None) -> Any:
    """Points ascending by seq; with `max_points` the range is thinned (first/last + per-bucket min/max)."""
    load_job(session, principal, job_id)
    wanted = [k for k in (keys or "").split(",") if k] or None
    if max_points is not None:
        # Two passes: (seq, value of the shape key) for the whole range, then only the kept rows.
        key = wanted[0] if wanted else "loss"
        outline = repo.metric_outline(session, job_id, key, after=after, limit=limit + 1,
                                      step_from=step_from, step_to=step_to)
        more = len(outline) > limit
        outline = outline[:limit]
        total = len(outline)
        if total > max_points:
            keep = thin_outline(outline, max_points)
            rows = repo.metrics_by_seq(session, job_id, keep)
            pts = [serialize("metrics", r) for r in rows]
            if wanted:
                for p in pts:
                    p["values"] = {k: v for k, v in p["values"].items() if k in wanted}
            return {"object": "list", "data": pts, "has_more": more,
                    "next_after": str(outline[-1][0]) if outline else None,
                    "downsampled": True, "total_points": total}
    rows = repo.read_rows(session, "metrics", job_id, after=after, limit=limit + 1, step_from=step_from,
                          step_to=step_to)
    pts = [serialize("metrics", r) for r in rows]
    if wanted:
        for p in pts:
            p["values"] = {k: v for k, v in p["values"].items() if k in wanted}
    page = _page(pts, limit)
    total = len(page["data"])
    if max_points is not None and total > max_points:
        page["data"] = downsample(page["data"], max_points, wanted[0] if wanted else "loss")
        page["downsampled"] = True
    page["total_points"] = total
    return page


def thin_outline(outline: list[tuple[int, float | None]], max_points: int) -> list[int]:
    """Sequence numbers to keep from `(seq, value)` pairs (ascending): <= max_points of them.

    Rows without the shape key (sparse evaluation records: measured AL, eval loss) are always kept;
    the others are cut into equal buckets keeping each bucket's first, last, min and max, as `downsample`.
    """
    sparse = [s for s, v in outline if v is None]
    dense = [(s, v) for s, v in outline if v is not None]
    budget = max(4, max_points - len(sparse))
    pts = [{"seq": s, "values": {"k": v}} for s, v in dense]
    kept = [p["seq"] for p in downsample(pts, budget, "k")] if dense else []
    return sorted(set(kept) | set(sparse))[: max(max_points, len(sparse))]


def _stream_job(job_id: str, session: ReadDB, principal: TokenReader) -> str:
    """The stream's job, checked; the session is released on every path (a stream may stay open for hours,
    and a 404 for a missing or foreign job must not keep the connection either)."""
    try:
        load_job(session, principal, job_id)
    finally:
        session.close()
    return job_id


MAX_SEQ = 2**31 - 1


def _cursor(last_event_id: Annotated[str, Header(max_length=32, json_schema_extra={
                # what the check below takes, stated in the document: a sequence number 0 .. 2**31-1 (MAX_SEQ),
                # leading zeros allowed, or empty (tests/api/test_schema_agreement.py holds them equal)
                "pattern": r"^0*([0-9]{0,9}|1[0-9]{9}|20[0-9]{8}|21[0-3][0-9]{7}|214[0-6][0-9]{6}|2147[0-3][0-9]{5}"
                           r"|21474[0-7][0-9]{4}|214748[0-2][0-9]{3}|2147483[0-5][0-9]{2}|21474836[0-3][0-9]"
                           r"|214748364[0-7])$",
                "description": "Resume after this seq (the `id` of the last event received), 0 .. 2147483647."})] = "",
            after: Annotated[int | None, Query(ge=0, le=MAX_SEQ, description="Start after this seq.")] = None,
            ) -> int:
    """The seq to resume after: `Last-Event-ID` (bounded like `?after=`, else 422), else `?after=`, else 0.

    The header is text, never null: `null` is refused like any other non-number."""
    value = last_event_id.strip()
    if not value:
        return after or 0
    if not (value.isascii() and value.isdigit()) or int(value) > MAX_SEQ:
        raise RequestValidationError([{
            "type": "last_event_id", "loc": ("header", "last-event-id"), "input": last_event_id,
            "msg": f"must be a sequence number from 0 to {MAX_SEQ} (the `id` of an event of this stream)"}])
    return int(value)


def _stream_route(kind: str) -> None:
    async def stream(
        request: Request,
        job_id: Annotated[str, Depends(_stream_job)],
        cursor: Annotated[int, Depends(_cursor)],
    ) -> AsyncIterable[ServerSentEvent]:
        hub = request.app.state.peagle.hub
        keepalive = request.app.state.peagle.keepalive_s
        name = EVENT_NAMES[kind]
        yield ServerSentEvent(comment="stream open", retry=2000)
        async for what, item in hub.follow(job_id, kind, cursor, keepalive_s=keepalive):
            if what == "row":
                yield ServerSentEvent(id=str(item[0]), event=name, raw_data=item[1])
            elif what == "ping":
                yield ServerSentEvent(comment="keep-alive")
            elif what == "error":  # the live source failed: end the stream, the client resumes after its last id
                yield ServerSentEvent(event="error", data={"code": "live_unavailable", "message": item})
                return
            else:
                yield ServerSentEvent(event="end", data={"status": item})
                return

    stream.__doc__ = (f"Server-Sent Events of the job's {kind}: `id` = seq, `event: {EVENT_NAMES[kind]}`, "
                      "replay after `Last-Event-ID`, live tail, keep-alive comments, final `event: end`.")
    router.add_api_route(f"/{{job_id}}/{kind}/stream", stream, methods=["GET"],
                         response_class=EventSourceResponse, operation_id=f"jobs-{kind}-stream",
                         summary=f"Stream {kind} (SSE)", responses=error_responses(*AUTH, 404, 422, by_ref=True))


for _k in ("events", "metrics", "logs"):
    _stream_route(_k)
