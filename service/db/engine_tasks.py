"""The chunk tasks of a split job (`resources.engine`, issue 37): the dispatcher's and engine workers' writes.

    to_send, failed = plan_sends(s, job_id, kind="capture", pending=[3, 4], generation=2, replicas=2,
                                 lease_seconds=60, max_attempts=3)      # the trainer worker's supervisor
    start_chunk(s, job_id, "capture", 3, generation=2, worker="w1", gpus=0, lease_seconds=60)  # engine worker
    beat_chunk(s, ...)  /  end_chunk(s, ..., state="done", tokens=..., seconds=...)
    task_rows(s, job_id)                                                  # the API's view
    warm_workers(recent_rows(s, since=...), job_id=..., kind="capture", now=..., keep_warm_s=600)  # pure: where
                                                        # the job's next chunk finds its engine warm

A row per (job, kind, index), rewritten for each generation of the trainer's stream. In flight: `sent`
(queued to Celery) or `running` (an engine worker has it; its lease is extended while it works). A
`running` row whose lease lapsed is `lost` and sent again (another engine worker redoes the chunk from
its start; its results are written whole, so a half-written chunk is never read). A `sent` row that no
engine worker claimed within `sent_deadline` seconds (its message was lost) is sent again too: a duplicate
message is harmless, `start_chunk` lets one worker have the chunk. Functions take a
`Session` and leave commit to the caller. Torch-free.

An engine worker records itself as ``<Celery node name>:<pid>`` (`worker.engine_task`), so `node_of` finds the
worker-direct queue (`service.queue.direct_queue`) of the worker that ran a chunk.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db.models import EngineTask, Job, utcnow

__all__ = ["ENGINE_OF_KIND", "IN_FLIGHT", "beat_chunk", "busy_nodes", "end_chunk", "job_control", "job_stopping", "node_of",
           "plan_sends", "recent_rows", "start_chunk", "stop_chunks", "task_rows", "touch_sent", "waiting", "warm_workers"]

IN_FLIGHT = ("sent", "running")
#: Which engine a chunk kind runs on (`peagle.split.protocol.engine_key`): the capture engine also captures the
#: held-out rows (`eval`); regeneration has a generation engine of its own.
ENGINE_OF_KIND = {"capture": "capture", "eval": "capture", "regenerate": "regenerate"}


def _row(s: Session, job_id: str, kind: str, index: int) -> EngineTask | None:
    return s.scalars(sa.select(EngineTask).where(EngineTask.job_id == job_id, EngineTask.kind == kind,
                                                 EngineTask.index == index).with_for_update()).first()


def plan_sends(s: Session, job_id: str, *, kind: str, pending: list[int], generation: int, replicas: int,
               lease_seconds: float, max_attempts: int, sent_deadline: float | None = None,
               now: datetime | None = None) -> tuple[list[int], list[int]]:
    """(chunks to send now, chunks that failed `max_attempts` times) for the `pending` chunks of the
    trainer's current `generation`, keeping at most `replicas` in flight. Rows are written as `sent`; one
    still `sent` (unclaimed) `sent_deadline` seconds after it was sent is sent again (None: never)."""
    now = now or utcnow()
    resend: set[int] = set()
    rows = {r.index: r for r in s.scalars(sa.select(EngineTask).where(
        EngineTask.job_id == job_id, EngineTask.kind == kind).with_for_update())}
    in_flight = 0
    for row in rows.values():
        if row.state == "running" and row.lease_expires_at is not None and row.lease_expires_at < now:
            row.state, row.error = "lost", "its engine worker stopped heartbeating"
        elif row.state in IN_FLIGHT and row.generation == generation:
            in_flight += 1
            if (row.state == "sent" and sent_deadline is not None and row.sent_at is not None
                    and row.sent_at + timedelta(seconds=sent_deadline) < now):
                resend.add(row.index)  # its message was lost: it stays in flight, sent once more
    send, failed = [], []
    for i in pending:
        r = rows.get(i)
        if i in resend and r is not None:
            r.sent_at = now
            send.append(i)
            continue
        if r is not None and r.generation == generation and r.state in IN_FLIGHT:
            continue
        if r is not None and r.generation == generation and r.attempts >= max_attempts:
            failed.append(i)
            continue
        if in_flight >= replicas:
            break
        if r is None:
            r = EngineTask(job_id=job_id, kind=kind, index=i, attempts=0, gpus=0, tokens=0, seconds=0.0)
            s.add(r)
            rows[i] = r
        elif r.generation != generation:
            r.attempts = 0
        r.generation, r.state, r.sent_at, r.worker, r.finished_at = generation, "sent", now, None, None
        in_flight += 1
        send.append(i)
    s.flush()  # the caller's next query sees these rows (sessions do not autoflush)
    return send, failed


def start_chunk(s: Session, job_id: str, kind: str, index: int, *, worker: str, gpus: int, lease_seconds: float,
                now: datetime | None = None) -> int | None:
    """An engine worker takes the chunk: its generation, or None when it must not run it (not sent, done,
    or running on another worker whose lease holds)."""
    now = now or utcnow()
    r = _row(s, job_id, kind, index)
    if r is None or r.state not in ("sent", "lost", "running"):
        return None
    if r.state == "running" and r.worker != worker and r.lease_expires_at is not None and r.lease_expires_at >= now:
        return None
    r.state, r.worker, r.gpus, r.attempts = "running", worker, gpus, r.attempts + 1
    r.started_at = r.heartbeat_at = now
    r.lease_expires_at = now + timedelta(seconds=lease_seconds)
    return int(r.generation)


def beat_chunk(s: Session, job_id: str, kind: str, index: int, *, worker: str, lease_seconds: float,
               now: datetime | None = None) -> bool:
    """Extend the chunk's lease; False when the chunk is no longer this worker's (stopped, given away)."""
    now = now or utcnow()
    r = _row(s, job_id, kind, index)
    if r is None or r.state != "running" or r.worker != worker:
        return False
    r.heartbeat_at, r.lease_expires_at = now, now + timedelta(seconds=lease_seconds)
    return True


def end_chunk(s: Session, job_id: str, kind: str, index: int, *, worker: str, state: str, tokens: int = 0,
              seconds: float = 0.0, error: str | None = None, now: datetime | None = None) -> None:
    """Record the chunk's end by `worker` (`done`, `failed` or `stopped`), unless it was given away."""
    r = _row(s, job_id, kind, index)
    if r is None or r.worker != worker or r.state != "running":
        return
    r.state, r.tokens, r.seconds, r.error, r.finished_at = state, int(tokens), float(seconds), error, now or utcnow()


def stop_chunks(s: Session, job_id: str) -> int:
    """The job ended (or its attempt did): every chunk in flight is `stopped` (engine workers see it)."""
    res = s.execute(sa.update(EngineTask).where(EngineTask.job_id == job_id, EngineTask.state.in_(IN_FLIGHT))
                    .values(state="stopped", finished_at=utcnow()))
    return int(getattr(res, "rowcount", 0) or 0)


def job_control(s: Session, job_id: str, kind: str, index: int, *, worker: str) -> bool:
    """Whether the engine worker may go on with the chunk: the job runs, no pause or cancel is asked and
    the chunk is still this worker's."""
    job = s.get(Job, job_id)
    if job is None or job.status != "running" or job.desired_state is not None:
        return False
    r = s.scalars(sa.select(EngineTask).where(EngineTask.job_id == job_id, EngineTask.kind == kind,
                                              EngineTask.index == index)).first()
    return r is not None and r.state == "running" and r.worker == worker


def job_stopping(s: Session, job_id: str) -> bool:
    """Whether the job was paused, cancelled or failed (or is being): an engine kept warm for it stops."""
    job = s.get(Job, job_id)
    return job is None or job.desired_state is not None or job.status in (
        "pausing", "paused", "cancelling", "cancelled", "failed")


def task_rows(s: Session, job_id: str) -> list[EngineTask]:
    """The job's chunk tasks, in (kind, index) order."""
    return list(s.scalars(sa.select(EngineTask).where(EngineTask.job_id == job_id)
                          .order_by(EngineTask.kind, EngineTask.index)))


def node_of(worker: str) -> str:
    """The Celery node name in an engine worker's `engine_task.worker` (``<node>:<pid>``)."""
    node, sep, pid = worker.rpartition(":")
    return node if sep and pid.isdigit() else worker


def warm_workers(rows: Iterable[Any], *, job_id: str, kind: str, now: datetime, keep_warm_s: float,
                 live: Collection[str] | None = None, busy: Collection[str] = ()) -> list[str]:
    """The engine workers (node names, `node_of`) on which `job_id`'s next chunk of `kind` finds its engine warm
    and nothing else in flight: those whose latest chunk was of `kind` first, then the one idle for the
    shortest time first. Pure over `engine_task` rows of every job (`recent_rows`: each worker's latest chunk
    must be among them).

    A worker qualifies when its latest chunk (by start, whatever the job) is this job's, on the same engine
    (`ENGINE_OF_KIND`: same job, same engine kind, hence the same engine configuration), ended `done` (a
    stopped or failed chunk stops its engine, `worker.engine_task`) at most `keep_warm_s` before `now`
    (the worker's warm engine stops then); and, when given, its node is in `live` (workers whose heartbeat is
    fresh and that consume a worker-direct queue) and not in `busy` (just sent a chunk, not taken yet).

    Example: rows (w1, this job, capture, done 10 s ago), (w2, this job, capture, running), (w3, another
    job, capture, done 5 s ago) and (w4, this job, eval, done 2 s ago), for a capture chunk -> ["w1", "w4"]:
    w2 is busy, w3's engine holds the other job's configuration, w4 ran the held-out rows on the same engine.
    """
    engine = ENGINE_OF_KIND.get(kind, kind)
    latest: dict[str, Any] = {}
    for r in rows:
        if not r.worker or r.started_at is None:
            continue
        cur = latest.get(r.worker)
        if cur is None or r.started_at > cur.started_at:
            latest[r.worker] = r
    since = now - timedelta(seconds=keep_warm_s)
    found: list[tuple[bool, datetime, str]] = []
    for worker, r in latest.items():
        node = node_of(worker)
        if (r.job_id != job_id or ENGINE_OF_KIND.get(r.kind, r.kind) != engine or r.state != "done"
                or r.finished_at is None or r.finished_at < since):
            continue
        if (live is not None and node not in live) or node in busy:
            continue
        found.append((r.kind == kind, r.finished_at, node))
    return [node for *_, node in sorted(found, reverse=True)]


def recent_rows(s: Session, *, since: datetime) -> list[EngineTask]:
    """The chunk rows (every job's) that can be an engine worker's latest: in flight or lost, or started or
    ended after `since` (what `warm_workers` reads; a worker whose latest chunk ended earlier is not warm)."""
    return list(s.scalars(sa.select(EngineTask).where(
        EngineTask.worker.is_not(None),
        sa.or_(EngineTask.state.in_(("running", "lost")), EngineTask.started_at >= since,
               EngineTask.finished_at >= since))))


def busy_nodes(s: Session) -> set[str]:
    """Node names of the engine workers running a chunk (any job's) now."""
    return {node_of(str(w)) for w in s.scalars(sa.select(EngineTask.worker).where(
        EngineTask.state == "running", EngineTask.worker.is_not(None)))}


def waiting(s: Session, job_id: str, kind: str, index: int, *, generation: int) -> bool:
    """Whether the chunk is `sent` for `generation` and no engine worker has taken it yet."""
    r = s.scalars(sa.select(EngineTask).where(EngineTask.job_id == job_id, EngineTask.kind == kind,
                                              EngineTask.index == index)).first()
    return r is not None and r.state == "sent" and r.generation == generation


def touch_sent(s: Session, job_id: str, kind: str, index: int, *, generation: int, now: datetime | None = None) -> bool:
    """A `sent` chunk of `generation` is sent once more (its direct queue's worker died or took other work):
    its `sent_at` restarts the re-send deadline. False when the chunk is no longer waiting to be taken."""
    r = _row(s, job_id, kind, index)
    if r is None or r.state != "sent" or r.generation != generation:
        return False
    r.sent_at = now or utcnow()
    return True
