"""What a running job reports, written under its lease: metrics, events, logs, checkpoints, progress.

The supervisor turns the trainer's JSON lines into a `Batch` (`worker.progress`); `ingest` writes one batch
in one fenced transaction (`service.db.lease.fence`), reserving the sequence numbers of its rows in the same
UPDATE (`service.db.lease.reserve`). Records a resumed attempt replays are dropped (`service.db.replay`).

    ingest(session, lease, Batch(metrics=[...], events=[...], checkpoints=[...]))   # -> last (event, metric, log)

No FastAPI here; no torch. Functions take a `Session` and leave commit to the caller (`session_scope`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NotRequired, TypedDict

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db.events import event_row, insert_events
from service.db.lease import LEASED, Lease, LeaseLost, fence, reserve
from service.db.models import Checkpoint, Job, JobLog, JobMetric, utcnow
from service.db.replay import replayed

__all__ = [
    "Batch",
    "CheckpointMetrics",
    "CheckpointRecord",
    "EventRecord",
    "LogRecord",
    "MetricRecord",
    "ingest",
]


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
    seqs = reserve(session, sa.and_(fence(lease), Job.status.in_(LEASED)), values,
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
