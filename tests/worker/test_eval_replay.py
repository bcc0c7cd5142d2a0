"""Issue 19: an eval metric recorded at a checkpoint step survives a crash at that step (replay dedup is on
(step, kind), not on the step alone). Real SQLite database, real collector, ingest and supervisor backfill."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from service.db import lease as L
from service.db import progress as P
from service.db import requeue as R
from service.db.models import Job, JobMetric
from service.db.session import session_scope
from service.settings import get_settings
from tests.worker.conftest import new_job
from worker.progress import ProgressCollector
from worker.supervisor import Supervisor

STEP = 4  # the checkpoint step at which the attempt crashes
EVAL = {"type": "event", "kind": "eval", "step": STEP, "metrics": {"eval_loss": 0.5, "acceptance_length": 2.5}}


def _train_records() -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [{"type": "metric", "step": i, "epoch": 0.1 * i, "values": {"loss": 1.0 / i}}
                                  for i in range(1, STEP + 1)]
    recs.append({"type": "event", "kind": "checkpoint", "step": STEP, "dir": f"checkpoints/step_{STEP:06d}"})
    return recs


def _crashed_job(factory: sessionmaker[Session]) -> str:
    """Attempt 0 stored metrics 1..STEP and the checkpoint at STEP, then died before its eval was stored."""
    job_id = new_job(factory)
    with session_scope(factory) as s:
        lease = L.claim_job(s, job_id, owner="w1", lease_seconds=60, artifact_dir="/tmp/x")
    collector = ProgressCollector()
    for rec in _train_records():
        collector.add(rec)
    with session_scope(factory) as s:
        P.ingest(s, lease, collector.take())
        L.expire_lease(s, lease)
    with session_scope(factory) as s:
        assert [a.status for a in R.reap_lapsed(s)] == ["queued"]
    return job_id


def _metric_rows(factory: sessionmaker[Session], job_id: str) -> list[tuple[int, dict[str, float]]]:
    with factory() as s:
        rows = s.scalars(sa.select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.seq)).all()
    return [(m.step, dict(m.values)) for m in rows]


def test_eval_at_the_crash_step_replayed_by_the_resumed_trainer_is_stored(factory: Any) -> None:
    job_id = _crashed_job(factory)
    with session_scope(factory) as s:
        lease = L.claim_job(s, job_id, owner="w2", lease_seconds=60, artifact_dir="/tmp/x")
    collector = ProgressCollector()
    # the resumed trainer re-evaluates its checkpoint, replays the training step, then goes on
    for rec in [EVAL, {"type": "metric", "step": STEP, "epoch": 0.4, "values": {"loss": 1.0 / STEP}},
                {"type": "metric", "step": STEP + 1, "epoch": 0.5, "values": {"loss": 0.2}}]:
        collector.add(rec)
    with session_scope(factory) as s:
        P.ingest(s, lease, collector.take())
    rows = _metric_rows(factory, job_id)
    assert [step for step, _ in rows] == [1, 2, 3, 4, 4, 5]  # the eval at 4 kept, the replayed loss at 4 not
    assert rows[4][1] == {"eval_loss": 0.5, "acceptance_length": 2.5}


def _resumed_after_crash(factory: Any, tmp_path: Path, printed: list[dict[str, Any]]) -> tuple[str, Supervisor]:
    """A crashed job whose attempt 0 appended `printed` to RUN/progress.jsonl, claimed again by a new
    supervisor that has run its backfill."""
    job_id = _crashed_job(factory)
    settings = get_settings(home=tmp_path / "home", artifact_root=tmp_path / "artifacts",
                            database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    run = settings.resolved_artifact_root() / job_id
    run.mkdir(parents=True)
    (run / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in printed))
    with session_scope(factory) as s:
        lease = L.claim_job(s, job_id, owner="w2", lease_seconds=60, artifact_dir=str(run))
    sup = Supervisor(settings, factory, lease)
    sup._backfill()
    return job_id, sup


def test_eval_at_the_crash_step_recovered_from_progress_jsonl_is_stored(factory: Any, tmp_path: Path) -> None:
    # what attempt 0 printed (and appended to RUN/progress.jsonl) before it died: the eval was never flushed
    job_id, sup = _resumed_after_crash(factory, tmp_path, [*_train_records(), EVAL])
    rows = _metric_rows(factory, job_id)
    assert [step for step, _ in rows] == [1, 2, 3, 4, 4]
    assert rows[4][1] == {"eval_loss": 0.5, "acceptance_length": 2.5}
    # the resumed trainer's replays of both kinds are then dropped
    sup.collector.add(EVAL)
    sup.collector.add({"type": "metric", "step": STEP, "epoch": 0.4, "values": {"loss": 1.0 / STEP}})
    with session_scope(factory) as s:
        P.ingest(s, sup.lease, sup.collector.take())
    assert len(_metric_rows(factory, job_id)) == 5


# What `peagle train` prints for its final evaluation (`peagle.eval.final.evaluate_run`): the AL as a metric
# record at the last step, then the whole evaluation as an eval event naming the evaluated checkpoint.
FINAL = [
    {"type": "event", "kind": "phase", "phase": "evaluating", "message": "acceptance length of step_000004"},
    {"type": "metric", "step": STEP, "epoch": 1.0, "values": {"acceptance_length": 1.5, "al_pos_0": 0.5}},
    {"type": "event", "kind": "eval", "checkpoint": "step_000004", "checkpoint_step": STEP,
     "metrics": {"tau_sim": 0.4, "engine": "reference", "acceptance_length": 1.5, "per_position": [0.5],
                 "num_speculative_tokens": 3}},
    {"type": "event", "kind": "phase", "phase": "exporting", "message": "RUN/export"},
]


def test_the_final_evaluation_is_one_metric_record() -> None:
    collector = ProgressCollector()
    for rec in FINAL:
        collector.add(rec)
    metrics = collector.take().metrics
    assert [(m["step"], m["epoch"], m["values"]) for m in metrics] == [
        (STEP, 1.0, {"acceptance_length": 1.5, "al_pos_0": 0.5, "tau_sim": 0.4, "num_speculative_tokens": 3.0})]


def test_the_final_evaluation_of_a_resumed_attempt_is_kept_once(factory: Any) -> None:
    job_id = _crashed_job(factory)  # metrics 1..STEP and the checkpoint at STEP stored: training complete
    with session_scope(factory) as s:
        s.execute(sa.update(Job).where(Job.id == job_id).values(max_restarts=5))
        lease = L.claim_job(s, job_id, owner="w2", lease_seconds=60, artifact_dir="/tmp/x")
        P.ingest(s, lease, _batch([EVAL]))  # the in-training eval at STEP: both floors now cover STEP
        L.expire_lease(s, lease)
        assert [a.status for a in R.reap_lapsed(s)] == ["queued"]
    for owner in ("w3", "w4"):  # two attempts each print the final evaluation; the first one is stored
        with session_scope(factory) as s:
            lease = L.claim_job(s, job_id, owner=owner, lease_seconds=60, artifact_dir="/tmp/x")
            assert lease is not None and lease.eval_floor == STEP
            P.ingest(s, lease, _batch(FINAL))
            L.expire_lease(s, lease)
            R.reap_lapsed(s)
    rows = [values for _step, values in _metric_rows(factory, job_id) if "num_speculative_tokens" in values]
    assert len(rows) == 1 and rows[0]["acceptance_length"] == 1.5


def _batch(records: list[dict[str, Any]]) -> P.Batch:
    collector = ProgressCollector()
    for rec in records:
        collector.add(rec)
    return collector.take()


def test_a_final_evaluation_printed_before_a_crash_is_recovered_once(factory: Any, tmp_path: Path) -> None:
    # attempt 0 printed its in-training eval and its final evaluation, then died before the next flush
    job_id, sup = _resumed_after_crash(factory, tmp_path, [*_train_records(), EVAL, *FINAL])
    for rec in FINAL:  # the resumed trainer evaluates again: a replay
        sup.collector.add(rec)
    with session_scope(factory) as s:
        P.ingest(s, sup.lease, sup.collector.take())
    rows = [values for _step, values in _metric_rows(factory, job_id) if "num_speculative_tokens" in values]
    assert len(rows) == 1 and rows[0]["acceptance_length"] == 1.5
