"""Request and response models of the `/v1` API (the OpenAPI schema is generated from them)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, GetJsonSchemaHandler, field_validator
from pydantic.json_schema import JsonSchemaValue

from peagle.spec import TrainSpec, preset_names
from peagle.spec.init_from import parse_init_from
from peagle.spec.schema import queue_problem
from service.db import states

__all__ = [
    "CheckpointEvaluation",
    "CheckpointOut",
    "DatasetOut",
    "DraftOut",
    "DraftPage",
    "ErrorBody",
    "ErrorEnvelope",
    "Estimate",
    "JobCreate",
    "JobOut",
    "JobParent",
    "JobSummary",
    "Page",
    "SpecSchema",
    "job_parent",
    "job_public",
    "public_record",
    "worker_label",
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


#: `JobCreate`'s rule, stated in its schema (`_resolve_spec` in api/routes/jobs.py enforces it with messages):
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


def worker_label(name: str | None) -> str | None:
    """A stable label of a worker or host that names no host or pid (operators find the name in the worker
    logs): `w-` and 8 hex digits of its sha256."""
    return None if not name else "w-" + hashlib.sha256(name.encode()).hexdigest()[:8]


#: Keys of stored records (provenance, hardware) that name the machine: its host (shown as `worker_label`),
#: a process id (dropped), the kernel build (dropped; `platform` keeps the OS and architecture only).
_HOST_KEYS = frozenset({"host", "hostname", "node", "nodename", "node_name"})
_PID_KEYS = frozenset({"pid", "ppid", "pgid", "sid", "tid"})
_KERNEL_KEYS = frozenset({"kernel", "kernel_version", "kernel_release", "release", "uname", "os_release"})
#: `platform.machine()` values, as `platform.platform()` writes them among its dash-separated parts.
_MACHINES = ("x86_64", "aarch64", "arm64", "amd64", "i686", "i386", "ppc64le", "s390x", "riscv64")


def _split_platform(platform: str) -> tuple[str, str | None, str]:
    """`platform.platform()` as (OS, architecture or None, kernel release or ""):
    `Linux-5.15.0-1051-aws-x86_64-with-glibc2.35` -> (`Linux`, `x86_64`, `5.15.0-1051-aws`)."""
    parts = platform.split("-")
    at = next((i for i, p in enumerate(parts) if i > 0 and p.lower() in _MACHINES), None)
    release = "-".join(parts[1:at] if at is not None else parts[1:2])
    return parts[0], parts[at] if at is not None else None, release


def _os_of(platform: str) -> str:
    """`platform.platform()` without the kernel build: `Linux x86_64` (the OS, and the architecture)."""
    system, machine, _ = _split_platform(platform)
    return f"{system} {machine}" if machine else system


def public_record(value: Any) -> Any:
    """A stored JSON record (a job's provenance, an event's data) as its owner may read it: host names become
    their `worker_label` (also where the name appears in the record's other strings), process ids and kernel
    strings are dropped, `platform` keeps the OS and architecture. Pure: the input is not changed.

        public_record({"host": "gpu7", "pid": 12, "platform": "Linux-6.8.0-45-generic-x86_64-with-glibc2.39"})
        # -> {"host": "w-<8 hex>", "platform": "Linux x86_64"}
    """
    seen: dict[str, str] = {}  # a machine string found under its key -> what it reads as elsewhere

    def collect(v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                key = str(k).lower()
                if isinstance(x, str) and x:
                    if key in _HOST_KEYS:
                        seen[x] = label = worker_label(x) or ""
                        short = x.split(".")[0]
                        if any(c.isalpha() for c in short):  # an FQDN's short name (not an IP's first number)
                            seen.setdefault(short, label)
                    elif key in _KERNEL_KEYS:
                        seen[x] = "<kernel>"
                    elif key == "platform":
                        seen[x] = _os_of(x)
                        release = _split_platform(x)[2]
                        if "-" in release:  # a kernel build (`6.8.0-45-generic`), never a package's version
                            seen[release] = "<kernel>"
                collect(x)
        elif isinstance(v, list | tuple):
            for x in v:
                collect(x)

    collect(value)
    names = sorted((n for n in seen if len(n) > 2), key=len, reverse=True)  # an FQDN before its short name
    found = re.compile("|".join(rf"(?<![A-Za-z0-9_.-]){re.escape(n)}(?![A-Za-z0-9_-])" for n in names)) if names \
        else None

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                key = str(k).lower()
                if key in _PID_KEYS or key in _KERNEL_KEYS:
                    continue
                if key in _HOST_KEYS and isinstance(x, str):
                    out[k] = worker_label(x)
                elif key == "platform" and isinstance(x, str):
                    out[k] = _os_of(x)
                else:
                    out[k] = clean(x)
            return out
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        if isinstance(v, str) and found is not None:
            return found.sub(lambda m: seen[m.group(0)], v)
        return v

    return clean(value)


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


class FileOut(BaseModel):
    path: str
    size: int
    sha256: str
    url: str


class Spread(BaseModel):
    """Per-request values (one AL per prompt) summarised: the pooled AL hides how unequal they are."""

    min: float
    p25: float
    median: float
    p75: float
    max: float
    mean: float = Field(description="Mean of per-request ALs: NOT the AL (which pools drafts over requests).")


class Hardware(BaseModel):
    """What a speedup was measured on: it only holds there."""

    device: str = Field(description="`cpu` or `cuda`.")
    cpu: str | None = None
    cpu_count: int | None = Field(default=None, description="Logical CPUs the measuring process could use.")
    memory_gb: float | None = None
    gpu: str | None = None
    gpu_count: int | None = None
    load_average: list[float] | None = Field(default=None, description="Load average (1, 5, 15 min) at the "
                                             "start: other work on the machine makes every timing noisier.")
    load_average_end: list[float] | None = None


class SpeedupRow(BaseModel):
    """The verifier alone vs with the draft at one (K, batch size), interleaved rounds."""

    num_speculative_tokens: int
    batch_size: int
    rounds: int
    speedup: float = Field(description="Median over rounds of (tokens/s with the draft) / (tokens/s alone); "
                           "below 1 is a slowdown.")
    speedup_text: str | None = Field(default=None, description="The speedup in words (`0.45x (2.22x slower)`).")
    speedup_per_round: list[float]
    base_tokens_per_s: float = Field(description="Verifier alone, median over rounds.")
    spec_tokens_per_s: float = Field(description="Verifier with the draft, median over rounds.")
    acceptance_length: float | None = Field(description="AL of these same generations (None: no drafts).")
    per_position: list[float] = Field(default_factory=list)
    base_tokens: int | None = None
    spec_tokens: int | None = None
    speedup_cpu_time: float | None = Field(default=None, description="The same ratio by CPU time of the engine "
                                           "processes (steadier than wall time on a shared CPU machine; "
                                           "meaningless on a GPU).")


class Recommendation(BaseModel):
    batch_size: int
    num_speculative_tokens: int = Field(description="The fastest K at this batch size; 0 = serve without the "
                                       "draft (slower than the verifier alone at every K measured).")
    speedup: float = Field(description="Speedup of that K (of the best K measured when 0).")
    best_measured_k: int | None = None


class Serving(BaseModel):
    """Measured serving speedup in vLLM (`peagle.eval.speedup`)."""

    num_speculative_tokens: int = Field(description="The trained K (the headline rows).")
    batch_sizes: list[int] = Field(default_factory=list)
    rounds: int | None = None
    num_prompts: int | None = None
    batch_1: SpeedupRow | None = Field(default=None, description="Trained K, one request at a time (latency).")
    batch_n: SpeedupRow | None = Field(default=None, description="Trained K, a batch of all prompts (throughput).")
    acceptance_length: float | None = Field(default=None, description="AL of the trained K's timed generations.")
    per_position: list[float] = Field(default_factory=list)
    per_request_spread: Spread | None = None
    table: list[SpeedupRow] = Field(default_factory=list, description="Every (K, batch size) measured.")
    recommended: list[Recommendation] = Field(default_factory=list, description="Best K per batch size.")
    recommended_speculative_config: dict[str, Any] | None = None
    engines: str | None = Field(default=None, description="`both` (verifier and draft engines loaded side by "
                                "side) or `alternate` (one at a time).")
    vllm_version: str | None = None
    hardware: Hardware | None = None
    parallel_drafting_ok: bool | None = None
    summary: str | None = Field(default=None, description="One line in words.")


class PromptSetEval(BaseModel):
    acceptance_length: float | None = Field(default=None, description="Pooled: 1 + accepted / drafts (vLLM's "
                                            "definition); None when nothing was drafted.")
    per_position: list[float] = Field(default_factory=list)
    per_request_spread: Spread | None = None
    num_prompts: int | None = None
    num_drafts: int | None = None
    tokens_generated: int | None = None
    engine: str | None = None


class CheckpointEvaluation(BaseModel):
    """What the run's evaluation measured on this checkpoint (the best one)."""

    engine: str | None = Field(default=None, description="`reference` (PyTorch decoder) or `vllm`: who measured "
                               "the AL.")
    num_speculative_tokens: int | None = None
    prompt_sets: dict[str, PromptSetEval] = Field(default_factory=dict, description="AL per prompt set.")
    serving: Serving | None = Field(default=None, description="Measured serving speedup (vLLM runs only).")
    vllm: dict[str, Any] | None = Field(default=None, description="vLLM's own AL of the serve check, when the "
                                        "reference decoder measured the job's AL.")
    hardware: Hardware | None = None
    vllm_version: str | None = None
    parallel_drafting_ok: bool | None = None


class CheckpointOut(BaseModel):
    step: int
    dir: str
    metrics: dict[str, Any]
    tau_sim: float | None
    acceptance_length: float | None
    is_best: bool
    is_latest: bool
    files: list[FileOut]
    created_at: datetime
    archive_url: str
    serve_url: str
    folder: str = Field(description="What the archive unpacks to (`<folder>/config.json`, ...) and "
                        "`peagle jobs download` writes by default; the serve command names it.")
    evaluation: CheckpointEvaluation | None = Field(default=None, description="The evaluation of this checkpoint "
                                                    "(the job's best): AL per prompt set, serving speedup.")


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointOut]


class ServeCommand(BaseModel):
    command: str = Field(description="Short form, run beside the unpacked archive (`./<model_dir>`): the draft's "
                         "config.json names the verifier.")
    long_command: str = Field(description="Explicit verifier (a hub id, never a server path) + --speculative-config.")
    speculative_config: dict[str, Any]
    model_dir: str = Field(description="The folder the archive unpacks to; `peagle jobs download`'s default --out.")
    note: str | None = Field(default=None, description="Set when the verifier is not loadable by name elsewhere "
                             "(`builtin:tiny-llama`, random weights with no hub copy): what to do instead.")
    recommended: list[Recommendation] = Field(default_factory=list, description="Best K per batch size as "
                                              "measured (the long form uses the K of the smallest batch that gains).")
    speedup_note: str | None = Field(default=None, description="The measured speedup in words, slowdowns "
                                     "included, and the hardware it was measured on; None: not measured.")


class Funnel(BaseModel):
    """The data funnel (`peagle.spec.funnel`; the same keys in the dry run, the job's `data` event and the
    dataset report): read -> kept (+ dropped, each under one reason) -> held out -> packed rows -> tokens."""

    read: int = Field(description="Conversations (rows) read from the sources.")
    kept: int = Field(description="Conversations that passed every check.")
    dropped: int = Field(description="read - kept.")
    dropped_by_reason: dict[str, int] = Field(description="Reason -> conversations; sums to `dropped`.")
    held_out: int = Field(description="Kept conversations held out for evaluation (`data.eval_samples`).")
    train_conversations: int
    packed_rows: int | None = Field(description="Training rows after packing (null: not known here).")
    train_tokens: int | None = Field(description="Tokens in the training rows (null: not known here).")
    truncated: int | None = Field(description="Kept conversations cut at `data.max_length` (null: not known).")
    estimated: bool = Field(description="True in the dry run (an estimate), false when counted.")
    prompts_only: int | None = Field(default=None, description="Rows read that end with a user turn and have no "
                                     "answer (request bodies, prompts): kept when `data.regenerate.enabled` is on "
                                     "(the target writes the answer), else among the `no_assistant_turn` drops "
                                     "(null: not known here).")


class Estimate(BaseModel):
    """`?dry_run=true`: what the job would cost, without queuing it."""

    object: Literal["estimate"] = "estimate"
    valid: bool = Field(default=True, description="False when `problems` is not empty: submitting would be a 422.")
    problems: list[ErrorDetail] = Field(default_factory=list, description="What would stop the job before it is "
                                        "queued (a dataset not `ready`, no usable row, a missing model folder).")
    spec: dict[str, Any]
    rows: int = Field(description="Conversations used (estimated when the source size is unknown).")
    tokens: int = Field(description="Training tokens after templating (estimate).")
    optimizer_steps: int
    tokens_per_step: int
    hidden_state_bytes: int = Field(description="Disk the job's target features take at most: the whole dump "
                                    "offline, at most resources.feature_disk_gb online through vLLM, 0 online in "
                                    "the trainer.")
    feature_bytes_per_token: int = Field(description="Bytes of target features per token (aux + final state).")
    offline_dump_bytes: int = Field(description="What an offline dump of every training and held-out token "
                                    "would take (the capture: offline figure).")
    target_engine: Literal["auto", "hf", "vllm"] = Field(
        description="Where the target will run: vllm (an engine beside a draft-only trainer) or hf; auto only "
                    "when the API cannot tell what the workers have.")
    target_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        description="The target's dtype as the job will run it: `auto` is bfloat16 only where the device runs it "
                    "natively (a CUDA GPU, a CPU with avx512_bf16 or amx_bf16), else float32.")
    wall_clock_seconds: float = Field(description="Wall-clock estimate on the requested device (sum of "
                                      "`phase_seconds`).")
    wall_clock_range_seconds: list[float] = Field(description="[low, high]: the range `accuracy` states.")
    first_curve_s: float = Field(description="Seconds from the job's start to its first training metric: the "
                                 "preview's first step (spec `preview`), else the main run's.")
    phase_seconds: dict[str, float] = Field(description="Seconds per phase: preparing_data, preview, regenerating, "
                                            "capturing, training, evaluating, exporting (export + serve check).")
    basis: Literal["history", "model"] = Field(description="history: rates measured by comparable earlier jobs "
                                               "(same target, dtype, engines, hardware class); model: the "
                                               "calibrated model alone.")
    history_jobs: int = Field(description="Earlier jobs the estimate is measured from.")
    accuracy: str = Field(description="How far to trust the estimate, and why.")
    funnel: Funnel
    queue: str
    queue_position: int = Field(description="Jobs ahead on that queue: those its workers run now and those "
                                "queued before (0: the next free worker takes it; `queue_running` of them run).")
    queue_running: int = Field(default=0, description="Of `queue_position`, the jobs running on that queue now.")
    notes: list[str]


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
