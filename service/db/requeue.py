"""Moving a job whose attempt died back to the queue, and keeping every queued job's broker message.

The reaper requeues (or fails, past `max_restarts`) jobs whose lease lapsed (`reap_lapsed`); a supervisor
whose trainer crashed does the same at once (`requeue_crashed`). Each move is a conditional UPDATE on the
job's status, attempt and lease owner, so of several reapers exactly one moves a job. A queued job needs a
broker message: `record_task_id` notes the one sent, `unsent_queued_jobs` / `sent_queued_jobs` find the
jobs to send again.

    for act in reap_lapsed(session):                   # -> [ReapAction(job_id, queue, status, ...)]
        ...                                            # send `act.job_id` again when `act.status == "queued"`

No FastAPI here; no torch. Functions take a `Session` and leave commit to the caller (`session_scope`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db import states
from service.db.events import event_row, insert_events
from service.db.lease import LEASED, Lease, expire_lease, reserve
from service.db.models import Job, utcnow

__all__ = [
    "ReapAction",
    "queued_jobs",
    "reap_lapsed",
    "record_task_id",
    "requeue_crashed",
    "requeue_or_fail",
    "sent_queued_jobs",
    "unsent_queued_jobs",
]


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
    seqs = reserve(session, where, {"status": status, **base}, events=1)
    if seqs is None:
        return None
    insert_events(session, [event_row(job.id, seqs[0], attempt=attempt, kind=kind, message=message, time=now,
                                      data={"status": status, "checkpoint_step": ck, "reason": reason})])
    return ReapAction(job_id=job.id, queue=job.queue, status=status, attempt=attempt, message=message)


def requeue_crashed(session: Session, lease: Lease, *, reason: str, code: str,
                    now: datetime | None = None) -> ReapAction | None:
    """The trainer of `lease` died: expire the lease and move the job on at once (`requeue_or_fail`),
    as the reaper would. None when the lease was already lost."""
    if not expire_lease(session, lease, now=now):
        return None
    job = session.get(Job, lease.job_id)
    return requeue_or_fail(session, job, reason=reason, code=code, now=now) if job is not None else None


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
