"""Measured phase times of earlier jobs, for the dry-run estimate (`api.estimate`).

What is measured per finished job is already recorded: the trainer's `phase` events (with their times) in
`job_event`, the job's spec and its resolved spec (`optim.max_steps` = the steps it ran). A job counts
when it succeeded in one attempt (a resumed job's phases overlap), ran on the same queue and resolves to
the same device class (cpu / cuda) as the job being estimated.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from itertools import pairwise
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from api.estimate import PHASE_GROUPS, Measured, device_class
from peagle.spec import SpecInvalidError, TrainSpec, parse_spec
from service.db import states
from service.db.models import Job, JobEvent

__all__ = ["HISTORY_JOBS", "history", "phase_seconds"]

#: At most this many earlier jobs (the newest) inform an estimate.
HISTORY_JOBS = 5
_SCAN = 40
_GROUP_OF = {p: group for group, phases in PHASE_GROUPS.items() for p in phases}


def phase_seconds(events: Iterable[tuple[str | None, datetime]]) -> dict[str, float]:
    """Seconds per `PHASE_GROUPS` phase from a job's `(phase, time)` phase events in order (until `done`)."""
    out: dict[str, float] = {}
    for (phase, start), (_next, end) in pairwise(events):
        group = _GROUP_OF.get(phase or "")
        if group is not None:
            out[group] = out.get(group, 0.0) + max(0.0, (end - start).total_seconds())
    return out


def _spec_of(job: Job) -> tuple[TrainSpec, int] | None:
    try:
        spec = parse_spec(job.spec)
    except SpecInvalidError:
        return None
    resolved: dict[str, Any] = job.resolved_spec or {}
    steps = (resolved.get("optim") or {}).get("max_steps")
    return (spec, int(steps)) if isinstance(steps, int) and steps > 0 else None


def history(session: Session, spec: TrainSpec, queue: str) -> list[Measured]:
    """The newest `HISTORY_JOBS` single-attempt succeeded jobs on `queue` with `spec`'s device class."""
    jobs = session.scalars(
        sa.select(Job).where(Job.status == states.SUCCEEDED, Job.queue == queue, Job.attempt == 0)
        .order_by(Job.finished_at.desc()).limit(_SCAN)
    ).all()
    want = device_class(spec)
    picked: list[tuple[Job, TrainSpec, int]] = []
    for job in jobs:
        parsed = _spec_of(job)
        if parsed is not None and device_class(parsed[0]) == want:
            picked.append((job, *parsed))
        if len(picked) == HISTORY_JOBS:
            break
    if not picked:
        return []
    rows = session.execute(
        sa.select(JobEvent.job_id, JobEvent.phase, JobEvent.time)
        .where(JobEvent.job_id.in_([j.id for j, _s, _n in picked]), JobEvent.kind == "phase")
        .order_by(JobEvent.job_id, JobEvent.seq)
    ).all()
    by_job: dict[str, list[tuple[str | None, datetime]]] = {}
    for job_id, phase, when in rows:
        by_job.setdefault(job_id, []).append((phase, when))
    out = []
    for job, spec_of, steps in picked:
        secs = phase_seconds(by_job.get(job.id, []))
        if secs:
            out.append(Measured(spec=spec_of, phase_seconds=secs, steps=steps))
    return out
