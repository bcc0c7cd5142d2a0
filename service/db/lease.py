"""The worker's lease on a job: claim it, heartbeat it, finish it.

Every write of a worker is *fenced*: it is a conditional UPDATE on `(id, lease_owner, attempt)` (`fence`), so a
supervisor whose lease was taken away (the reaper requeued its job, another worker claimed it) changes
nothing and learns so from `LeaseLost`. A claim is `UPDATE job SET status='running' ... WHERE status =
'queued'`: of two workers that receive the same job, exactly one gets the row.

Sequence numbers (`event_seq`, `metric_seq`, `log_seq` on the job row) are reserved by incrementing them in
the same transaction as the inserts (`reserve`), so the API's own events interleave safely.

    lease = claim_job(session, job_id, owner="host:pid:abc", lease_seconds=60)   # None: not claimable
    heartbeat(session, lease, lease_seconds=60)         # -> JobControl(status, desired_state)
    ingest(session, lease, batch)                      # service.db.progress: metrics/events/logs/checkpoints
    finish(session, lease, status="succeeded")
    reap_lapsed(session)                               # service.db.requeue: requeue or fail lapsed leases

No FastAPI here; no torch. Functions take a `Session` and leave commit to the caller (`session_scope`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, aliased

from peagle.errors import PeagleError
from service.db import states
from service.db.events import add_event, event_row, insert_events
from service.db.models import Checkpoint, Dataset, Job, Owner, utcnow
from service.db.replay import final_evaluations, metric_floors

__all__ = [
    "LEASED",
    "QUOTA_WAIT",
    "ConcurrencyLimited",
    "JobControl",
    "Lease",
    "LeaseLost",
    "add_job_event",
    "claim_job",
    "complete_checkpoint_steps",
    "dataset_files",
    "defer_claim",
    "expire_lease",
    "fence",
    "finish",
    "heartbeat",
    "job_owner_id",
    "job_status",
    "reserve",
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


def fence(lease: Lease) -> sa.ColumnElement[bool]:
    """The WHERE clause of every write under `lease`: the job's row, still held by this owner and attempt."""
    return sa.and_(Job.id == lease.job_id, Job.lease_owner == lease.owner, Job.attempt == lease.attempt)


def reserve(session: Session, where: sa.ColumnElement[bool], values: dict[str, Any], *, events: int = 0,
             metrics: int = 0, logs: int = 0) -> tuple[int, int, int] | None:
    """Conditional UPDATE that also reserves sequence numbers; returns the new last (event, metric, log).

    `events`/`metrics`/`logs` rows are reserved: the caller inserts them with seqs `last - n + 1 .. last`.
    None when no row matched `where` (the lease was lost or the job moved on): nothing was written.
    """
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
        .where(fence(lease), Job.status.in_(LEASED))
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
        sa.update(Job).where(fence(lease), Job.status.in_(LEASED)).values(lease_expires_at=now)
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
    current = session.execute(sa.select(Job.status).where(fence(lease))).scalar()
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
    seqs = reserve(session, sa.and_(fence(lease), Job.status == current), values, events=1 if event else 0)
    if seqs is None:
        return False
    if event:
        insert_events(session, [event_row(lease.job_id, seqs[0], attempt=lease.attempt, kind=event[0],
                                          message=event[1], data={"status": status}, time=now)])
    return True
