"""Workers announce themselves in the database; the API reads them to refuse a job no worker can take.

Each running worker (`python -m worker`, the one `make run` embeds included) keeps one `Worker` row,
keyed by its Celery node name: `announce` writes it when the worker is ready and every heartbeat after,
`retire` deletes it when the worker stops. A row whose heartbeat is older than `stale_after_s`
(`Settings.lease_seconds`, as for a job's lease) is a worker that died.

`worker_problems(...)` is what the API's preflight asks (`Settings.worker_check`):
- `auto` (default): only once workers have announced themselves to this database (some row exists):
  a fresh database, or one whose workers all stopped cleanly, queues the job for the next worker;
- `yes`: always (no live worker at all is a problem too); `no`: never.
A job is refused when no live worker consumes its queue, or none of those has `resources.gpus` GPUs.
Announcing costs one UPDATE per heartbeat; the check is one SELECT of the (few) live rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db.models import Worker, utcnow

__all__ = ["LiveWorker", "announce", "live_workers", "retire", "worker_problems"]

#: Rows of workers silent this long are deleted by the next `announce` (they died long ago).
_FORGET_AFTER = timedelta(days=1)


@dataclass(frozen=True)
class LiveWorker:
    """A worker whose heartbeat is fresh."""

    name: str
    queues: tuple[str, ...]
    gpus: int


def announce(session: Session, *, name: str, queues: Sequence[str], gpus: int, now: datetime | None = None) -> None:
    """Insert or refresh this worker's row (its queues, GPUs and heartbeat); forget long-dead workers."""
    now = now or utcnow()
    row = session.get(Worker, name)
    if row is None:
        session.add(Worker(name=name, queues=list(queues), gpus=gpus, started_at=now, heartbeat_at=now))
    else:
        row.queues, row.gpus, row.heartbeat_at = list(queues), gpus, now
    session.execute(sa.delete(Worker).where(Worker.heartbeat_at < now - _FORGET_AFTER))


def retire(session: Session, *, name: str) -> None:
    """Delete this worker's row (it stops: its jobs are no longer taken by it)."""
    session.execute(sa.delete(Worker).where(Worker.name == name))


def live_workers(session: Session, *, stale_after_s: float, now: datetime | None = None) -> list[LiveWorker]:
    """Workers whose heartbeat is at most `stale_after_s` old."""
    since = (now or utcnow()) - timedelta(seconds=stale_after_s)
    rows = session.execute(sa.select(Worker.name, Worker.queues, Worker.gpus).where(Worker.heartbeat_at >= since))
    return [LiveWorker(name=n, queues=tuple(str(q) for q in (qs or [])), gpus=int(g)) for n, qs, g in rows]


def worker_problems(session: Session, *, queue: str, gpus: int, stale_after_s: float, mode: str = "auto",
                    queue_param: str = "/queue", gpus_param: str = "/resources/gpus") -> list[dict[str, str]]:
    """Why no live worker can take a job on `queue` needing `gpus` GPUs (module docstring), as
    `[{"param", "message"}]`: at `queue_param` when none consumes the queue, else at `gpus_param`."""
    if mode == "no":
        return []
    if mode == "auto" and session.scalar(sa.select(sa.func.count()).select_from(Worker)) == 0:
        return []  # no worker has announced itself: nothing to judge by
    live = live_workers(session, stale_after_s=stale_after_s)
    on_queue = [w for w in live if queue in w.queues]
    if not on_queue:
        others = sorted({q for w in live for q in w.queues})
        seen = f"the live workers consume {', '.join(others)}" if others else "no worker is running"
        return [{"param": queue_param, "message": f"no live worker consumes queue {queue!r} ({seen}); start a "
                 f"worker for it (PEAGLE_WORKER_QUEUE={queue} python -m worker) or choose another queue"}]
    most = max(w.gpus for w in on_queue)
    if gpus > most:
        has = f"at most {most} GPU{'s' if most != 1 else ''}" if most else "no GPU"
        return [{"param": gpus_param, "message": f"needs {gpus} GPU{'s' if gpus != 1 else ''}, and the live "
                 f"workers of queue {queue!r} have {has}: use a queue whose workers have them, or fewer GPUs"}]
    return []
