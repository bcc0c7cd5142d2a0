"""Retrain and promotion (docs/retrain.md).

- `POST /v1/jobs/{id}/retrain`: a child job of a succeeded job: the parent's spec, warm-started from its
  best checkpoint (`draft.init_from: job:<parent>`) on new data. At its end the worker measures it beside
  the owner's current draft for the target (else the parent) and decides its promotion (`worker.promotion`).
- `GET /v1/promotion/current`, `GET /v1/promotion/decisions`: the current draft per target and the log.
- `POST /v1/promotion/promote` (forced), `POST /v1/promotion/undo`: the owner's own decisions.

Everything is the caller's own: another owner's job is 404 (`api.job_lookup`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from api.deps import DB, ReadDB, Reader, State, Writer, releases_db
from api.errors import ApiError
from api.job_lookup import load_job
from api.openapi import AUTH, error_responses
from api.schemas import JobOut, SpecSchema, Tag, job_public
from api.submission import check_spec, deep_merge, parse_merged, submit
from peagle.run_folder import job_ref
from peagle.spec import DATASET_PREFIX, DataSource
from service.db import promotion, states
from service.db.init_from import init_source

router = APIRouter(tags=["promotion"])

BatchSize = Annotated[int, Field(ge=1, le=4096)]
#: A target name (the spec's `target.model`); no NUL (PostgreSQL text cannot hold one).
NO_NUL = r"^[^\x00]*$"
TargetQuery = Annotated[str | None, Query(min_length=1, max_length=512, pattern=NO_NUL,
                                          description="The spec's `target.model`.")]


#: `RetrainRequest`'s rule, stated in its schema (`retrain_job` enforces it with its message): new data,
#: at least one uploaded dataset or one source.
_NEW_DATA: dict[str, Any] = {"anyOf": [{"required": ["datasets"], "properties": {"datasets": {"minItems": 1}}},
                                       {"required": ["sources"], "properties": {"sources": {"minItems": 1}}}]}


class RetrainRequest(BaseModel):
    """New data for `POST /v1/jobs/{id}/retrain` (uploaded datasets and/or sources) and optional changes."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_NEW_DATA)

    datasets: list[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_]+$")]] = Field(
        default_factory=list, max_length=64, description="Uploaded dataset ids (`POST /v1/datasets`): each becomes "
        "a `dataset:<id>` source.")
    sources: list[Annotated[dict[str, Any], SpecSchema(DataSource)]] = Field(
        default_factory=list, max_length=64,
        description="Further `data.sources` entries (as in a spec: `path`, `format`, `max_samples`, `skip`).")
    checkpoint_step: int | None = Field(
        default=None, ge=0, le=10**9, description="Warm-start from this checkpoint step of the parent (default: its "
        "best checkpoint).")
    overrides: Annotated[dict[str, Any], SpecSchema(partial=True)] | None = Field(
        default=None, description="Deep-merged into the parent's spec, e.g. `{\"optim\": {\"max_steps\": 200}}`.")
    promotion_batch_sizes: list[BatchSize] = Field(
        default_factory=lambda: [1], min_length=1, max_length=8,
        description="The child becomes the current draft only if it is faster than the current one (and its AL "
        "not lower beyond 2%) at EVERY one of these batch sizes, measured in the same comparison.")
    name: str | None = Field(default=None, max_length=200)
    tags: list[Tag] | None = Field(default=None, max_length=32)


class PromoteRequest(BaseModel):
    """`POST /v1/promotion/promote`: make a succeeded job the current draft of its target, unmeasured."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_]+$")
    checkpoint_step: int | None = Field(default=None, ge=0, le=10**9,
                                        description="Default: the job's best checkpoint. A complete checkpoint "
                                        "of the job still on disk (`GET /v1/jobs/{id}/checkpoints`), else 422.")


class UndoRequest(BaseModel):
    """`POST /v1/promotion/undo`: the current draft of `target` goes back to the one before."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1, max_length=512, pattern=NO_NUL, description="The spec's `target.model`.")


class CurrentDraftOut(BaseModel):
    object: Literal["current_draft"]
    target: str
    job_id: str
    checkpoint_step: int | None
    decision_id: str | None
    updated_at: str | None


class DecisionOut(BaseModel):
    object: Literal["promotion_decision"]
    id: str
    target: str
    job_id: str = Field(description="The job decided about (the candidate; for `undone`, the job undone).")
    compared_with: str | None = Field(description="The current draft's job it was measured against.")
    current_before: str | None
    current_after: str | None
    decision: Literal["promoted", "declined", "not_measured", "forced", "undone"]
    forced: bool
    decided_by: str = Field(description="`measurement`, or the owner who forced or undid it.")
    reason: str
    batch_sizes: list[int]
    numbers: dict[str, Any] = Field(description="Both sides' measured numbers (`child`, `current`; AL per "
                                    "position, served speedup per K and batch size) and the comparison's facts.")
    created_at: str | None


class CurrentList(BaseModel):
    object: Literal["list"]
    data: list[CurrentDraftOut]


class DecisionList(BaseModel):
    object: Literal["list"]
    data: list[DecisionOut]


def _target_of(spec: dict[str, Any]) -> str:
    return str((spec.get("target") or {}).get("model") or "")


@router.post("/v1/jobs/{job_id}/retrain", status_code=201, response_model=JobOut, operation_id="jobs-retrain",
             summary="Retrain: a child job warm-started from this succeeded job on new data",
             responses=error_responses(400, *AUTH, 404, 409, 422, 429, 503, descriptions={
                 409: "The job has not succeeded (only a succeeded job's draft can be retrained)."}))
@releases_db
def retrain_job(job_id: str, body: RetrainRequest, state: State, session: DB, principal: Writer) -> Any:
    """The parent's spec with `draft.init_from: job:<id>` (its best checkpoint, or `checkpoint_step`) and
    `data.sources` = the new data, `overrides` deep-merged. At the child's end it is measured beside the
    current draft of the target in one comparison and promoted only if it beats it at every
    `promotion_batch_sizes` (docs/retrain.md)."""
    parent = load_job(session, principal, job_id)
    if parent.status != states.SUCCEEDED:
        raise ApiError(409, "conflict", f"job {parent.id} is {parent.status}: only a succeeded job can be retrained",
                       param="/job_id")
    sources = [{"path": f"{DATASET_PREFIX}{d}"} for d in body.datasets] + list(body.sources)
    if not sources:
        raise ApiError(422, "validation_error", "name the new data: 'datasets' (uploaded dataset ids) or 'sources'",
                       param="/datasets", details=[{"param": "/datasets", "message": "no new data"}])
    data = deep_merge(parent.spec, body.overrides or {})
    data = deep_merge(data, {"data": {"sources": sources},
                             "draft": {"init_from": job_ref(parent.id, body.checkpoint_step)}})
    spec = parse_merged(data)
    check_spec(state, session, principal.owner_id, spec, queue=parent.queue)
    job = submit(state, session, principal, spec, name=body.name or f"{parent.name} (retrain)"[:200],
                 tags=body.tags, queue=parent.queue)
    promotion.add_retrain(session, child_job_id=job.id, parent_job_id=parent.id, owner_id=principal.owner_id,
                          target=_target_of(parent.spec), batch_sizes=sorted(set(body.promotion_batch_sizes)))
    session.commit()
    return job_public(job)


@router.get("/v1/promotion/current", response_model=CurrentList, operation_id="promotion-current",
            summary="The current draft per target", responses=error_responses(*AUTH, 422))
@releases_db
def current_drafts(session: ReadDB, principal: Reader, target: TargetQuery = None) -> Any:
    """The caller's current draft for each target (or for `target`)."""
    rows = promotion.current_drafts(session, principal.owner_id, target=target)
    return {"object": "list", "data": [promotion.current_out(r) for r in rows]}


@router.get("/v1/promotion/decisions", response_model=DecisionList, operation_id="promotion-decisions",
            summary="Promotion decisions, newest first", responses=error_responses(*AUTH, 422))
@releases_db
def list_decisions(
    session: ReadDB, principal: Reader, target: TargetQuery = None,
    job_id: Annotated[str | None, Query(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_]+$",
                                        description="Decisions about this job or measured against it.")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> Any:
    """Measured, forced and undone decisions with both sides' numbers."""
    rows = promotion.decisions(session, principal.owner_id, target=target, job_id=job_id, limit=limit)
    return {"object": "list", "data": [promotion.decision_out(r) for r in rows]}


@router.post("/v1/promotion/promote", status_code=201, response_model=DecisionOut, operation_id="promotion-promote",
             summary="Force: make a succeeded job the current draft of its target",
             responses=error_responses(400, *AUTH, 404, 409, 422, descriptions={
                 409: "The job has not succeeded.",
                 422: "Invalid body, or the job has no complete checkpoint at that step (or no best one)."}))
@releases_db
def force_promote(body: PromoteRequest, state: State, session: DB, principal: Writer) -> Any:
    """Unmeasured: recorded as `forced`, by the caller (undo with `POST /v1/promotion/undo`). Only a complete
    checkpoint still on disk can be promoted (what a warm start from it would find: `service.db.init_from`)."""
    job = load_job(session, principal, body.job_id)
    if job.status != states.SUCCEEDED:
        raise ApiError(409, "conflict", f"job {job.id} is {job.status}: only a succeeded job can be promoted",
                       param="/job_id")
    step = body.checkpoint_step if body.checkpoint_step is not None else job.best_checkpoint_step
    if step is None:
        raise _no_checkpoint(f"job {job.id} has no best checkpoint: name one of its checkpoints (checkpoint_step)")
    found = init_source(session, principal.owner_id, job_ref(job.id, step),
                        artifact_root=state.settings.resolved_artifact_root())
    if found.export_dir is None:
        raise _no_checkpoint(found.problem or f"job {job.id} has no complete checkpoint at step {step}")
    row = promotion.record_decision(session, owner_id=principal.owner_id, target=_target_of(job.spec), job_id=job.id,
                                    decision="forced", decided_by=principal.owner_name, checkpoint_step=step,
                                    reason=f"forced by {principal.owner_name}")
    return promotion.decision_out(row)


def _no_checkpoint(message: str) -> ApiError:
    return ApiError(422, "validation_error", message, param="/checkpoint_step",
                    details=[{"param": "/checkpoint_step", "message": message}])


@router.post("/v1/promotion/undo", response_model=DecisionOut, operation_id="promotion-undo",
             summary="Undo: the current draft of a target goes back to the one before",
             responses=error_responses(400, *AUTH, 409, 422, descriptions={
                 409: "The target has no current draft to undo."}))
@releases_db
def undo_promotion(body: UndoRequest, session: DB, principal: Writer) -> Any:
    """Recorded as `undone` (its numbers: none); a second undo walks further back."""
    row = promotion.undo(session, owner_id=principal.owner_id, target=body.target, decided_by=principal.owner_name)
    if row is None:
        raise ApiError(409, "conflict", f"no current draft for target {body.target!r}: nothing to undo",
                       param="/target")
    return promotion.decision_out(row)
