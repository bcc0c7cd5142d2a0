"""`/v1/jobs`: create (idempotent, dry-run), list (cursor pages, filters), get, cancel/pause/resume/clone."""

from __future__ import annotations

import hashlib
import json
import logging
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
from api.errors import ApiError
from api.history import history
from api.job_lookup import is_job_id, load_job, no_job
from api.openapi import AUTH, error_responses, header
from api.responses import json_ok
from api.schemas import (
    CloneRequest,
    JobCreate,
    JobListParams,
    JobOut,
    JobPage,
    job_public,
)
from api.submission import (
    check_spec,
    deep_merge,
    owner_quota,
    parse_merged,
    queue_error,
    quota_error,
    resolve_spec,
    submit,
)
from peagle.run_folder import job_dir
from service.channels import live_channel, wake_payload
from service.db import aio, jobs, repo, states
from service.db.models import Job
from service.estimate import estimate

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
log = logging.getLogger("peagle.api")


def _body_hash(body: JobCreate) -> str:
    blob = json.dumps(body.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


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
    spec = resolve_spec(body)
    queue = body.queue or state.settings.worker_queue
    checked = check_spec(state, session, principal.owner_id, spec, queue=queue, dry_run=dry_run)
    if dry_run:
        running, queued = repo.queue_ahead(session, queue)
        root = state.settings.resolved_artifact_root()
        past = history(session, queue, run_dir=lambda job: job_dir(root, job.id, artifact_dir=job.artifact_dir))
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


@router.get("/{job_id}", response_model=JobOut, operation_id="jobs-get", summary="Get one job",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def get_job(job_id: str, session: ReadDB, principal: Reader) -> Any:
    """Status, phase, progress, attempt, error, best/latest checkpoint, resolved spec, provenance."""
    job = load_job(session, principal, job_id)
    position = repo.queue_position(session, job.queue, job.id) if job.status == states.QUEUED else None
    return json_ok(job_public(job, queue_position=position))


def _act(state: AppState, session: Session, principal: repo.Principal, job_id: str, action: str) -> Any:
    if not is_job_id(job_id):
        raise no_job(job_id)
    try:
        applied = jobs.apply_action(session, owner_id=principal.owner_id, job_id=job_id, action=action,
                                    send=state.producer.send_train, quota=owner_quota(state))
    except jobs.QuotaExceeded as exc:
        raise quota_error(exc) from None
    except jobs.QueueUnavailable as exc:
        raise queue_error(exc) from None
    if applied is None:
        raise no_job(job_id)
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
    spec = parse_merged(deep_merge(src.spec, body.overrides or {}))
    check_spec(state, session, principal.owner_id, spec, queue=src.queue)
    job = submit(state, session, principal, spec, name=body.name or f"{src.name} (clone)"[:200],
                 tags=body.tags, queue=src.queue)
    return job_public(job)
