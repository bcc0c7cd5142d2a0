"""SQLAlchemy 2 models of the service (the schema itself is created ONLY by Alembic migrations).

Tables and column names are a cross-area contract (this module and `migrations/versions/`; overview in docs/service.md): the API, the worker's
lease/ingest code (`service/db/lease.py`, `service/db/progress.py`) and the migrations all use them.
Timestamps are timezone-aware UTC (`UTCDateTime` restores the zone on SQLite, which stores naive values).
"""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

__all__ = [
    "ApiKey",
    "AuthSession",
    "Base",
    "Checkpoint",
    "CurrentDraft",
    "Dataset",
    "DraftUpload",
    "Job",
    "JobEvent",
    "JobLog",
    "JobMetric",
    "Owner",
    "PromotionDecision",
    "Retrain",
    "UTCDateTime",
    "WebhookDelivery",
    "WebhookEndpoint",
    "Worker",
    "new_id",
    "utcnow",
]

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def utcnow() -> datetime:
    """Timezone-aware current UTC time."""
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """A sortable id `<prefix>_<26 Crockford base32 chars>` (48-bit ms time + 80 random bits, ULID-like).

    Ids created later sort after earlier ones (to the millisecond), so `ORDER BY id` is creation order
    and an id is a stable pagination cursor.
    """
    value = (int(time.time() * 1000) << 80) | secrets.randbits(80)
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return f"{prefix}_{''.join(reversed(chars))}"


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that always returns aware UTC datetimes (SQLite stores naive ones)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        if value is not None and dialect.name == "sqlite":
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    """Declarative base with explicit constraint names (stable across SQLite and PostgreSQL)."""

    metadata = sa.MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: sa.JSON, list[Any]: sa.JSON}


class Owner(Base):
    """A tenant: every job, dataset and key belongs to one owner."""

    __tablename__ = "owner"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="owner", lazy="raise")


class ApiKey(Base):
    """An API key: `pk_<prefix>_<secret>`; only sha256 of the whole key is stored."""

    __tablename__ = "api_key"

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(sa.String(200), default="")
    prefix: Mapped[str] = mapped_column(sa.String(32), unique=True)
    secret_hash: Mapped[str] = mapped_column(sa.String(64))
    scopes: Mapped[list[Any]] = mapped_column(sa.JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)

    owner: Mapped[Owner] = relationship(back_populates="keys", lazy="joined")


class Job(Base):
    """A training job. Status transitions live in `service.db.states`; sequences in `*_seq` are last-used."""

    __tablename__ = "job"
    __table_args__ = (
        sa.UniqueConstraint("owner_id", "idempotency_key", name="uq_job_owner_id_idempotency_key"),
        sa.Index("ix_job_owner_id_id", "owner_id", "id"),
        sa.Index("ix_job_owner_id_status", "owner_id", "status"),
        sa.Index("ix_job_status_queue", "status", "queue"),
    )

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True, default=lambda: new_id("job"))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(sa.String(200), default="")
    tags: Mapped[list[Any]] = mapped_column(sa.JSON, default=list)
    spec: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    resolved_spec: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, default=None)
    status: Mapped[str] = mapped_column(sa.String(16), default="queued")
    phase: Mapped[str | None] = mapped_column(sa.String(32), default=None)
    desired_state: Mapped[str | None] = mapped_column(sa.String(16), default=None)
    progress: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)
    attempt: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    max_restarts: Mapped[int] = mapped_column(sa.Integer, default=2, server_default="2")
    queue: Mapped[str] = mapped_column(sa.String(64), default="cpu")
    celery_task_id: Mapped[str | None] = mapped_column(sa.String(64), default=None)
    lease_owner: Mapped[str | None] = mapped_column(sa.String(200), default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    error_code: Mapped[str | None] = mapped_column(sa.String(64), default=None)
    error_message: Mapped[str | None] = mapped_column(sa.Text, default=None)
    error_retryable: Mapped[bool | None] = mapped_column(sa.Boolean, default=None)
    idempotency_key: Mapped[str | None] = mapped_column(sa.String(200), default=None)
    body_hash: Mapped[str | None] = mapped_column(sa.String(64), default=None)
    idempotency_response: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, default=None)
    artifact_dir: Mapped[str | None] = mapped_column(sa.String(1024), default=None)
    provenance: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, default=None)
    best_checkpoint_step: Mapped[int | None] = mapped_column(sa.Integer, default=None)
    latest_checkpoint_step: Mapped[int | None] = mapped_column(sa.Integer, default=None)
    event_seq: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    metric_seq: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    log_seq: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    webhook_seq: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")  # events fanned out
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    queued_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class JobEvent(Base):
    """One event of a job (phase change, checkpoint, eval, warning, error, API actions)."""

    __tablename__ = "job_event"
    __table_args__ = (sa.UniqueConstraint("job_id", "seq", name="uq_job_event_job_id_seq"),)

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(sa.ForeignKey("job.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(sa.Integer)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    attempt: Mapped[int] = mapped_column(sa.Integer, default=0)
    kind: Mapped[str] = mapped_column(sa.String(32))
    phase: Mapped[str | None] = mapped_column(sa.String(32), default=None)
    message: Mapped[str] = mapped_column(sa.Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)


class JobMetric(Base):
    """One metric record (`values` = {key: float}) at a training step."""

    __tablename__ = "job_metric"
    __table_args__ = (
        sa.UniqueConstraint("job_id", "seq", name="uq_job_metric_job_id_seq"),
        sa.Index("ix_job_metric_job_id_step", "job_id", "step"),
    )

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(sa.ForeignKey("job.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(sa.Integer)
    step: Mapped[int] = mapped_column(sa.Integer)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    attempt: Mapped[int] = mapped_column(sa.Integer, default=0)
    epoch: Mapped[float | None] = mapped_column(sa.Float, default=None)
    values: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)


class JobLog(Base):
    """One log line of a job."""

    __tablename__ = "job_log"
    __table_args__ = (sa.UniqueConstraint("job_id", "seq", name="uq_job_log_job_id_seq"),)

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(sa.ForeignKey("job.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(sa.Integer)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    attempt: Mapped[int] = mapped_column(sa.Integer, default=0)
    level: Mapped[str] = mapped_column(sa.String(16), default="info")
    message: Mapped[str] = mapped_column(sa.Text, default="")


class Checkpoint(Base):
    """A checkpoint directory of a job (`dir` relative to the job's artifact_dir)."""

    __tablename__ = "checkpoint"
    __table_args__ = (sa.UniqueConstraint("job_id", "step", name="uq_checkpoint_job_id_step"),)

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(sa.ForeignKey("job.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(sa.Integer)
    dir: Mapped[str] = mapped_column(sa.String(1024))
    metrics: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)
    files: Mapped[list[Any]] = mapped_column(sa.JSON, default=list)
    complete: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    is_best: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    attempt: Mapped[int] = mapped_column(sa.Integer, default=0)
    #: What the run's evaluation measured on this checkpoint (`peagle.eval.final.evaluation_summary`): engine,
    #: AL per prompt set with its per-request spread, the serving speedup in vLLM with the hardware it ran
    #: on and the recommended K per batch size; None when it was not evaluated (only the best one is).
    evaluation: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True, default=None)


class Dataset(Base):
    """An uploaded dataset file and its validation report."""

    __tablename__ = "dataset"
    __table_args__ = (sa.Index("ix_dataset_owner_id_id", "owner_id", "id"),)

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True, default=lambda: new_id("ds"))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(sa.String(512))
    path: Mapped[str] = mapped_column(sa.String(1024))
    size: Mapped[int] = mapped_column(sa.BigInteger)
    sha256: Mapped[str] = mapped_column(sa.String(64))
    format: Mapped[str] = mapped_column(sa.String(32), default="unknown")
    status: Mapped[str] = mapped_column(sa.String(16), default="validating")
    report: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class DraftUpload(Base):
    """An uploaded draft checkpoint (an archive of a speculators-format export folder) for warm starts
    (`draft.init_from: draft:<id>`): `path` is the unpacked export folder, `report` what the export
    validator said (errors, warnings) and the draft's facts (hidden size, layers, vocabulary, K)."""

    __tablename__ = "draft_upload"
    __table_args__ = (sa.Index("ix_draft_upload_owner_id_id", "owner_id", "id"),)

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True, default=lambda: new_id("drf"))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(sa.String(512))
    path: Mapped[str] = mapped_column(sa.String(1024))
    size: Mapped[int] = mapped_column(sa.BigInteger)
    sha256: Mapped[str] = mapped_column(sa.String(64))
    status: Mapped[str] = mapped_column(sa.String(16), default="validating")
    report: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuthSession(Base):
    """A browser session (`POST /v1/auth/session`): the cookie names it; sign-out sets `revoked_at`."""

    __tablename__ = "auth_session"

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True, default=lambda: new_id("ses"))
    key_id: Mapped[int] = mapped_column(sa.ForeignKey("api_key.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class WebhookEndpoint(Base):
    """An owner's webhook receiver: URL, subscribed event types and the signing secret (`whsec_...`)."""

    __tablename__ = "webhook_endpoint"
    __table_args__ = (sa.Index("ix_webhook_endpoint_owner_id_id", "owner_id", "id"),)

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True, default=lambda: new_id("wh"))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(sa.String(2048))
    description: Mapped[str] = mapped_column(sa.String(500), default="")
    events: Mapped[list[Any]] = mapped_column(sa.JSON, default=list)
    secret: Mapped[str] = mapped_column(sa.String(255))  # encrypted (service/crypto.py); legacy rows plaintext
    start_event_id: Mapped[int] = mapped_column(sa.Integer, default=0)  # job events up to this id predate it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One message to one endpoint (`id` is the Standard Webhooks `webhook-id`), with its retry state."""

    __tablename__ = "webhook_delivery"
    __table_args__ = (
        sa.UniqueConstraint("endpoint_id", "event_id", "event_type", name="uq_webhook_delivery_endpoint_event"),
        sa.Index("ix_webhook_delivery_status_next_attempt_at", "status", "next_attempt_at"),
        sa.Index("ix_webhook_delivery_endpoint_id_id", "endpoint_id", "id"),
    )

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True, default=lambda: new_id("msg"))
    endpoint_id: Mapped[str] = mapped_column(sa.ForeignKey("webhook_endpoint.id", ondelete="CASCADE"))
    event_type: Mapped[str] = mapped_column(sa.String(64))
    event_id: Mapped[int | None] = mapped_column(sa.Integer, default=None)  # job_event.id (None: test message)
    job_id: Mapped[str | None] = mapped_column(sa.String(40), default=None)
    payload: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    status: Mapped[str] = mapped_column(sa.String(16), default="pending")  # pending | succeeded | failed
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(default=None)
    last_attempt_at: Mapped[datetime | None] = mapped_column(default=None)
    last_status_code: Mapped[int | None] = mapped_column(sa.Integer, default=None)
    last_error: Mapped[str | None] = mapped_column(sa.Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Worker(Base):
    """A running worker as it announces itself (`service.db.workers`): the queues it consumes, its GPUs and
    its last heartbeat. The API reads these rows to refuse a job no live worker can take; a worker that
    stops deletes its row, one that dies leaves it to go stale."""

    __tablename__ = "worker"

    name: Mapped[str] = mapped_column(sa.String(255), primary_key=True)  # the Celery node name
    queues: Mapped[list[Any]] = mapped_column(sa.JSON, default=list)
    gpus: Mapped[int] = mapped_column(sa.Integer, default=0)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)


class Retrain(Base):
    """A retrain child (`POST /v1/jobs/{id}/retrain`): its parent and the batch sizes the owner named for its
    promotion; the worker compares and decides at the child's end (`service.db.promotion`)."""

    __tablename__ = "retrain"

    child_job_id: Mapped[str] = mapped_column(sa.ForeignKey("job.id", ondelete="CASCADE"), primary_key=True)
    parent_job_id: Mapped[str] = mapped_column(sa.String(40))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"), index=True)
    target: Mapped[str] = mapped_column(sa.String(512))  # the spec's target.model
    batch_sizes: Mapped[list[Any]] = mapped_column(sa.JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # the decision at the child's end: pending -> running (a worker or the reaper holds the lease) -> decided;
    # a running one whose lease lapsed, or a pending one of a child that succeeded two leases ago, is re-run
    decision_state: Mapped[str] = mapped_column(sa.String(16), default="pending", server_default="pending")
    decision_owner: Mapped[str | None] = mapped_column(sa.String(200), default=None)
    decision_lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    decision_attempts: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")


class CurrentDraft(Base):
    """The owner's current draft for a target (one per owner and target): a job and its checkpoint."""

    __tablename__ = "current_draft"

    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"), primary_key=True)
    target: Mapped[str] = mapped_column(sa.String(512), primary_key=True)
    job_id: Mapped[str] = mapped_column(sa.String(40))
    checkpoint_step: Mapped[int | None] = mapped_column(sa.Integer, default=None)
    decision_id: Mapped[str | None] = mapped_column(sa.String(40), default=None)  # the decision that set it
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class PromotionDecision(Base):
    """One promotion decision (measured, forced or undone) with both sides' numbers; the log of a target."""

    __tablename__ = "promotion_decision"
    __table_args__ = (sa.Index("ix_promotion_decision_owner_id_target_id", "owner_id", "target", "id"),)

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True, default=lambda: new_id("prom"))
    owner_id: Mapped[int] = mapped_column(sa.ForeignKey("owner.id", ondelete="CASCADE"))
    target: Mapped[str] = mapped_column(sa.String(512))
    job_id: Mapped[str] = mapped_column(sa.String(40), index=True)  # the candidate (or, undone, the undone one)
    compared_with: Mapped[str | None] = mapped_column(sa.String(40), default=None)  # the current draft's job
    current_before: Mapped[str | None] = mapped_column(sa.String(40), default=None)
    current_after: Mapped[str | None] = mapped_column(sa.String(40), default=None)
    decision: Mapped[str] = mapped_column(sa.String(16))  # promoted | declined | not_measured | forced | undone
    forced: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    decided_by: Mapped[str] = mapped_column(sa.String(200))  # "measurement" or the owner's name
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    batch_sizes: Mapped[list[Any]] = mapped_column(sa.JSON, default=list)
    numbers: Mapped[dict[str, Any]] = mapped_column(sa.JSON, default=dict)  # {"child": ..., "current": ...}
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class EngineTask(Base):
    """One chunk task of a job split over engine workers (`resources.engine`, issue 37): which chunk
    (`kind`: capture or eval; `index`; the trainer's stream `generation`), its Celery task, the engine
    worker that runs it (`worker`, `gpus`), its lease (`heartbeat_at`, `lease_expires_at`: a lost one is
    sent again), `attempts`, and what it did (`tokens`, `seconds`)."""

    __tablename__ = "engine_task"
    __table_args__ = (sa.UniqueConstraint("job_id", "kind", "index", name="uq_engine_task_job_id_kind_index"),)

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(sa.ForeignKey("job.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(sa.String(16))
    index: Mapped[int] = mapped_column(sa.Integer)
    generation: Mapped[int] = mapped_column(sa.Integer, default=0)
    state: Mapped[str] = mapped_column(sa.String(16), default="sent")  # sent|running|done|failed|stopped
    celery_task_id: Mapped[str | None] = mapped_column(sa.String(64), default=None)
    worker: Mapped[str | None] = mapped_column(sa.String(200), default=None)
    gpus: Mapped[int] = mapped_column(sa.Integer, default=0)
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0)
    tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    seconds: Mapped[float] = mapped_column(sa.Float, default=0.0)
    sent_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(sa.Text, default=None)
