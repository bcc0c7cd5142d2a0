"""Lease, ingest and reaper logic on a migrated SQLite database (no processes), plus pure helpers."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.db import lease as L
from service.db import progress as P
from service.db import requeue as R
from service.db.models import Checkpoint, Job, JobEvent, JobMetric, utcnow
from service.db.session import session_scope
from tests.worker.conftest import new_job
from worker.progress import ProgressCollector


def claim(factory, job_id, owner="w1", lease_seconds=60.0):
    with session_scope(factory) as s:
        return L.claim_job(s, job_id, owner=owner, lease_seconds=lease_seconds, artifact_dir="/tmp/x")


def test_second_claim_is_refused_and_cancelled_never_claimed(factory):
    job_id = new_job(factory)
    first = claim(factory, job_id, "w1")
    assert first is not None and first.attempt == 0 and first.metric_floor is None
    assert claim(factory, job_id, "w2") is None
    cancelled = new_job(factory, status="cancelled")
    paused = new_job(factory, status="paused")
    assert claim(factory, cancelled) is None and claim(factory, paused) is None


def test_ingest_sequences_interleave_with_api_events_and_fence(factory):
    job_id = new_job(factory)
    lease = claim(factory, job_id)
    batch = P.Batch(metrics=[{"step": 1, "values": {"loss": 1.0}}, {"step": 2, "values": {"loss": 0.9}}],
                    events=[{"kind": "phase", "phase": "training", "message": "t"}],
                    logs=[{"level": "info", "message": "hello"}], phase="training",
                    progress={"step": 2, "total_steps": 10})
    with session_scope(factory) as s:
        assert P.ingest(s, lease, batch) == (1, 2, 1)
        L.add_job_event(s, job_id, kind="cancel_requested", message="by user", attempt=0)
    with session_scope(factory) as s:
        seqs = P.ingest(s, lease, P.Batch(events=[{"kind": "warning", "message": "w"}],
                                          checkpoints=[{"step": 2, "dir": "checkpoints/step_000002",
                                                        "files": [], "metrics": {}, "is_best": True}]))
    assert seqs == (3, 2, 1)
    with factory() as s:
        assert [e.seq for e in s.scalars(sa.select(JobEvent).order_by(JobEvent.seq))] == [1, 2, 3]
        job = s.get(Job, job_id)
        assert job.phase == "training" and job.progress["step"] == 2
        assert job.latest_checkpoint_step == 2 and job.best_checkpoint_step == 2
    # the reaper takes the job away: every later write of the old lease is refused
    with session_scope(factory) as s:
        s.execute(sa.update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    with session_scope(factory) as s:
        (act,) = R.reap_lapsed(s)
    assert act.status == "queued" and act.attempt == 1
    assert "resumed from checkpoint step 2 (attempt 1)" in act.message
    with session_scope(factory) as s, pytest.raises(L.LeaseLost):
        L.heartbeat(s, lease, lease_seconds=60)
    with session_scope(factory) as s, pytest.raises(L.LeaseLost):
        P.ingest(s, lease, P.Batch(logs=[{"message": "late"}]))
    with session_scope(factory) as s:
        assert L.finish(s, lease, status="succeeded") is False


def test_resumed_attempt_drops_replayed_metric_steps(factory):
    job_id = new_job(factory)
    lease = claim(factory, job_id)
    with session_scope(factory) as s:
        P.ingest(s, lease, P.Batch(metrics=[{"step": i, "values": {"loss": 1.0 / i}} for i in range(1, 6)]))
        L.expire_lease(s, lease)
    with session_scope(factory) as s:
        R.reap_lapsed(s)
    again = claim(factory, job_id, "w2")
    assert again.attempt == 1 and again.metric_floor == 5
    with session_scope(factory) as s:  # the trainer resumed from step 3: replays 4, 5, then new steps
        P.ingest(s, again, P.Batch(metrics=[{"step": i, "values": {"loss": 1.0 / i}} for i in range(4, 9)]))
    with factory() as s:
        rows = s.scalars(sa.select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.seq)).all()
    assert [m.step for m in rows] == list(range(1, 9)) and [m.seq for m in rows] == list(range(1, 9))
    assert [m.attempt for m in rows] == [0] * 5 + [1] * 3


def test_reaper_gives_up_after_max_restarts_and_honours_pause_cancel(factory):
    ids = {st: new_job(factory, max_restarts=1) for st in ("run0", "run1", "pausing", "cancelling")}
    past = utcnow() - timedelta(seconds=5)
    with session_scope(factory) as s:
        for key, jid in ids.items():
            status = {"pausing": "pausing", "cancelling": "cancelling"}.get(key, "running")
            s.execute(sa.update(Job).where(Job.id == jid).values(
                status=status, lease_owner="dead", lease_expires_at=past, heartbeat_at=past,
                attempt=1 if key == "run1" else 0))
    with session_scope(factory) as s:
        acts = {a.job_id: a for a in R.reap_lapsed(s)}
    assert acts[ids["run0"]].status == "queued"
    assert acts[ids["run1"]].status == "failed" and acts[ids["pausing"]].status == "paused"
    assert acts[ids["cancelling"]].status == "cancelled"
    with factory() as s:
        failed = s.get(Job, ids["run1"])
        assert failed.error_code == "worker_lost" and "max_restarts=1" in failed.error_message
        assert failed.finished_at is not None and failed.lease_owner is None
    with session_scope(factory) as s:
        assert R.reap_lapsed(s) == []  # idempotent


def test_checkpoint_upsert_moves_best_and_marks_deleted(factory):
    job_id = new_job(factory)
    lease = claim(factory, job_id)
    ck = [{"step": s, "dir": f"checkpoints/step_{s:06d}", "files": [], "metrics": {}, "is_best": s == 4}
          for s in (2, 4, 6)]
    with session_scope(factory) as s:
        P.ingest(s, lease, P.Batch(checkpoints=ck))
        P.ingest(s, lease, P.Batch(checkpoints=[{**ck[2], "is_best": True}], missing_checkpoint_steps=[2]))
    with factory() as s:
        rows = {c.step: c for c in s.scalars(sa.select(Checkpoint).where(Checkpoint.job_id == job_id))}
        job = s.get(Job, job_id)
    assert [rows[k].is_best for k in (2, 4, 6)] == [False, False, True]
    assert rows[2].complete is False and rows[6].complete is True
    assert job.best_checkpoint_step == 6 and job.latest_checkpoint_step == 6


def test_final_al_of_the_best_checkpoint_lands_on_its_row(factory):
    """Walk-through rough edge: the measured AL was in the events but the checkpoints table showed none."""
    job_id = new_job(factory)
    lease = claim(factory, job_id)
    c = ProgressCollector()
    for s in (4, 8):
        c.add_line(f'{{"type":"event","kind":"checkpoint","step":{s},"metrics":{{"tau_sim":0.{s}}},'
                   f'"is_best":{"true" if s == 4 else "false"}}}\n')
    c.add_line('{"type":"event","kind":"eval","checkpoint_step":4,'
               '"metrics":{"acceptance_length":1.7,"per_position":[0.5,0.2],"tau_sim":9.0}}\n')
    c.add_line('{"type":"event","kind":"eval","checkpoint_step":99,"metrics":{"acceptance_length":2.0}}\n')
    with session_scope(factory) as s:
        P.ingest(s, lease, c.take())
    with factory() as s:
        rows = {ck.step: ck.metrics for ck in s.scalars(sa.select(Checkpoint).where(Checkpoint.job_id == job_id))}
    assert rows == {4: {"tau_sim": 0.4, "acceptance_length": 1.7, "al_pos_0": 0.5, "al_pos_1": 0.2},
                    8: {"tau_sim": 0.8}}


def test_finish_checks_the_state_machine(factory):
    job_id = new_job(factory)
    lease = claim(factory, job_id)
    with session_scope(factory) as s:
        assert L.finish(s, lease, status="paused") is False  # running -> paused is not a legal move
        assert L.finish(s, lease, status="failed", error_code="data_invalid", error_message="line 2",
                        retryable=False, event=("error", "data_invalid: line 2"))
    with factory() as s:
        job = s.get(Job, job_id)
    assert job.status == "failed" and job.error_code == "data_invalid" and job.lease_owner is None


def test_progress_collector_turns_lines_into_a_batch():
    c = ProgressCollector()
    c.add_line('{"type":"event","kind":"phase","phase":"training","time":1.0}\n')
    c.add_line('{"type":"metric","step":1,"epoch":0.1,"values":{"loss":2.0,"bad":"x","nan":NaN}}\n')
    c.add_line('{"type":"event","kind":"progress","step":5,"total_steps":10,"epoch":0.5}\n')
    c.add_line('{"type":"event","kind":"eval","step":1,"metrics":{"eval_loss":1.5}}\n')
    c.add_line('{"type":"event","kind":"eval","metrics":{"acceptance_length":1.8,"per_position":[0.5,0.3]}}\n')
    c.add_line("plain text\n")
    b = c.take()
    assert b.phase == "training" and b.progress["percent"] == 50.0
    assert [m["values"] for m in b.metrics] == [
        {"loss": 2.0}, {"eval_loss": 1.5}, {"acceptance_length": 1.8, "al_pos_0": 0.5, "al_pos_1": 0.3}]
    assert [e["kind"] for e in b.events] == ["phase", "eval", "eval"]
    assert b.logs[0]["message"] == "plain text"
    assert not c.take()


def test_worker_modules_never_import_torch():
    code = ("import sys, worker.app, worker.tasks, worker.supervisor, worker.reaper, worker.run; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=False)
    assert res.returncode == 0, "the worker parent imported torch"
