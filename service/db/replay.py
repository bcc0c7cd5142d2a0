"""Replay dedup of metric records: a resumed attempt replays what its predecessor printed after the
checkpoint it resumes from, and the supervisor recovers unflushed records from RUN/progress.jsonl.

Dedup is per (step, kind): a training record (`loss`, `acc_k`, ...) and an evaluation record (`eval_*`,
`acceptance_length`, `al_pos_k`) at the same step are different records. An attempt that crashed at a
checkpoint step N had stored its training metrics at N but not yet the eval at N; that eval must still be
stored when it arrives in the replay. Each kind has its own floor (`Lease.metric_floor`, `Lease.eval_floor`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from peagle.spec.metrics import AL_POS_PREFIX, is_eval_key
from service.db.models import JobMetric

__all__ = ["EVAL", "TRAIN", "metric_floors", "metric_kind", "replayed"]

TRAIN = "train"
EVAL = "eval"


def metric_kind(values: Mapping[str, Any]) -> str:
    """`eval` for an evaluation record (any `eval_*`, `acceptance_length` or `al_pos_k` key), else `train`."""
    return EVAL if any(is_eval_key(k) or k.startswith(AL_POS_PREFIX) for k in values) else TRAIN


def metric_floors(session: Session, job_id: str, checkpoint_step: int | None) -> tuple[int | None, int | None]:
    """(training floor, eval floor): the highest stored step of each kind of the job's metric records.

    Only rows from the resume point on (`checkpoint_step`, the job's latest complete checkpoint) are read;
    everything below it counts as stored for both kinds (a resumed trainer never replays it).
    """
    top = session.execute(sa.select(sa.func.max(JobMetric.step)).where(JobMetric.job_id == job_id)).scalar()
    if top is None:
        return None, None
    low = min(int(checkpoint_step), int(top)) if checkpoint_step is not None else 0
    below = low - 1 if low > 0 else None
    floors: dict[str, int | None] = {TRAIN: below, EVAL: below}
    rows = session.execute(
        sa.select(JobMetric.step, JobMetric.values).where(JobMetric.job_id == job_id, JobMetric.step >= low)
    ).all()
    for step, values in rows:
        kind = metric_kind(values or {})
        current = floors[kind]
        floors[kind] = int(step) if current is None else max(current, int(step))
    return floors[TRAIN], floors[EVAL]


def replayed(metric: Mapping[str, Any], train_floor: int | None, eval_floor: int | None) -> bool:
    """Whether a metric record ({step, values}) is a replay of one already stored (drop it)."""
    floor = eval_floor if metric_kind(metric.get("values") or {}) == EVAL else train_floor
    return floor is not None and int(metric["step"]) <= floor
