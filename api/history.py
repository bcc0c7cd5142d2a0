"""Measured phases of earlier jobs, for the dry-run estimate (the cost model, `service.estimate`).

What is measured per finished job is already recorded: the trainer's `phase` events (with their times) and
its `data` event (the counted funnel: conversations read, packed rows) in `job_event`, the job's resolved
spec (target, dtype, engines, device, `optim.max_steps` = the steps it ran), the worker's provenance on the
job row (`worker/provenance.py`: the CPU's hardware class), and the run's data report
(`RUN/data/report.json`: the tokens its regeneration generated, 0 when every answer came from the cache).
A job counts when it succeeded in one attempt (a resumed job's phases overlap) on the same queue; which of
them are comparable to the job being estimated is `service.estimate`'s decision (`Comparable`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from peagle.spec import SpecInvalidError, parse_spec
from peagle.spec.hardware import hardware_class
from service.db import states
from service.db.models import Job, JobEvent
from service.estimate import PHASE_GROUPS, Comparable, Measured

__all__ = ["history", "job_hardware", "phase_seconds"]

#: The newest this many succeeded jobs of the queue are looked at (their events read).
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


def job_hardware(resolved: Mapping[str, Any], provenance: Mapping[str, Any] | None) -> str | None:
    """The hardware class a finished job ran on: `cuda-<n>gpu` when its resolved device is cuda, else the
    CPU class its worker recorded (`provenance.worker.hardware_class`); None when not recorded."""
    res = resolved.get("resources") or {}
    if res.get("device") == "cuda":
        return hardware_class(device="cuda", gpus=int(res.get("gpus") or 1))
    worker = (provenance or {}).get("worker") or {}
    cls = worker.get("hardware_class")
    return cls if isinstance(cls, str) and cls.startswith("cpu") else None


def _regen_tokens(run_dir: Path | None) -> int | None:
    """Tokens the run's regeneration generated (RUN/data/report.json), None when not readable."""
    if run_dir is None:
        return None
    try:
        report = json.loads((run_dir / "data" / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tokens = (report.get("regeneration") or {}).get("tokens") if isinstance(report, dict) else None
    return tokens if isinstance(tokens, int) else None


def _measured(job: Job, events: list[tuple[str, str | None, datetime, dict[str, Any]]],
              run_dir: Callable[[Job], Path] | None) -> Measured | None:
    resolved: dict[str, Any] = job.resolved_spec or {}
    steps = (resolved.get("optim") or {}).get("max_steps")
    hw = job_hardware(resolved, job.provenance)
    if not isinstance(steps, int) or steps <= 0 or hw is None:
        return None
    try:
        spec = parse_spec(resolved)
    except SpecInvalidError:
        return None
    secs = phase_seconds([(phase, when) for kind, phase, when, _d in events if kind == "phase"])
    if not secs:
        return None
    counted = [d.get("funnel") for kind, _p, _w, d in events if kind == "data" and isinstance(d.get("funnel"), dict)]
    return Measured(job_id=job.id, spec=spec, key=Comparable.of(resolved, hw), phase_seconds=secs, steps=steps,
                    funnel=counted[-1] if counted else None,
                    regen_tokens=_regen_tokens(run_dir(job) if run_dir is not None else None))


def history(session: Session, queue: str, *, run_dir: Callable[[Job], Path] | None = None) -> list[Measured]:
    """Single-attempt succeeded jobs on `queue`, newest first (the newest `_SCAN` looked at), with what
    they measured; `run_dir` finds a job's run directory (for its regenerated tokens)."""
    jobs = session.scalars(
        sa.select(Job).where(Job.status == states.SUCCEEDED, Job.queue == queue, Job.attempt == 0)
        .order_by(Job.finished_at.desc()).limit(_SCAN)
    ).all()
    if not jobs:
        return []
    rows = session.execute(
        sa.select(JobEvent.job_id, JobEvent.kind, JobEvent.phase, JobEvent.time, JobEvent.data)
        .where(JobEvent.job_id.in_([j.id for j in jobs]), JobEvent.kind.in_(("phase", "data")))
        .order_by(JobEvent.job_id, JobEvent.seq)
    ).all()
    by_job: dict[str, list[tuple[str, str | None, datetime, dict[str, Any]]]] = {}
    for job_id, kind, phase, when, data in rows:
        by_job.setdefault(job_id, []).append((kind, phase, when, data or {}))
    out = []
    for job in jobs:
        m = _measured(job, by_job.get(job.id, []), run_dir)
        if m is not None:
            out.append(m)
    return out
