"""Replay dedup of metric records: a resumed attempt replays what its predecessor printed after the
checkpoint it resumes from, and the supervisor recovers unflushed records from RUN/progress.jsonl.

Dedup is per (step, kind): a training record (`loss`, `acc_k`, ...) and an evaluation record (`eval_*`,
`acceptance_length`, `al_pos_k`) at the same step are different records. An attempt that crashed at a
checkpoint step N had stored its training metrics at N but not yet the eval at N; that eval must still be
stored when it arrives in the replay. Each kind has its own floor (`Lease.metric_floor`, `Lease.eval_floor`).

The preview's records (`preview_*` keys, `peagle.preview`: a short run before the main one, whose steps
start at 1 again) are a kind of their own that never raises a floor and is never a replay: the preview
resumes from its own checkpoint, so it repeats no step after a pause.

The evaluations after training (`FINAL_PHASES`: the final AL of the best checkpoint, the serve check) are
records of the run, not of a step: they carry the last training step, which the floors already cover once
training is complete, so a floor would drop the evaluation of an attempt that resumes after a crash during
`evaluating`. The worker marks them (`final`: the phase) and stores each one with its `eval` event in one
transaction; they are dropped only when that phase's eval event is already stored (`final_evaluations`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from peagle.spec.metrics import AL_POS_PREFIX, is_eval_key, is_preview_key
from service.db.models import JobEvent, JobMetric

__all__ = ["EVAL", "FINAL_PHASES", "PREVIEW", "TRAIN", "final_evaluations", "metric_floors", "metric_kind",
           "replayed"]

TRAIN = "train"
EVAL = "eval"
PREVIEW = "preview"
#: The phases after training whose `eval` event (and its metric record) a job stores once.
FINAL_PHASES = ("evaluating", "serve_check")


def metric_kind(values: Mapping[str, Any]) -> str:
    """`preview` for a record of the preview (`preview_*` keys), `eval` for an evaluation record (any `eval_*`,
    `acceptance_length` or `al_pos_k` key), else `train`."""
    if any(is_preview_key(k) for k in values):
        return PREVIEW
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
        if kind == PREVIEW:
            continue
        current = floors[kind]
        floors[kind] = int(step) if current is None else max(current, int(step))
    return floors[TRAIN], floors[EVAL]


def final_evaluations(session: Session, job_id: str) -> frozenset[str]:
    """The `FINAL_PHASES` whose `eval` event the job has stored (with its metric record, module docstring)."""
    rows = session.execute(
        sa.select(JobEvent.phase).where(JobEvent.job_id == job_id, JobEvent.kind == "eval",
                                        JobEvent.phase.in_(FINAL_PHASES)).distinct()
    ).scalars()
    return frozenset(str(p) for p in rows)


def replayed(metric: Mapping[str, Any], train_floor: int | None, eval_floor: int | None,
             final_done: frozenset[str] = frozenset()) -> bool:
    """Whether a metric record ({step, values, final?}) is a replay of one already stored (drop it): a
    record of a final evaluation (`final`: its phase) when that phase's evaluation is in `final_done`,
    any other record at or below the floor of its kind."""
    final = metric.get("final")
    if final is not None:
        return final in final_done
    kind = metric_kind(metric.get("values") or {})
    if kind == PREVIEW:
        return False
    floor = eval_floor if kind == EVAL else train_floor
    return floor is not None and int(metric["step"]) <= floor
