"""Job writes of the API: `create_job` inserts a queued job, `apply_action` applies a user action.

Both commit, then hand the job to the broker through the `send` callable they are given (the API's
`service.queue.Producer.send_train`), and record a failed send on the row. The queued-jobs quota is
checked under a lock on the owner (`lock_owner`), so concurrent creations and resumes of one owner are
serialised up to their commit and never pass the limit together (PostgreSQL and SQLite).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from peagle.errors import PeagleError
from service.db import repo, states
from service.db.events import event_row, insert_events
from service.db.models import Job, Owner, new_id, utcnow

__all__ = ["QueueUnavailable", "Quota", "QuotaExceeded", "Send", "apply_action", "create_job", "lock_owner"]

log = logging.getLogger("peagle.service")

#: `send(job_id, queue, task_id)` queues `peagle.train(job_id)` on `queue` with that task id.
Send = Callable[[str, str, str], object]
#: What a client reads in the job's `error_message` when the broker could not take it (the cause is logged).
QUEUE_UNAVAILABLE_MESSAGE = "the job could not be queued: the job queue is unavailable"


class QuotaExceeded(PeagleError):
    """The owner already has as many queued or unfinished jobs as allowed (API: 429)."""

    code = "quota_exceeded"


class QueueUnavailable(PeagleError):
    """The broker did not take the job's message (API: 503). The cause is in the log, not the message."""

    code = "queue_unavailable"


@dataclass(frozen=True)
class Quota:
    """Per-owner limits: `max_queued` queued jobs, `max_queued + max_concurrent` unfinished ones."""

    max_queued: int
    max_concurrent: int


@dataclass(frozen=True)
class Applied:
    """What `apply_action` did: the job after it, and its status before (equal for an idempotent repeat)."""

    job: Job
    previous: str

    @property
    def changed(self) -> bool:
        return self.job.status != self.previous


def lock_owner(session: Session, *, owner_id: int) -> None:
    """Hold the owner's write lock until the session commits or rolls back.

    PostgreSQL: `SELECT ... FOR UPDATE` on the owner row (the worker's `claim_job` takes the same lock).
    SQLite: a no-op UPDATE of the owner row, which opens the write transaction (SQLite has one writer at a
    time, and pysqlite starts a transaction only at the first write: the reads that follow then see every
    committed creation and no other creation can commit before this one).
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(sa.select(Owner.id).where(Owner.id == owner_id).with_for_update())
    else:
        session.execute(sa.update(Owner).where(Owner.id == owner_id).values(id=Owner.id))


def _check_quota(session: Session, *, owner_id: int, quota: Quota) -> None:
    limit = quota.max_queued + quota.max_concurrent
    counts = repo.owner_counts(session, owner_id, cap=limit)
    queued = counts.get(states.QUEUED, 0)
    if queued >= quota.max_queued:
        raise QuotaExceeded(f"{queued} jobs already queued (limit {quota.max_queued})")
    unfinished = sum(counts.values())
    if unfinished >= limit:
        raise QuotaExceeded(f"{unfinished} unfinished jobs (limit {limit} = max_concurrent_jobs + max_queued_jobs)")


def create_job(
    session: Session,
    *,
    owner_id: int,
    spec: dict[str, Any],
    name: str,
    tags: list[str],
    queue: str,
    max_restarts: int,
    send: Send,
    quota: Quota | None = None,
    idempotency: tuple[str, str] | None = None,
    answer: Callable[[dict[str, Any]], Any] | None = None,
) -> Job:
    """Insert a queued job and its first event, commit, then send it to `queue`.

    Args:
        spec: the job's `TrainSpec` as JSON (`model_dump(mode="json")`).
        name: at most 200 characters are kept (NUL characters dropped).
        quota: checked under `lock_owner` in the inserting transaction; None checks nothing (test factories).
        idempotency: `(key, body hash)` stored on the row; with it, `answer(values)` is stored as the
            idempotent answer (`values`: every column of the row, by name).

    Returns:
        The job as inserted (transient: no session holds it).

    Raises:
        QuotaExceeded: before anything is written.
        QueueUnavailable: the row was committed, the send failed; the row is now `failed`
            (`queue_unavailable`) and its idempotency key released.
        sqlalchemy.exc.IntegrityError: the idempotency key is taken (a concurrent request with the same key).
    """
    if quota is not None:
        lock_owner(session, owner_id=owner_id)
        _check_quota(session, owner_id=owner_id, quota=quota)
    now = utcnow()
    # Every column is set here (id, seqs, task id), so the row and its first event are two plain INSERTs
    # (Core: no unit-of-work bookkeeping, no UPDATE round trips).
    values: dict[str, Any] = dict(
        id=new_id("job"), owner_id=owner_id, name=name.replace("\x00", "")[:200], tags=tags, spec=spec,
        status=states.QUEUED, phase=None, desired_state=None, progress={}, attempt=0, max_restarts=max_restarts,
        queue=queue, created_at=now, queued_at=now, updated_at=now, started_at=None, finished_at=None,
        error_code=None, error_message=None, error_retryable=None, resolved_spec=None, provenance=None,
        best_checkpoint_step=None, latest_checkpoint_step=None, event_seq=1, metric_seq=0, log_seq=0,
        webhook_seq=0, celery_task_id=str(uuid.uuid4()),  # chosen before sending: one commit, then the broker
        idempotency_key=idempotency[0] if idempotency else None,
        body_hash=idempotency[1] if idempotency else None, idempotency_response=None,
    )
    if idempotency and answer is not None:
        values["idempotency_response"] = answer(values)
    session.execute(sa.insert(Job), [values])
    insert_events(session, [event_row(values["id"], 1, attempt=0, kind="state", message="job queued",
                                      data={"status": states.QUEUED}, time=now)])
    session.commit()
    job = Job(**values)
    try:
        send(job.id, job.queue, values["celery_task_id"])
    except Exception as exc:
        log.exception("queueing %s on %r failed", job.id, job.queue)
        finished = utcnow()
        # The key is released (not bound to a job that never got queued): a retry with it creates and
        # queues the job once the broker is back.
        failed = {"status": states.FAILED, "error_code": QueueUnavailable.code,
                  "error_message": QUEUE_UNAVAILABLE_MESSAGE, "finished_at": finished, "updated_at": finished,
                  "idempotency_response": None, "idempotency_key": None, "body_hash": None}
        session.execute(sa.update(Job).where(Job.id == job.id).values(**failed))
        session.commit()
        for k, v in failed.items():
            setattr(job, k, v)
        raise QueueUnavailable(QUEUE_UNAVAILABLE_MESSAGE) from exc
    return job


def apply_action(
    session: Session, *, owner_id: int, job_id: str, action: str, send: Send, quota: Quota | None = None
) -> Applied | None:
    """Apply user `action` (`cancel`, `pause`, `resume`) to the owner's job; commit; a resumed job is sent.

    The job row is locked (and, for `resume` with a `quota`, the owner first, in the order the worker's
    `claim_job` takes them). An idempotent repeat changes nothing. A resume whose send fails is put back
    to its previous state (unless something moved it meanwhile) and raises `QueueUnavailable`.

    Returns:
        The job after the action (still attached to `session`) and its status before, or None when the
        owner has no such job.

    Raises:
        IllegalTransition: the action is not allowed in the job's state.
        QuotaExceeded: a resume over the owner's quota (nothing written).
        QueueUnavailable: a resume the broker did not take.
    """
    if action == "resume" and quota is not None:
        lock_owner(session, owner_id=owner_id)
    job = repo.get_job(session, owner_id, job_id, lock=True)
    if job is None:
        session.rollback()
        return None
    current = job.status
    target = states.action_target(action, current)
    if target == current:
        session.commit()
        return Applied(job, current)
    if target == states.QUEUED and quota is not None:
        _check_quota(session, owner_id=owner_id, quota=quota)
    now = utcnow()
    job.status = target
    job.updated_at = now
    if target in (states.PAUSING, states.CANCELLING):
        job.desired_state = states.PAUSED if target == states.PAUSING else states.CANCELLED
    elif target == states.QUEUED:
        job.desired_state, job.queued_at = None, now
    else:
        job.desired_state = None
    if target in states.TERMINAL:
        job.finished_at = now
    task_id = str(uuid.uuid4())  # a resume's message: chosen before sending (one commit, then the broker)
    if target == states.QUEUED:
        job.celery_task_id = task_id
    repo.add_job_event(session, job, "state", f"{action} requested: {current} -> {target}",
                       data={"status": target, "previous": current, "action": action})
    session.commit()
    if target == states.QUEUED:
        try:
            send(job.id, job.queue, task_id)
        except Exception as exc:
            log.exception("queueing %s on %r failed", job.id, job.queue)
            _undo_resume(session, job=job, previous=current, task_id=task_id)
            raise QueueUnavailable(QUEUE_UNAVAILABLE_MESSAGE) from exc
    return Applied(job, current)


def _undo_resume(session: Session, *, job: Job, previous: str, task_id: str) -> None:
    """Put a job whose resume could not be sent back to `previous` (only if still queued by that resume)."""
    job = repo.get_job(session, job.owner_id, job.id, lock=True) or job
    if job.status == states.QUEUED and job.celery_task_id == task_id:
        job.status, job.updated_at = previous, utcnow()
        repo.add_job_event(session, job, "state", f"resume failed: {QUEUE_UNAVAILABLE_MESSAGE}",
                           data={"status": previous, "previous": states.QUEUED, "action": "resume"})
    session.commit()
