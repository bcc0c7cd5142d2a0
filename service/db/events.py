"""Job events: the one writer of `job_event` rows, for the API, the lease layer and the reaper.

    add_event(session, job_id, kind="state", message="cancel requested", attempt=0, data={...})  # -> seq
    insert_events(session, [event_row(job_id, seq, attempt=1, kind="checkpoint", message="...", time=now)])

A row's `seq` is reserved by incrementing `job.event_seq` in the same transaction (`add_event` does both;
the lease layer reserves several sequences in one conditional UPDATE and then calls `insert_events`).
Functions take a `Session` and leave commit to the caller. No FastAPI, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db.models import Job, JobEvent, utcnow

__all__ = ["add_event", "event_row", "insert_events"]


def event_row(job_id: str, seq: int, *, attempt: int, kind: str, message: str = "", phase: str | None = None,
              data: dict[str, Any] | None = None, time: datetime | None = None) -> dict[str, Any]:
    """The column values of one `job_event` row (`time` defaults to now, `data` to `{}`)."""
    return {"job_id": job_id, "seq": seq, "time": time or utcnow(), "attempt": attempt, "kind": kind,
            "phase": phase, "message": message, "data": data or {}}


def insert_events(session: Session, rows: Sequence[dict[str, Any]]) -> None:
    """Insert `event_row` rows (their seqs already reserved on the job row); nothing for no rows."""
    if rows:
        session.execute(sa.insert(JobEvent), list(rows))


def add_event(session: Session, job_id: str, *, kind: str, message: str, attempt: int, phase: str | None = None,
              data: dict[str, Any] | None = None, now: datetime | None = None,
              job_values: dict[str, Any] | None = None) -> int:
    """Reserve the job's next event seq (setting `job_values` on the job row too) and insert the event.

    Returns the seq. Raises LookupError when there is no job `job_id`.
    """
    now = now or utcnow()
    seq = session.execute(
        sa.update(Job).where(Job.id == job_id).values(event_seq=Job.event_seq + 1, **(job_values or {}))
        .returning(Job.event_seq).execution_options(synchronize_session=False)
    ).scalar()
    if seq is None:
        raise LookupError(f"job {job_id} not found")
    insert_events(session, [event_row(job_id, int(seq), attempt=attempt, kind=kind, message=message, phase=phase,
                                      data=data, time=now)])
    return int(seq)
