"""`/v1/jobs`: create (idempotent, dry-run), list (cursor pages, filters), get, cancel/pause/resume/clone."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Body, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.auth import authorize
from api.checkpoint_schemas import Estimate
from api.deps import DB, AppState, ReadDB, Reader, State, Writer, releases_db
from api.errors import ApiError, spec_error
from api.estimate import estimate
from api.history import history
from api.openapi import AUTH, error_responses, header
from api.preflight import Preflight, WorkerCheck, preflight
from api.responses import json_ok, jsonable
from api.schemas import (
    CloneRequest,
    JobCreate,
    JobListParams,
    JobOut,
    JobPage,
    job_public,
)
from peagle.spec import SpecInvalidError, TrainSpec, parse_spec, preset, preset_names
from service.channels import live_channel, wake_payload
from service.db import aio, jobs, repo, states
from service.db.models import Job
from service.queue import train_queue

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
log = logging.getLogger("peagle.api")

RETRY_AFTER_S = 30
_ID = re.compile(r"[A-Za-z0-9_]{1,64}")


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in recursively (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _resolve_spec(body: JobCreate) -> TrainSpec:
    if (body.spec is None) == (body.preset is None):
        raise ApiError(422, "validation_error", "send exactly one of 'spec' or 'preset'", param="/spec",
                       details=[{"param": "/spec", "message": "exactly one of spec or preset is required"}])
    if body.preset is not None:
        if body.preset not in preset_names():
            raise ApiError(422, "validation_error", f"unknown preset {body.preset!r}; known: {preset_names()}",
                           param="/preset", details=[{"param": "/preset", "message": "unknown preset"}])
        base = preset(body.preset).model_dump(mode="json")
        data: dict[str, Any] | None = deep_merge(base, body.overrides) if body.overrides else base
    else:
        if body.overrides:
            raise ApiError(422, "validation_error", "'overrides' only applies to a preset", param="/overrides",
                           details=[{"param": "/overrides", "message": "only with preset"}])
        data = body.spec
    try:
        return parse_spec(data)
    except SpecInvalidError as exc:
        raise spec_error(exc) from None


def _body_hash(body: JobCreate) -> str:
    blob = json.dumps(body.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _quota(state: AppState) -> jobs.Quota:
    return jobs.Quota(max_queued=state.settings.max_queued_jobs, max_concurrent=state.settings.max_concurrent_jobs)


def _quota_error(exc: jobs.QuotaExceeded) -> ApiError:
    return ApiError(429, "quota_exceeded", str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})


def _queue_error(exc: jobs.QueueUnavailable) -> ApiError:
    # A generic reason only: the broker's address and error are in the server log (service.db.jobs).
    return ApiError(503, "queue_unavailable", f"{exc}; retry later", headers={"Retry-After": str(RETRY_AFTER_S)})


def _preflight(state: AppState, session: Session, owner_id: int, spec: TrainSpec, *, queue: str,
               dry_run: bool = False) -> Preflight:
    """`api.preflight`: 422 for what the owner may not name or what cannot run (a dry run only reports the
    latter), the workers of `queue` included; the reports of the owner's datasets."""
    settings = state.settings
    workers = WorkerCheck(queue=queue, mode=settings.worker_check, stale_after_s=settings.lease_seconds)
    checked = preflight(session, owner_id, spec, settings.model_roots, vllm_available=state.vllm_available,
                        hub=state.hub_probe, workers=workers, artifact_root=settings.resolved_artifact_root())
    checked.check(dry_run=dry_run)
    return checked


def submit(state: AppState, session: Session, principal: repo.Principal, spec: TrainSpec, *, name: str | None,
           tags: list[str] | None, queue: str | None, idem: tuple[str, str] | None = None) -> Job:
    """`service.db.jobs.create_job` for the caller, under the owner's quota; 429 or 503 as `ApiError`."""
    try:
        return jobs.create_job(
            session, owner_id=principal.owner_id, spec=spec.model_dump(mode="json"), name=name or spec.name or "",
            tags=tags or list(spec.tags), queue=train_queue(queue or state.settings.worker_queue, spec.resources),
            max_restarts=spec.resources.max_restarts, send=state.producer.send_train, quota=_quota(state),
            idempotency=idem, answer=lambda values: jsonable(job_public(values)))
    except jobs.QuotaExceeded as exc:
        raise _quota_error(exc) from None
    except jobs.QueueUnavailable as exc:
        raise _queue_error(exc) from None


@router.post(
    "", status_code=201, response_model=JobOut | Estimate, operation_id="jobs-create",
    summary="Create a training job (or estimate it with ?dry_run=true)",
    responses={200: {"model": Estimate, "description": "dry-run estimate"},
               201: {"description": "The queued job (or, with a reused `Idempotency-Key`, the first answer again).",
                     "headers": {"Location": header("The job's URL."),
                                 "Idempotent-Replayed": header("`true` when this answer replays the first one "
                                                               "of its `Idempotency-Key`.", required=False)}},
               **error_responses(400, *AUTH, 409, 422, 429, 503,
                                 descriptions={409: "The `Idempotency-Key` was used with a different body.",
                                               503: "The job could not be queued (broker down)."})},
)
@releases_db
def create_job(
    body: JobCreate, state: State, session: DB, principal: Writer,
    dry_run: Annotated[bool, Query(description="Validate and estimate without queuing.")] = False,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Any:
    """Validate the spec (every problem listed at once), then queue the job.

    What cannot run is refused before queueing (`api.preflight`: a dataset that is not `ready` or has no
    usable row, a missing model folder); the dry run answers `valid: false` with the same `problems`.
    Same `Idempotency-Key` + same body replays the first answer; a different body is 409.
    """
    spec = _resolve_spec(body)
    queue = body.queue or state.settings.worker_queue
    checked = _preflight(state, session, principal.owner_id, spec, queue=queue, dry_run=dry_run)
    if dry_run:
        from api.routes.checkpoints import job_dir  # that module imports this one

        running, queued = repo.queue_ahead(session, queue)
        past = history(session, queue, run_dir=lambda job: job_dir(state.settings, job))
        est = estimate(spec, dataset_rows=checked.reports, queue=queue, queue_position=running + queued,
                       queue_running=running, history=past,
                       vllm_available=state.vllm_available)
        return json_ok({"object": "estimate", "valid": not checked.problems, "problems": checked.problems,
                        "spec": spec.model_dump(mode="json"), **est})
    idem = None
    if idempotency_key:
        h = _body_hash(body)
        idem = (idempotency_key, h)
        existing = session.scalar(sa.select(Job).where(Job.owner_id == principal.owner_id,
                                                        Job.idempotency_key == idempotency_key))
        if existing is not None:
            return _replay(existing, h)
    try:
        job = submit(state, session, principal, spec, name=body.name, tags=body.tags, queue=body.queue, idem=idem)
    except IntegrityError:
        session.rollback()
        existing = session.scalar(sa.select(Job).where(Job.owner_id == principal.owner_id,
                                                       Job.idempotency_key == idempotency_key))
        if existing is None or idem is None:
            raise
        return _replay(existing, idem[1])
    # with a key, the first answer IS the stored one (replays are byte-for-byte the same)
    return json_ok(job.idempotency_response or job_public(job), 201, {"Location": f"/v1/jobs/{job.id}"})


def _replay(existing: Job, body_hash: str) -> Any:
    if existing.body_hash != body_hash:
        raise ApiError(409, "idempotency_mismatch", "this Idempotency-Key was used with a different body",
                       param="/", details=[{"param": "/", "message": f"first used for job {existing.id}"}])
    return json_ok(existing.idempotency_response or job_public(existing), 201,
                   {"Idempotent-Replayed": "true", "Location": f"/v1/jobs/{existing.id}"})


def _query_parameters(model: type[BaseModel]) -> list[dict[str, Any]]:
    """OpenAPI `parameters` for a flat model of optional query parameters (as FastAPI writes them)."""
    schema = model.model_json_schema()
    out = []
    for name, prop in schema["properties"].items():
        param: dict[str, Any] = {"name": name, "in": "query", "required": name in schema.get("required", ()),
                                 "schema": prop}
        if "description" in prop:
            param["description"] = prop["description"]
        out.append(param)
    return out


async def list_jobs(request: Request) -> Response:
    """Cursor pages: `has_more` and `next_after` (pass it as `after`)."""
    principal = await authorize(request, "read")
    query_params = request.query_params
    try:
        params = JobListParams.model_validate(
            {k: query_params.getlist(k) if k == "status" else v for k, v in query_params.items()})
    except ValidationError as exc:  # the same 422 envelope as FastAPI's own parameter errors
        raise RequestValidationError([{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
                                     ) from None
    bad = [s for s in params.status or [] if s not in states.ALL_STATES]
    if bad:
        raise ApiError(422, "validation_error", f"unknown status {bad}; known: {list(states.ALL_STATES)}",
                       param="/status", details=[{"param": "/status", "in": "query", "message": "unknown status"}])
    query = repo.JobPageQuery(owner_id=principal.owner_id, after=params.after, limit=params.limit,
                              statuses=tuple(dict.fromkeys(params.status or ())), tag=params.tag,
                              created_after=params.created_after, q=params.q)
    state: AppState = request.app.state.peagle
    if state.read_pool is not None:  # PostgreSQL: on the event loop (no thread hop, no ORM)
        rows, has_more = await aio.list_jobs(state.read_pool, query)
    else:
        rows, has_more = await run_in_threadpool(_list_sync, state, query)
    data = [job_public(r, full=False) for r in rows]
    return json_ok({"object": "list", "data": data, "has_more": has_more,
                    "next_after": data[-1]["id"] if data else None})


# The API's most frequent request. Its handler takes only the request and does what `Reader` and a
# `Annotated[JobListParams, Query()]` argument would (same auth, same model, same 422 envelope):
# FastAPI's per-request dependency and parameter solving was ~0.1 ms of the ~0.45 ms of server CPU
# per page (bench/bench_api.py). The documented parameters come from the same model
# (tests/api/test_list.py checks them against FastAPI's own rendering).
router.add_api_route("", list_jobs, methods=["GET"], response_model=JobPage, operation_id="jobs-list",
                     summary="List jobs (newest first)",
                     openapi_extra={"parameters": _query_parameters(JobListParams)},
                     responses=error_responses(*AUTH, 422))


def _list_sync(state: AppState, query: repo.JobPageQuery) -> tuple[list[dict[str, Any]], bool]:
    with (state.read_engine or state.engine).connect() as conn:  # autocommit: one round trip
        return repo.list_jobs(conn, query)


def load_job(session: Session, principal: repo.Principal, job_id: str, *, lock: bool = False) -> Job:
    """The caller's job or 404 (also for another owner's job)."""
    job = repo.get_job(session, principal.owner_id, job_id, lock=lock) if _ID.fullmatch(job_id) else None
    if job is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}", param="/job_id")
    return job


@router.get("/{job_id}", response_model=JobOut, operation_id="jobs-get", summary="Get one job",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def get_job(job_id: str, session: ReadDB, principal: Reader) -> Any:
    """Status, phase, progress, attempt, error, best/latest checkpoint, resolved spec, provenance."""
    job = load_job(session, principal, job_id)
    position = repo.queue_position(session, job.queue, job.id) if job.status == states.QUEUED else None
    return json_ok(job_public(job, queue_position=position))


def _act(state: AppState, session: Session, principal: repo.Principal, job_id: str, action: str) -> Any:
    if not _ID.fullmatch(job_id):
        raise ApiError(404, "not_found", f"no job {job_id!r}", param="/job_id")
    try:
        applied = jobs.apply_action(session, owner_id=principal.owner_id, job_id=job_id, action=action,
                                    send=state.producer.send_train, quota=_quota(state))
    except jobs.QuotaExceeded as exc:
        raise _quota_error(exc) from None
    except jobs.QueueUnavailable as exc:
        raise _queue_error(exc) from None
    if applied is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}", param="/job_id")
    if applied.changed:
        publish(state, applied.job)
    return job_public(applied.job)


def publish(state: AppState, job: Job) -> None:
    """Wake live streams of `job` (Redis pub/sub) after a committed change; no-op without Redis."""
    client = state.redis_sync
    if client is None:
        return
    msg = wake_payload(job.id, (job.event_seq, job.metric_seq, job.log_seq), job.status)
    try:
        client.publish(live_channel(job.id), json.dumps(msg))
    except Exception:  # noqa: BLE001 - the DB is the truth; streams still poll
        log.warning("redis publish failed for %s", job.id)


_ACTION_DOC = {
    "cancel": "Cancel: queued/paused -> cancelled at once; running -> cancelling (the worker stops the trainer).",
    "pause": "Pause: running -> pausing (checkpoint, free the GPU, then paused); queued -> paused.",
    "resume": "Resume a paused job (queued again; continues exactly from its last checkpoint).",
}


def _action_route(action: str) -> None:
    @releases_db
    def handler(job_id: str, state: State, session: DB, principal: Writer) -> Any:
        return _act(state, session, principal, job_id, action)

    handler.__doc__ = _ACTION_DOC[action] + " Idempotent; illegal in the current state -> 409."
    router.add_api_route(f"/{{job_id}}/{action}", handler, methods=["POST"], response_model=JobOut,
                         operation_id=f"jobs-{action}", summary=f"{action.capitalize()} a job",
                         responses=error_responses(*AUTH, 404, 409, 422, 429, descriptions={
                             409: "Illegal in the job's current state.", 429: "Resume: the owner's job quota "
                             "is reached."}))


for _a in states.ACTIONS:
    _action_route(_a)


@router.post("/{job_id}/clone", status_code=201, response_model=JobOut, operation_id="jobs-clone",
             summary="Create a new job from this job's spec (optionally with overrides)",
             responses=error_responses(400, *AUTH, 404, 422, 429, 503))
@releases_db
def clone_job(job_id: str, state: State, session: DB, principal: Writer,
              body: Annotated[CloneRequest | None, Body()] = None) -> Any:
    """A fresh job (new id, attempt 0) from the spec of `job_id`, overrides deep-merged."""
    src = load_job(session, principal, job_id)
    body = body or CloneRequest()
    data = deep_merge(src.spec, body.overrides or {})
    try:
        spec = parse_spec(data)
    except SpecInvalidError as exc:
        raise spec_error(exc, prefix=()) from None
    _preflight(state, session, principal.owner_id, spec, queue=src.queue)
    job = submit(state, session, principal, spec, name=body.name or f"{src.name} (clone)"[:200],
                 tags=body.tags, queue=src.queue)
    return job_public(job)
