"""What the worker writes: claim a job with a lease, heartbeat it, ingest progress, finish, reap.

Every write of a worker is *fenced*: it is a conditional UPDATE on `(id, lease_owner, attempt)`, so a
supervisor whose lease was taken away (the reaper requeued its job, another worker claimed it) changes
nothing and learns so from `LeaseLost`. A claim is `UPDATE job SET status='running' ... WHERE status =
'queued'`: of two workers that receive the same job, exactly one gets the row.

Sequence numbers (`event_seq`, `metric_seq`, `log_seq` on the job row) are reserved by incrementing them in
the same transaction as the inserts, so the API's own events interleave safely.

    lease = claim_job(session, job_id, owner="host:pid:abc", lease_seconds=60)   # None: not claimable
    heartbeat(session, lease, lease_seconds=60)         # -> JobControl(status, desired_state)
    ingest(session, lease, batch)                      # metrics/events/logs/checkpoints/progress
    finish(session, lease, status="succeeded")
    reap_lapsed(session)                               # reaper: requeue or fail jobs whose lease lapsed

No FastAPI here; no torch. Functions take a `Session` and leave commit to the caller (`session_scope`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NotRequired, TypedDict

import sqlalchemy as sa
from sqlalchemy.orm import Session, aliased

from peagle.errors import PeagleError
from service.db import states
from service.db.events import add_event, event_row, insert_events
from service.db.models import Checkpoint, Dataset, Job, JobLog, JobMetric, Owner, utcnow
from service.db.replay import final_evaluations, metric_floors, replayed

__all__ = [
    "QUOTA_WAIT",
    "Batch",
    "CheckpointMetrics",
    "CheckpointRecord",
    "ConcurrencyLimited",
    "EventRecord",
    "JobControl",
    "Lease",
    "LeaseLost",
    "LogRecord",
    "MetricRecord",
    "ReapAction",
    "add_job_event",
    "claim_job",
    "dataset_files",
    "defer_claim",
    "expire_lease",
    "finish",
    "heartbeat",
    "ingest",
    "job_status",
    "queued_jobs",
    "reap_lapsed",
    "record_task_id",
    "requeue_crashed",
    "requeue_or_fail",
    "sent_queued_jobs",
    "unsent_queued_jobs",
]

#: Phase of a queued job that a worker left queued because of its owner's `max_concurrent_jobs`.
QUOTA_WAIT = "waiting_for_quota"
#: Statuses in which a worker holds the job's lease.
LEASED = (states.RUNNING, states.PAUSING, states.CANCELLING)


class ConcurrencyLimited(PeagleError):
    """The job's owner already runs `max_concurrent_jobs` jobs: it stays queued (see `defer_claim`)."""

    code = "concurrency_limited"

    def __init__(self, job_id: str, running: int, limit: int) -> None:
        super().__init__(f"job {job_id}: its owner already runs {running} job(s) (max_concurrent_jobs={limit})")
        self.job_id, self.running, self.limit = job_id, running, limit


class LeaseLost(PeagleError):
    """The job's lease is no longer ours (requeued by the reaper, or finished by someone else)."""

    code = "lease_lost"


@dataclass(frozen=True)
class Lease:
    """A claim on a job: `owner` + `attempt` are the fencing token of every later write.

    `metric_floor` / `eval_floor` are the highest training / evaluation metric steps stored before this
    attempt: a resumed trainer replays the steps after its checkpoint, and records with `step <=` the floor
    of their kind are dropped (no duplicates; dedup is on (step, kind), see `service.db.replay`).
    `final_evaluations` are the phases after training whose evaluation the job has stored (a replay of one
    is dropped; one not stored yet is kept whatever the floors say).
    """

    job_id: str
    owner: str
    attempt: int
    metric_floor: int | None
    queue: str
    spec: dict[str, Any]
    max_restarts: int
    latest_checkpoint_step: int | None
    eval_floor: int | None = None
    final_evaluations: frozenset[str] = frozenset()


@dataclass(frozen=True)
class JobControl:
    """What the supervisor learns from a heartbeat: the job's status and the user's desired state."""

    status: str
    desired_state: str | None


class MetricRecord(TypedDict):
    """One metric record of a batch (a `job_metric` row)."""

    step: int
    epoch: float | None
    values: dict[str, float]
    time: datetime
    #: the phase of an evaluation after training (`service.db.replay.FINAL_PHASES`): deduped once per job
    final: NotRequired[str]


class EventRecord(TypedDict):
    """One event of a batch (a `job_event` row)."""

    kind: str
    phase: str | None
    message: str
    data: dict[str, Any]
    time: datetime


class LogRecord(TypedDict):
    """One log line of a batch (a `job_log` row)."""

    level: str
    message: str
    time: datetime


class CheckpointRecord(TypedDict):
    """A checkpoint the trainer saved (upserted by step)."""

    step: int
    dir: str
    files: list[Any]
    metrics: dict[str, float]
    is_best: bool


class CheckpointMetrics(TypedDict):
    """A measurement made after a checkpoint was saved (the final AL of the best one, the serve check)."""

    step: int
    metrics: dict[str, float]
    evaluation: NotRequired[dict[str, Any]]
    #: files written into the checkpoint's folder after it was saved (`{path, size, sha256}`: the parity record)
    files: NotRequired[list[dict[str, Any]]]


@dataclass
class Batch:
    """Progress records to write in one transaction (built by the supervisor from the JSON lines)."""

    metrics: list[MetricRecord] = field(default_factory=list)
    events: list[EventRecord] = field(default_factory=list)
    logs: list[LogRecord] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    missing_checkpoint_steps: list[int] = field(default_factory=list)  # deleted by keep_last
    #: merged into that checkpoint's metrics and evaluation
    checkpoint_metrics: list[CheckpointMetrics] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    phase: str | None = None
    resolved_spec: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None

    def __bool__(self) -> bool:
        return bool(
            self.metrics
            or self.events
            or self.logs
            or self.checkpoints
            or self.missing_checkpoint_steps
            or self.checkpoint_metrics
            or self.progress is not None
            or self.phase is not None
            or self.resolved_spec is not None
            or self.provenance is not None
        )


def _fence(lease: Lease) -> sa.ColumnElement[bool]:
    return sa.and_(Job.id == lease.job_id, Job.lease_owner == lease.owner, Job.attempt == lease.attempt)


def _reserve(session: Session, where: sa.ColumnElement[bool], values: dict[str, Any], *, events: int = 0,
             metrics: int = 0, logs: int = 0) -> tuple[int, int, int] | None:
    """Conditional UPDATE that also reserves sequence numbers; returns the new last (event, metric, log)."""
    stmt = (
        sa.update(Job)
        .where(where)
        .values(
            event_seq=Job.event_seq + events,
            metric_seq=Job.metric_seq + metrics,
            log_seq=Job.log_seq + logs,
            **values,
        )
        .returning(Job.event_seq, Job.metric_seq, Job.log_seq)
        .execution_options(synchronize_session=False)
    )
    row = session.execute(stmt).first()
    return None if row is None else (int(row[0]), int(row[1]), int(row[2]))


def add_job_event(session: Session, job_id: str, *, kind: str, message: str, attempt: int,
                  phase: str | None = None, data: dict[str, Any] | None = None,
                  now: datetime | None = None) -> int:
    """Append one event to a job outside any lease (reaper); returns its seq."""
    now = now or utcnow()
    return add_event(session, job_id, kind=kind, message=message, attempt=attempt, phase=phase, data=data,
                     now=now, job_values={"updated_at": now})


def _running_of_owner() -> sa.ScalarSelect[int]:
    other = aliased(Job)
    return (sa.select(sa.func.count()).select_from(other)
            .where(other.owner_id == Job.owner_id, other.status.in_(LEASED)).scalar_subquery())


def claim_job(session: Session, job_id: str, *, owner: str, lease_seconds: float, artifact_dir: str,
              max_concurrent: int | None = None, now: datetime | None = None) -> Lease | None:
    """Take a queued job: `queued -> running` with a fresh lease. None if it is not claimable.

    A job that is not `queued` (cancelled or paused while queued, already running under a live lease,
    terminal) is never claimed: the second of two workers given the same job gets None.
    With `max_concurrent`, a job whose owner already holds that many leased jobs (running, pausing,
    cancelling) is not claimed either: `ConcurrencyLimited` is raised and the job stays queued. The
    count is taken inside the claiming UPDATE, after locking the owner row on PostgreSQL, so two
    workers claiming two jobs of one owner at once cannot both pass the limit (SQLite serialises writers).
    """
    now = now or utcnow()
    where = sa.and_(Job.id == job_id, Job.status == states.QUEUED)
    if max_concurrent is not None:
        owner_id = session.execute(sa.select(Job.owner_id).where(where)).scalar()
        if owner_id is None:
            return None
        session.execute(sa.select(Owner.id).where(Owner.id == owner_id).with_for_update())
        where = sa.and_(where, _running_of_owner() < max_concurrent)
    stmt = (
        sa.update(Job)
        .where(where)
        .values(
            status=states.RUNNING,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
            heartbeat_at=now,
            started_at=sa.func.coalesce(Job.started_at, now),
            finished_at=None,
            desired_state=None,
            error_code=None,
            error_message=None,
            error_retryable=None,
            artifact_dir=artifact_dir,
            phase=sa.case((Job.phase == QUOTA_WAIT, None), else_=Job.phase),
            updated_at=now,
        )
        .returning(Job.attempt, Job.queue, Job.spec, Job.max_restarts, Job.latest_checkpoint_step)
        .execution_options(synchronize_session=False)
    )
    row = session.execute(stmt).first()
    if row is None:
        if max_concurrent is not None:
            running = session.execute(sa.select(_running_of_owner()).where(Job.id == job_id)).scalar()
            status = session.execute(sa.select(Job.status).where(Job.id == job_id)).scalar()
            if status == states.QUEUED:
                raise ConcurrencyLimited(job_id, int(running or 0), max_concurrent)
        return None
    checkpoint = None if row[4] is None else int(row[4])
    floor, eval_floor = metric_floors(session, job_id, checkpoint)
    return Lease(
        job_id=job_id, owner=owner, attempt=int(row[0]), metric_floor=floor, eval_floor=eval_floor,
        queue=str(row[1]), spec=dict(row[2]), max_restarts=int(row[3]), latest_checkpoint_step=checkpoint,
        final_evaluations=final_evaluations(session, job_id),
    )


def defer_claim(session: Session, job_id: str, *, running: int, limit: int, now: datetime | None = None) -> bool:
    """Leave a quota-limited job queued with no broker message, so the reaper re-sends it on a later
    pass (no busy loop; its place in the queue is kept). The first deferral records an event and sets
    `phase = "waiting_for_quota"`. Returns False if the job is no longer queued."""
    now = now or utcnow()
    first = session.execute(
        sa.update(Job).where(Job.id == job_id, Job.status == states.QUEUED,
                             sa.or_(Job.phase.is_(None), Job.phase != QUOTA_WAIT))
        .values(phase=QUOTA_WAIT, celery_task_id=None, updated_at=now)
        .returning(Job.attempt).execution_options(synchronize_session=False)
    ).first()
    if first is not None:
        add_job_event(session, job_id, kind="waiting", attempt=int(first[0]), phase=QUOTA_WAIT, now=now,
                      message=f"waiting: the owner already runs {running} job(s) (max_concurrent_jobs={limit})",
                      data={"running": running, "max_concurrent_jobs": limit})
        return True
    res = session.execute(
        sa.update(Job).where(Job.id == job_id, Job.status == states.QUEUED)
        .values(celery_task_id=None, updated_at=Job.updated_at).execution_options(synchronize_session=False)
    )
    return bool(getattr(res, "rowcount", 0))


def dataset_files(session: Session, job_id: str, dataset_ids: list[str]) -> dict[str, str]:
    """Local file of each uploaded dataset the job's owner has among `dataset_ids` (`dataset:<id>` sources)."""
    if not dataset_ids:
        return {}
    owner = sa.select(Job.owner_id).where(Job.id == job_id).scalar_subquery()
    rows = session.execute(
        sa.select(Dataset.id, Dataset.path).where(Dataset.id.in_(dataset_ids), Dataset.owner_id == owner)
    ).all()
    return {str(r[0]): str(r[1]) for r in rows}


def heartbeat(session: Session, lease: Lease, *, lease_seconds: float, now: datetime | None = None) -> JobControl:
    """Extend the lease; return the job's status and desired state (cancel/pause requests).

    Raises:
        LeaseLost: the lease is no longer ours.
    """
    now = now or utcnow()
    stmt = (
        sa.update(Job)
        .where(_fence(lease), Job.status.in_(LEASED))
        .values(heartbeat_at=now, lease_expires_at=now + timedelta(seconds=lease_seconds))
        .returning(Job.status, Job.desired_state)
        .execution_options(synchronize_session=False)
    )
    row = session.execute(stmt).first()
    if row is None:
        raise LeaseLost(f"job {lease.job_id}: lease of {lease.owner} (attempt {lease.attempt}) is gone")
    return JobControl(status=str(row[0]), desired_state=row[1])


def expire_lease(session: Session, lease: Lease, *, now: datetime | None = None) -> bool:
    """Mark the lease lapsed now (the trainer crashed): the reaper requeues the job on its next pass."""
    now = now or utcnow()
    res = session.execute(
        sa.update(Job).where(_fence(lease), Job.status.in_(LEASED)).values(lease_expires_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(res, "rowcount", 0))


def job_owner_id(session: Session, job_id: str) -> int | None:
    """The id of the owner (tenant) of a job; None when the job is gone."""
    return session.scalar(sa.select(Job.owner_id).where(Job.id == job_id))


def complete_checkpoint_steps(session: Session, job_id: str) -> set[int]:
    """The steps of the job's checkpoints recorded complete, by every attempt so far (a resumed attempt's
    retention may delete them: the supervisor marks those it no longer finds)."""
    rows = session.execute(sa.select(Checkpoint.step).where(Checkpoint.job_id == job_id,
                                                            Checkpoint.complete.is_(True)))
    return {int(step) for (step,) in rows}


def job_status(session: Session, job_id: str) -> str | None:
    """The job's current status (None: no such job)."""
    return session.execute(sa.select(Job.status).where(Job.id == job_id)).scalar()


def record_task_id(session: Session, job_id: str, task_id: str, *, only_if_unsent: bool = False) -> bool:
    """Record the broker message sent for a queued job (`only_if_unsent`: unless one is recorded already).

    Returns False when the job is no longer queued (or already had a message, with `only_if_unsent`).
    """
    where = sa.and_(Job.id == job_id, Job.status == states.QUEUED)
    if only_if_unsent:
        where = sa.and_(where, Job.celery_task_id.is_(None))
    res = session.execute(sa.update(Job).where(where).values(celery_task_id=task_id)
                          .execution_options(synchronize_session=False))
    return bool(getattr(res, "rowcount", 0))


def requeue_crashed(session: Session, lease: Lease, *, reason: str, code: str,
                    now: datetime | None = None) -> ReapAction | None:
    """The trainer of `lease` died: expire the lease and move the job on at once (`requeue_or_fail`),
    as the reaper would. None when the lease was already lost."""
    if not expire_lease(session, lease, now=now):
        return None
    job = session.get(Job, lease.job_id)
    return requeue_or_fail(session, job, reason=reason, code=code, now=now) if job is not None else None


def ingest(session: Session, lease: Lease, batch: Batch, *, now: datetime | None = None) -> tuple[int, int, int]:
    """Write one batch of progress in one transaction; returns the job's last (event, metric, log) seqs.

    Metrics at or below the floor of their kind (replayed by a resumed attempt) are dropped. Checkpoints are
    upserted by step; the job's `latest_checkpoint_step`/`best_checkpoint_step` follow them.

    Raises:
        LeaseLost: the lease is no longer ours (nothing was written).
    """
    now = now or utcnow()
    metrics = [m for m in batch.metrics
               if not replayed(m, lease.metric_floor, lease.eval_floor, lease.final_evaluations)]
    values: dict[str, Any] = {"updated_at": now}
    if batch.progress is not None:
        values["progress"] = batch.progress
    if batch.phase is not None:
        values["phase"] = batch.phase
    if batch.resolved_spec is not None:
        values["resolved_spec"] = batch.resolved_spec
    if batch.provenance is not None:
        values["provenance"] = batch.provenance
    if batch.checkpoints:
        values["latest_checkpoint_step"] = max(int(c["step"]) for c in batch.checkpoints)
        best = [int(c["step"]) for c in batch.checkpoints if c.get("is_best")]
        if best:
            values["best_checkpoint_step"] = best[-1]
    seqs = _reserve(session, sa.and_(_fence(lease), Job.status.in_(LEASED)), values,
                    events=len(batch.events), metrics=len(metrics), logs=len(batch.logs))
    if seqs is None:
        raise LeaseLost(f"job {lease.job_id}: lease of {lease.owner} (attempt {lease.attempt}) is gone")
    ev_last, me_last, lo_last = seqs
    jid, att = lease.job_id, lease.attempt
    if batch.events:
        first = ev_last - len(batch.events) + 1
        insert_events(session, [
            event_row(jid, first + i, attempt=att, kind=e["kind"], message=e.get("message") or "",
                      phase=e.get("phase"), data=e.get("data"), time=e.get("time") or now)
            for i, e in enumerate(batch.events)
        ])
    if metrics:
        first = me_last - len(metrics) + 1
        session.execute(sa.insert(JobMetric), [
            {"job_id": jid, "seq": first + i, "step": int(m["step"]), "time": m.get("time") or now, "attempt": att,
             "epoch": m.get("epoch"), "values": m["values"]}
            for i, m in enumerate(metrics)
        ])
    if batch.logs:
        first = lo_last - len(batch.logs) + 1
        session.execute(sa.insert(JobLog), [
            {"job_id": jid, "seq": first + i, "time": g.get("time") or now, "attempt": att,
             "level": g.get("level") or "info", "message": g.get("message") or ""}
            for i, g in enumerate(batch.logs)
        ])
    for ck in batch.checkpoints:
        _upsert_checkpoint(session, lease, ck, now)
    for cm in batch.checkpoint_metrics:
        _merge_checkpoint_metrics(session, jid, int(cm["step"]), cm.get("metrics") or {}, cm.get("evaluation"),
                                  cm.get("files"))
    if batch.missing_checkpoint_steps:
        session.execute(
            sa.update(Checkpoint)
            .where(Checkpoint.job_id == jid, Checkpoint.step.in_(batch.missing_checkpoint_steps))
            .values(complete=False)
            .execution_options(synchronize_session=False)
        )
    return seqs


def _merge_checkpoint_metrics(session: Session, job_id: str, step: int, metrics: dict[str, Any],
                              evaluation: dict[str, Any] | None = None,
                              files: list[dict[str, Any]] | None = None) -> None:
    """Add `metrics` to an existing checkpoint's metrics, `evaluation`'s top-level keys to its evaluation and
    `files` to its files (by path; a later measurement or file wins); no row, no-op."""
    current = session.execute(
        sa.select(Checkpoint.metrics, Checkpoint.evaluation, Checkpoint.files)
        .where(Checkpoint.job_id == job_id, Checkpoint.step == step)
    ).first()
    if current is None or not (metrics or evaluation or files):
        return
    values: dict[str, Any] = {"metrics": {**(current[0] or {}), **metrics}}
    if evaluation:
        values["evaluation"] = {**(current[1] or {}), **evaluation}
    if files:
        added = {str(f["path"]): f for f in files}
        values["files"] = [f for f in current[2] or [] if f.get("path") not in added] + list(added.values())
    session.execute(
        sa.update(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
        .values(**values).execution_options(synchronize_session=False)
    )


def _upsert_checkpoint(session: Session, lease: Lease, ck: CheckpointRecord, now: datetime) -> None:
    step = int(ck["step"])
    fields = {"dir": str(ck["dir"]), "metrics": ck.get("metrics") or {}, "files": ck.get("files") or [],
              "complete": True, "is_best": bool(ck.get("is_best")), "attempt": lease.attempt}
    if fields["is_best"]:
        session.execute(
            sa.update(Checkpoint).where(Checkpoint.job_id == lease.job_id, Checkpoint.step != step)
            .values(is_best=False).execution_options(synchronize_session=False)
        )
    res = session.execute(
        sa.update(Checkpoint).where(Checkpoint.job_id == lease.job_id, Checkpoint.step == step)
        .values(**fields).execution_options(synchronize_session=False)
    )
    if not getattr(res, "rowcount", 0):
        session.execute(sa.insert(Checkpoint), [{"job_id": lease.job_id, "step": step, "created_at": now, **fields}])


def finish(session: Session, lease: Lease, *, status: str, error_code: str | None = None,
           error_message: str | None = None, retryable: bool | None = None,
           event: tuple[str, str] | None = None, now: datetime | None = None) -> bool:
    """End this attempt: move the job to `status` (terminal, `paused`, or `queued`) and drop the lease.

    `event` = (kind, message) is appended in the same transaction. Returns False (and writes nothing)
    when the lease was lost or the transition is illegal from the job's current status. `queued` starts
    a new attempt (`attempt + 1`, no broker message: the reaper sends it); it is never refused for
    `max_restarts` (only `requeue_or_fail` checks that), but later crash restarts count on from it.
    """
    now = now or utcnow()
    current = session.execute(sa.select(Job.status).where(_fence(lease))).scalar()
    if current is None or not states.can_transition(current, status):
        return False
    values: dict[str, Any] = {
        "status": status, "lease_owner": None, "lease_expires_at": None, "desired_state": None,
        "updated_at": now, "error_code": error_code, "error_message": error_message,
        "error_retryable": retryable,
    }
    if status in states.TERMINAL:
        values["finished_at"] = now
    if status == states.QUEUED:  # requeued (the worker shut down): a new attempt resumes from the checkpoint
        values["queued_at"] = now
        values["celery_task_id"] = None
        values["attempt"] = Job.attempt + 1
    seqs = _reserve(session, sa.and_(_fence(lease), Job.status == current), values, events=1 if event else 0)
    if seqs is None:
        return False
    if event:
        insert_events(session, [event_row(lease.job_id, seqs[0], attempt=lease.attempt, kind=event[0],
                                          message=event[1], data={"status": status}, time=now)])
    return True


@dataclass(frozen=True)
class ReapAction:
    """What the reaper (or a supervisor after a crash) did with a job whose attempt died."""

    job_id: str
    queue: str
    status: str  # queued (requeued), failed, paused, cancelled
    attempt: int
    message: str


def requeue_or_fail(session: Session, job: Job, *, reason: str, code: str = "worker_lost",
                    now: datetime | None = None) -> ReapAction | None:
    """Move a job whose attempt died to its next state, conditional on its lease being unchanged.

    running -> queued with attempt+1 (resumes from its last complete checkpoint), or failed with `code`
    once `max_restarts` requeues were used; pausing -> paused; cancelling -> cancelled.
    Returns None if someone else changed the job first.
    """
    now = now or utcnow()
    ck = job.latest_checkpoint_step
    where = sa.and_(Job.id == job.id, Job.status == job.status, Job.attempt == job.attempt,
                    (Job.lease_owner == job.lease_owner) if job.lease_owner is not None else Job.lease_owner.is_(None))
    base: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
    if job.status == states.CANCELLING:
        status, attempt, kind = states.CANCELLED, job.attempt, "cancelled"
        message = f"cancelled ({reason})"
        base.update(finished_at=now, desired_state=None)
    elif job.status == states.PAUSING:
        status, attempt, kind = states.PAUSED, job.attempt, "paused"
        where_from = f"checkpoint step {ck}" if ck is not None else "the start (no complete checkpoint)"
        message = f"paused ({reason}); resume continues from {where_from}"
        base.update(desired_state=None)
    elif job.attempt < job.max_restarts:
        status, attempt, kind = states.QUEUED, job.attempt + 1, "resumed"
        where_from = f"checkpoint step {ck}" if ck is not None else "the start (no complete checkpoint yet)"
        message = f"resumed from {where_from} (attempt {attempt}): {reason}"
        base.update(attempt=attempt, queued_at=now, celery_task_id=None, phase=None)
    else:
        status, attempt, kind = states.FAILED, job.attempt, "error"
        message = f"{reason}; gave up after {job.attempt} restart(s) (max_restarts={job.max_restarts})"
        base.update(finished_at=now, error_code=code, error_message=message, error_retryable=True,
                    desired_state=None)
    seqs = _reserve(session, where, {"status": status, **base}, events=1)
    if seqs is None:
        return None
    insert_events(session, [event_row(job.id, seqs[0], attempt=attempt, kind=kind, message=message, time=now,
                                      data={"status": status, "checkpoint_step": ck, "reason": reason})])
    return ReapAction(job_id=job.id, queue=job.queue, status=status, attempt=attempt, message=message)


def reap_lapsed(session: Session, *, now: datetime | None = None, limit: int = 100) -> list[ReapAction]:
    """Requeue (or fail) every job whose lease expired; safe to run from several reapers at once."""
    now = now or utcnow()
    jobs = session.execute(
        sa.select(Job).where(Job.status.in_(LEASED), Job.lease_expires_at < now).order_by(Job.id).limit(limit)
    ).scalars().all()
    actions = []
    for job in jobs:
        lapsed = (now - job.heartbeat_at).total_seconds() if job.heartbeat_at else None
        reason = f"worker lost: no heartbeat for {lapsed:.0f} s" if lapsed is not None else "worker lost"
        act = requeue_or_fail(session, job, reason=reason, now=now)
        if act is not None:
            actions.append(act)
    return actions


def queued_jobs(session: Session, queues: list[str], *, limit: int = 1000) -> list[tuple[str, str]]:
    """(id, queue) of every queued job on `queues`, oldest first."""
    rows = session.execute(
        sa.select(Job.id, Job.queue).where(Job.status == states.QUEUED, Job.queue.in_(queues))
        .order_by(Job.id).limit(limit)
    ).all()
    return [(str(r[0]), str(r[1])) for r in rows]


def unsent_queued_jobs(session: Session, *, older_than: float, now: datetime | None = None,
                       limit: int = 100) -> list[tuple[str, str]]:
    """Queued jobs with no broker message recorded (`celery_task_id` null) for `older_than` seconds."""
    now = now or utcnow()
    rows = session.execute(
        sa.select(Job.id, Job.queue).where(
            Job.status == states.QUEUED, Job.celery_task_id.is_(None),
            Job.queued_at < now - timedelta(seconds=older_than),
        ).order_by(Job.id).limit(limit)
    ).all()
    return [(str(r[0]), str(r[1])) for r in rows]


def sent_queued_jobs(session: Session, *, older_than: float, now: datetime | None = None,
                     limit: int = 1000) -> list[tuple[str, str, str]]:
    """(id, queue, task id) of queued jobs with a broker message recorded, queued for `older_than` seconds:
    the reaper checks that their message is still in the broker (`Producer.waiting_task_ids`)."""
    now = now or utcnow()
    rows = session.execute(
        sa.select(Job.id, Job.queue, Job.celery_task_id).where(
            Job.status == states.QUEUED, Job.celery_task_id.is_not(None),
            Job.queued_at < now - timedelta(seconds=older_than),
        ).order_by(Job.id).limit(limit)
    ).all()
    return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]
