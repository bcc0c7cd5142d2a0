"""Request and response models of the `/v1` API (the OpenAPI schema is generated from them)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, field_validator
from pydantic.json_schema import JsonSchemaValue

from api.records import public_record
from peagle.spec import TrainSpec, preset_names
from peagle.spec.init_from import parse_init_from
from peagle.spec.schema import queue_problem
from service.db import states

__all__ = [
    "DatasetOut",
    "DraftOut",
    "DraftPage",
    "ErrorBody",
    "ErrorEnvelope",
    "JobCreate",
    "JobOut",
    "JobParent",
    "JobSummary",
    "Page",
    "SpecSchema",
    "job_parent",
    "job_public",
]


Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:/-]+$")]
#: An RFC 3339 date-time (JSON schema's `format: date-time`); pydantic checks the values (month 13, Feb 30).
_RFC3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})")


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorDetail(BaseModel):
    param: str | None = Field(default=None, description="JSON pointer of the problem.")
    message: str = Field(description="What is wrong.")
    model_config = ConfigDict(extra="allow")


class ErrorBody(BaseModel):
    code: str = Field(description="Stable snake_case error code.")
    message: str = Field(description="Human-readable summary.")
    param: str | None = Field(default=None, description="JSON pointer into the request (first problem).")
    details: list[ErrorDetail] = Field(default_factory=list, description="Every problem (422).")


class ErrorEnvelope(BaseModel):
    """Every error answer."""

    error: ErrorBody


def _enum(schema: dict[str, Any], values: list[Any]) -> None:
    """State in the schema what the handler enforces (the values are checked there, with its own message)."""
    schema["enum"] = values


#: What `WebhookCreate.url` accepts, stated in the schema (the validator below enforces it with messages):
#: http(s), a host, an optional user and port (0-65535), no spaces or control characters.
WEBHOOK_URL_PATTERN = (
    r"^[Hh][Tt][Tt][Pp][Ss]?://([^\x00-\x20\x7f/?#@]*@)?[^\x00-\x20\x7f/?#@:\[\]]+"
    r"(:([0-9]{0,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5]))?"
    r"([/?#][^\x00-\x20\x7f]*)?$"
)


#: `JobCreate`'s rule, stated in its schema (`api.submission.resolve_spec` enforces it with messages):
#: exactly one of `spec` and `preset`, and `overrides` (non-empty) only with a preset.
_SPEC_XOR_PRESET: dict[str, Any] = {"oneOf": [
    {"required": ["spec"], "properties": {"spec": {"type": "object"}, "preset": {"type": "null"}, "overrides": {
        "anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]}}},
    {"required": ["preset"], "properties": {"preset": {"type": "string"}, "spec": {"type": "null"}}},
]}


class SpecSchema:
    """The documented schema of a spec body the handler validates itself (`peagle.spec.parse_spec`, every
    problem at once): `model`'s own (`TrainSpec`, its sections in the components), or with `partial` the
    shape of an `overrides` object, which deep-merges into a spec: every field optional at every level,
    unknown keys refused, and a list whole (it replaces the list it meets).

        spec: Annotated[dict[str, Any], SpecSchema()] | None
    """

    def __init__(self, model: type[BaseModel] = TrainSpec, *, partial: bool = False) -> None:
        self.model, self.partial = model, partial

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        own = handler(self.model.__pydantic_core_schema__)
        return _partial(own, handler, depth=0) if self.partial else own


def _partial(node: JsonSchemaValue, handler: GetJsonSchemaHandler, *, depth: int) -> JsonSchemaValue:
    target = handler.resolve_ref_schema(node) if "$ref" in node else node
    if depth > 8:  # the spec is a few sections deep; nothing recurses
        return node
    if target.get("type") == "object" and "properties" in target:
        return {"type": "object", "additionalProperties": False, **_described(target),
                "properties": {k: _partial(v, handler, depth=depth + 1) for k, v in target["properties"].items()}}
    if "anyOf" in target:  # an optional section (`resources.engine`): either alternative, partial
        return {**_described(target), "anyOf": [_partial(x, handler, depth=depth + 1) for x in target["anyOf"]]}
    return node


def _described(node: JsonSchemaValue) -> JsonSchemaValue:
    return {k: node[k] for k in ("title", "description") if k in node}


class JobCreate(BaseModel):
    """`{"spec": TrainSpec}` or `{"preset": name, "overrides": {...}}` (overrides deep-merge into it)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_SPEC_XOR_PRESET)

    spec: Annotated[dict[str, Any], SpecSchema()] | None = Field(
        default=None, description="A full TrainSpec (schema: GET /v1/spec/schema). Exclusive with preset."
    )
    preset: str | None = Field(default=None, max_length=64, description="Preset name (GET /v1/presets).",
                               json_schema_extra=lambda schema: _enum(schema, [*preset_names(), None]))
    overrides: Annotated[dict[str, Any], SpecSchema(partial=True)] | None = Field(
        default=None, description="Deep-merged into the preset's spec, e.g. {\"optim\": {\"lr\": 0.001}}."
    )
    name: str | None = Field(default=None, max_length=200, description="Job name (default: spec.name).")
    tags: list[Tag] | None = Field(default=None, max_length=32, description="Tags (default: spec.tags).")
    queue: str | None = Field(
        default=None, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$", description="Worker queue (GPU kind); not an "
        "engine queue (`engine-...`) nor one the broker keeps (`celery`, ...)."
    )

    @field_validator("queue")
    @classmethod
    def _job_queue(cls, value: str | None) -> str | None:
        why = queue_problem(value) if value is not None else None
        if why is not None:
            raise ValueError(why)
        return value


class CloneRequest(BaseModel):
    """Optional changes for `POST /v1/jobs/{id}/clone`."""

    model_config = ConfigDict(extra="forbid")

    overrides: Annotated[dict[str, Any], SpecSchema(partial=True)] | None = Field(
        default=None, description="Deep-merged into the cloned spec.")
    name: str | None = Field(default=None, max_length=200)
    tags: list[Tag] | None = Field(default=None, max_length=32)


class JobError(BaseModel):
    code: str | None
    message: str | None
    retryable: bool | None


class CheckpointRef(BaseModel):
    step: int
    url: str


class JobSummary(_Out):
    """A job in a list (no spec)."""

    id: str
    object: Literal["job"] = "job"
    name: str
    tags: list[str]
    status: str
    phase: str | None
    desired_state: str | None
    progress: dict[str, Any]
    attempt: int
    queue: str
    error: JobError | None
    best_checkpoint_step: int | None
    latest_checkpoint_step: int | None
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime


class JobParent(_Out):
    """What a warm-started job (`draft.init_from`) started from: the owner's job (and its checkpoint) or an
    uploaded draft."""

    kind: Literal["job", "draft"] = Field(description="`job`: an earlier job; `draft`: an uploaded draft.")
    id: str = Field(description="The job's or the upload's id.")
    step: int | None = Field(default=None, description="The job's checkpoint step; null: its best checkpoint.")
    url: str = Field(description="`/v1/jobs/<id>` or `/v1/drafts/<id>`.")


def job_parent(spec: Any) -> dict[str, Any] | None:
    """The `JobParent` of a stored job spec (its `draft.init_from`), or None (no warm start)."""
    draft = spec.get("draft") if isinstance(spec, Mapping) else None
    value = draft.get("init_from") if isinstance(draft, Mapping) else None
    if not isinstance(value, str):
        return None
    try:
        ref = parse_init_from(value)
    except ValueError:
        return None
    if ref.kind == "path":
        return None
    base = "/v1/jobs/" if ref.kind == "job" else "/v1/drafts/"
    return {"kind": ref.kind, "id": ref.ref, "step": ref.step, "url": base + ref.ref}


class JobOut(JobSummary):
    """Everything about one job."""

    max_restarts: int
    spec: dict[str, Any]
    resolved_spec: dict[str, Any] | None
    provenance: dict[str, Any] | None
    parent: JobParent | None = Field(default=None, description="The warm start's source (`draft.init_from`); "
                                     "null: the draft started from the target.")
    best_checkpoint: CheckpointRef | None
    latest_checkpoint: CheckpointRef | None
    event_seq: int
    metric_seq: int
    log_seq: int
    queue_position: int | None = Field(default=None, description="While queued: jobs ahead of this one on its "
                                       "queue, those running there now included (0: the next free worker "
                                       "takes it).")


def job_public(job: Any, *, full: bool = True, queue_position: int | None = None) -> dict[str, Any]:
    """The one builder of a job's public shape: `JobOut` (`full`), else `JobSummary` (a list row).

    `job` is a `Job` row or a mapping of its columns (a list row holds `repo.SUMMARY_COLUMNS` only).
    Plain dicts, not models: create/get/list answer through `json_ok` without a second validation pass,
    so tests/api/test_job_shape.py validates every route's answer against `JobOut`/`JobSummary`.
    """
    g: Any = job.__getitem__ if isinstance(job, Mapping) else job.__getattribute__
    job_id = g("id")
    best, latest = g("best_checkpoint_step"), g("latest_checkpoint_step")
    code = g("error_code")
    out: dict[str, Any] = {
        "id": job_id, "object": "job", "name": g("name"), "tags": g("tags") or [], "status": g("status"),
        "phase": g("phase"), "desired_state": g("desired_state"), "progress": g("progress") or {},
        "attempt": g("attempt"), "queue": g("queue"),
        "error": None if code is None else {
            "code": code, "message": g("error_message"), "retryable": g("error_retryable")},
        "best_checkpoint_step": best, "latest_checkpoint_step": latest,
        "created_at": g("created_at"), "queued_at": g("queued_at"), "started_at": g("started_at"),
        "finished_at": g("finished_at"), "updated_at": g("updated_at"),
    }
    if full:
        base = f"/v1/jobs/{job_id}/checkpoints/"
        out.update(
            max_restarts=g("max_restarts"), spec=g("spec"), resolved_spec=g("resolved_spec"),
            provenance=public_record(g("provenance")), parent=job_parent(g("spec")),
            best_checkpoint=None if best is None else {"step": best, "url": f"{base}{best}"},
            latest_checkpoint=None if latest is None else {"step": latest, "url": f"{base}{latest}"},
            event_seq=g("event_seq"), metric_seq=g("metric_seq"), log_seq=g("log_seq"),
            queue_position=queue_position,
        )
    return out


class Page(BaseModel):
    """A cursor page: pass `next_after` as `after` to get the next one."""

    object: Literal["list"] = "list"
    data: list[Any]
    has_more: bool
    next_after: str | None = None


class JobPage(Page):
    data: list[JobSummary]


class JobListParams(BaseModel):
    """Query parameters of `GET /v1/jobs`, validated as one model.

    One model, not six `Query()` arguments: FastAPI inspects each argument's annotation on every request,
    and with six that cost more CPU than the database query (bench/bench_api.py).
    """

    after: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_]*$",
                              description="Cursor: next_after of the previous page.")
    limit: int = Field(default=20, ge=1, le=200)
    status: list[Annotated[str, Field(json_schema_extra={"enum": list(states.ALL_STATES)})]] | None = Field(
        default=None, description="Filter by status (repeatable); an unknown status (also an empty one) is 422.")
    tag: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_.:/-]+$")
    created_after: datetime | None = Field(default=None, description="Jobs created after this RFC 3339 "
                                           "date-time (`2024-05-01T00:00:00Z`: seconds and offset included).")
    q: str | None = Field(default=None, max_length=200, pattern=r"^[^\x00]*$",
                          description="Substring of the job name.")

    @field_validator("created_after", mode="before")
    @classmethod
    def _rfc3339(cls, value: Any) -> Any:
        """Only what `format: date-time` says (RFC 3339), not pydantic's wider reading (`0.5` or `1700000000`
        as Unix times, a bare date, a time without seconds or offset)."""
        if value is None or isinstance(value, datetime):
            return value
        if not isinstance(value, str) or not _RFC3339.fullmatch(value):
            raise ValueError("must be an RFC 3339 date-time such as 2024-05-01T00:00:00Z (seconds and offset)")
        return value


class EventOut(_Out):
    seq: int
    time: datetime
    attempt: int
    kind: str
    phase: str | None
    message: str
    data: dict[str, Any]


class MetricOut(_Out):
    seq: int
    step: int
    time: datetime
    attempt: int
    epoch: float | None
    values: dict[str, Any]


class LogOut(_Out):
    seq: int
    time: datetime
    attempt: int
    level: str
    message: str


class EventPage(Page):
    data: list[EventOut]


class LogPage(Page):
    data: list[LogOut]


class MetricPage(Page):
    data: list[MetricOut]
    downsampled: bool = Field(default=False, description="True when max_points thinned the series.")
    total_points: int = Field(default=0, description="Points in the range before downsampling.")


class DatasetOut(_Out):
    id: str
    object: Literal["dataset"] = "dataset"
    filename: str
    size: int
    sha256: str
    format: str
    status: str
    report: dict[str, Any]
    created_at: datetime
    path_ref: str = Field(description="Use as a data source path in a spec: `dataset:<id>`.")


class DatasetPage(Page):
    data: list[DatasetOut]


class DraftOut(_Out):
    """An uploaded draft checkpoint (`POST /v1/drafts`): the start of warm-started jobs."""

    id: str
    object: Literal["draft"] = "draft"
    filename: str
    size: int = Field(description="Bytes of the uploaded archive.")
    sha256: str = Field(description="sha256 of the uploaded archive.")
    status: str = Field(description="`ready` (the export validator passed it) or `invalid` (see `report.error`).")
    report: dict[str, Any] = Field(description="`ok`, `errors` and `warnings` of the export validator, `error` "
                                   "(why it is invalid), and `facts` of a ready draft: hidden_size, vocab_size, "
                                   "num_layers, aux_layer_ids, draft_vocab_size, mask_token_id.")
    created_at: datetime
    init_from: str = Field(description="Use as `draft.init_from` in a spec: `draft:<id>`.")


class DraftPage(Page):
    data: list[DraftOut]


class MetaOut(BaseModel):
    """What the dashboard needs to know about jobs, from their single sources (states, phases, spec)."""

    object: Literal["meta"] = "meta"
    states: list[str] = Field(description="Every job status, in lifecycle order.")
    terminal_states: list[str] = Field(description="Statuses a job never leaves.")
    actions_by_state: dict[str, list[str]] = Field(
        description="The actions that change a job in each status (`clone` in every status).")
    phases: list[str] = Field(description="Phases of a run, in order.")
    enums: dict[str, list[Any]] = Field(
        description="Allowed values of each enumerated spec field, by JSON pointer (`*` = any array index).")
    suggestions: dict[str, list[str]] = Field(description="Built-in values offered for free-text spec fields.")
    metric_keys: dict[str, str] = Field(description="Named metric keys and key prefixes (`acc_`, `eval_`, ...).")
    funnel_reasons: dict[str, str] = Field(description="Why a conversation is dropped from the data funnel: "
                                           "reason key -> sentence (`peagle.spec.funnel`).")


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: str = Field(min_length=1, max_length=200)


class TokenOut(BaseModel):
    token: str
    expires_at: datetime


class WhoAmI(BaseModel):
    owner: str
    scopes: list[str]


WebhookEventType = Literal["job.status_changed", "job.succeeded", "job.failed", "job.cancelled",
                           "job.checkpoint_saved", "draft.promoted", "draft.promotion_declined",
                           "draft.promotion_undone"]


class WebhookCreate(BaseModel):
    """A webhook endpoint: where to POST which job events (signed, Standard Webhooks headers)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048, json_schema_extra={"format": "uri", "pattern": WEBHOOK_URL_PATTERN},
                     description="http(s) URL that receives the POSTs (a host that resolves to an internal "
                     "address is refused, unless `webhook_allow_hosts` names it).")
    events: list[WebhookEventType] = Field(min_length=1, max_length=8, description="Event types to receive.")
    description: str = Field(default="", max_length=500, pattern=r"^[^\x00]*$")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if any(ord(c) < 33 or ord(c) == 127 for c in v):
            raise ValueError("the URL must not contain spaces or control characters")
        try:
            parts = urlsplit(v)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"not a valid URL: {exc}") from None
        del port
        if parts.scheme not in ("http", "https"):
            raise ValueError("the URL must start with http:// or https://")
        if not parts.hostname:
            raise ValueError("the URL needs a host")
        return v

    @field_validator("events")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))


class WebhookOut(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    events: list[str]
    description: str
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="Signing secret (`whsec_...`), shown only in this answer.")


class WebhookPage(Page):
    data: list[WebhookOut]


class DeliveryOut(BaseModel):
    id: str = Field(description="The message id (`webhook-id` header).")
    object: Literal["webhook_delivery"] = "webhook_delivery"
    endpoint_id: str
    event_type: str
    job_id: str | None
    payload: dict[str, Any]
    status: Literal["pending", "succeeded", "failed"]
    attempts: int
    next_attempt_at: datetime | None
    last_attempt_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime


class DeliveryPage(Page):
    data: list[DeliveryOut]


class Readiness(BaseModel):
    """`GET /readyz`: each dependency's check (200 when all pass, else 503)."""

    status: Literal["ok", "unavailable"]
    checks: dict[str, bool] = Field(description="`database`, `broker` and (when configured) `redis`.")
