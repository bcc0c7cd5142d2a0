"""How a spec becomes a queued job, for every route that makes one (create, clone, retrain; resume queues
again): spec resolution, the preflight, and the submission under the owner's quota.

    spec = resolve_spec(body)                                     # JobCreate: spec, or preset + overrides
    spec = parse_merged(deep_merge(parent.spec, overrides))      # clone, retrain: the parent's spec changed
    check_spec(state, session, owner_id, spec, queue=queue)      # 422 for what cannot run (`api.preflight`)
    job = submit(state, session, principal, spec, name=..., tags=..., queue=...)   # 429 / 503

Every refusal is an `ApiError` naming the field (`spec_error`: the spec's problems with their paths), and
429 / 503 carry `Retry-After: RETRY_AFTER_S`.
"""

from __future__ import annotations

import copy
from typing import Any

from sqlalchemy.orm import Session

from api.deps import AppState
from api.errors import ApiError, spec_error
from api.preflight import Preflight, WorkerCheck, preflight
from api.responses import jsonable
from api.schemas import JobCreate, job_public
from peagle.spec import SpecInvalidError, TrainSpec, parse_spec, preset, preset_names
from service.db import jobs, repo
from service.db.models import Job
from service.queue import train_queue

__all__ = ["RETRY_AFTER_S", "check_spec", "deep_merge", "owner_quota", "parse_merged", "queue_error",
           "quota_error", "resolve_spec", "submit"]

#: Seconds a client is told to wait (`Retry-After`) after a full quota or an unreachable queue.
RETRY_AFTER_S = 30


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in recursively (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_spec(body: JobCreate) -> TrainSpec:
    """The spec a create names: exactly one of `spec` or `preset` (with `overrides` deep-merged), else 422;
    its problems are `spec_error`'s 422 (paths under `/spec`)."""
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


def parse_merged(data: dict[str, Any]) -> TrainSpec:
    """A spec built from a job's own (clone, retrain): parsed, its problems a 422 with paths from the spec's
    root (no `/spec` prefix: the body holds no spec)."""
    try:
        return parse_spec(data)
    except SpecInvalidError as exc:
        raise spec_error(exc, prefix=()) from None


def check_spec(state: AppState, session: Session, owner_id: int, spec: TrainSpec, *, queue: str,
               dry_run: bool = False) -> Preflight:
    """`api.preflight`: 422 for what the owner may not name or what cannot run (a dry run only reports the
    latter), the workers of `queue` included; the reports of the owner's datasets."""
    settings = state.settings
    workers = WorkerCheck(queue=queue, mode=settings.worker_check, stale_after_s=settings.lease_seconds)
    checked = preflight(session, owner_id, spec, settings.model_roots, vllm_available=state.vllm_available,
                        hub=state.hub_probe, workers=workers, artifact_root=settings.resolved_artifact_root())
    checked.check(dry_run=dry_run)
    return checked


def owner_quota(state: AppState) -> jobs.Quota:
    """The per-owner job limits (`Settings.max_queued_jobs`, `max_concurrent_jobs`)."""
    return jobs.Quota(max_queued=state.settings.max_queued_jobs, max_concurrent=state.settings.max_concurrent_jobs)


def quota_error(exc: jobs.QuotaExceeded) -> ApiError:
    """429 `quota_exceeded`, with `Retry-After`."""
    return ApiError(429, "quota_exceeded", str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})


def queue_error(exc: jobs.QueueUnavailable) -> ApiError:
    """503 `queue_unavailable`, with `Retry-After`."""
    # A generic reason only: the broker's address and error are in the server log (service.db.jobs).
    return ApiError(503, "queue_unavailable", f"{exc}; retry later", headers={"Retry-After": str(RETRY_AFTER_S)})


def submit(state: AppState, session: Session, principal: repo.Principal, spec: TrainSpec, *, name: str | None,
           tags: list[str] | None, queue: str | None, idem: tuple[str, str] | None = None) -> Job:
    """`service.db.jobs.create_job` for the caller, under the owner's quota; 429 or 503 as `ApiError`."""
    try:
        return jobs.create_job(
            session, owner_id=principal.owner_id, spec=spec.model_dump(mode="json"), name=name or spec.name or "",
            tags=tags or list(spec.tags), queue=train_queue(queue or state.settings.worker_queue, spec.resources),
            max_restarts=spec.resources.max_restarts, send=state.producer.send_train, quota=owner_quota(state),
            idempotency=idem, answer=lambda values: jsonable(job_public(values)))
    except jobs.QuotaExceeded as exc:
        raise quota_error(exc) from None
    except jobs.QueueUnavailable as exc:
        raise queue_error(exc) from None
