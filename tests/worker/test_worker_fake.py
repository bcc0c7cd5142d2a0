"""Worker behaviour with a fake trainer (fast): real Celery worker + reaper processes, both backends."""

from __future__ import annotations

import json

import pytest

from service.db.models import Checkpoint, JobEvent, JobMetric

pytestmark = pytest.mark.integration


def test_job_runs_to_success(make_stack, backend, spec_for):
    stack = make_stack(backend)
    stack.start_worker()
    job_id = stack.submit(spec_for(steps=12, every=4))
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert job.progress["step"] == 12 and job.progress["percent"] == 100.0
    assert job.latest_checkpoint_step == 12 and job.best_checkpoint_step == 12
    assert job.phase == "done"
    assert job.resolved_spec["resolved"] is True
    assert job.provenance["worker"]["packages"]["celery"] and job.provenance["trainer"]["fake"] is True
    metrics = stack.rows(JobMetric, job_id)
    assert [m.step for m in metrics] == list(range(1, 13))
    assert [m.seq for m in metrics] == list(range(1, 13))
    events = stack.rows(JobEvent, job_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    kinds = [e.kind for e in events]
    assert "started" in kinds and "succeeded" in kinds and kinds.count("checkpoint") == 3
    with stack.factory() as s:
        cks = s.query(Checkpoint).filter_by(job_id=job_id).order_by(Checkpoint.step).all()
    assert [c.step for c in cks] == [4, 8, 12]
    run = stack.settings.resolved_artifact_root() / job_id
    assert json.loads((run / "export" / "weights.json").read_text())["step"] == 12
    assert json.loads((run / "job_spec.json").read_text())["optim"]["max_steps"] == 12


def _trainer_pid(stack, job_id, attempt=0):
    return stack.trainer_pid(job_id, attempt)  # the job's events name no pid: found in /proc


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _assert_metrics_complete(stack, job_id, steps):
    metrics = stack.rows(JobMetric, job_id)
    assert [m.step for m in metrics] == list(range(1, steps + 1)), "metric steps have gaps or duplicates"
    assert [m.seq for m in metrics] == list(range(1, steps + 1))


def test_cancel_while_queued_never_starts(make_stack, spec_for):
    stack = make_stack("embedded")
    job_id = stack.submit(spec_for())
    stack.act(job_id, "cancel")  # what the API does
    worker = stack.start_worker()
    job2 = stack.submit(spec_for(steps=2, every=1))  # consumed after the cancelled one's message
    stack.wait_status(job2, "succeeded", timeout=60)
    assert stack.job(job_id).status == "cancelled"
    assert not (stack.settings.resolved_artifact_root() / job_id).exists()
    # only the service's own state events (queued, cancelled): no worker ever claimed or started it
    assert [e.kind for e in stack.rows(JobEvent, job_id)] == ["state", "state"]
    assert worker.poll() is None


def test_cancel_while_running(make_stack, backend, spec_for):
    stack = make_stack(backend)
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.1"})
    job_id = stack.submit(spec_for(steps=400, every=5))
    stack.wait(job_id, lambda j: (j.progress or {}).get("step", 0) >= 3, 60, "training")
    pid = _trainer_pid(stack, job_id)
    stack.act(job_id, "cancel")
    job = stack.wait_status(job_id, "cancelled", "failed", timeout=30)
    assert job.status == "cancelled" and job.finished_at is not None and job.lease_owner is None
    assert job.latest_checkpoint_step < 400
    assert not _alive(pid)
    kinds = [e.kind for e in stack.rows(JobEvent, job_id)]
    assert "stopping" in kinds and kinds[-1] == "cancelled"


def _expected_w(steps):
    w = 1.0
    for s in range(1, steps + 1):
        w = round(w * 0.9 + 0.01 * s, 12)
    return w


def test_pause_then_resume_continues_exactly(make_stack, spec_for):
    stack = make_stack("embedded")
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.05"})
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.05"})
    job_id = stack.submit(spec_for(steps=60, every=20))
    stack.wait(job_id, lambda j: (j.progress or {}).get("step", 0) >= 5, 60, "training")
    stack.act(job_id, "pause")
    job = stack.wait_status(job_id, "paused", "failed", "succeeded", timeout=30)
    assert job.status == "paused", (job.error_code, job.error_message)
    paused_at = job.latest_checkpoint_step
    assert paused_at is not None and 5 <= paused_at < 60 and paused_at % 20 != 0
    stack.act(job_id, "resume")
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert job.status == "succeeded", (job.error_code, job.error_message)
    run = stack.settings.resolved_artifact_root() / job_id
    assert json.loads((run / "export" / "weights.json").read_text())["w"] == _expected_w(60)
    _assert_metrics_complete(stack, job_id, 60)
    assert job.attempt == 0  # a pause is not a restart


def test_kill9_worker_reaper_requeues_and_resumes(make_stack, backend, spec_for):
    stack = make_stack(backend)
    stack.start_reaper()
    worker = stack.start_worker(env={"FAKE_STEP_SECONDS": "0.05"})
    job_id = stack.submit(spec_for(steps=80, every=10))
    stack.wait(job_id, lambda j: (j.latest_checkpoint_step or 0) >= 10, 60, "a checkpoint")
    pid = _trainer_pid(stack, job_id)
    import os
    import signal

    os.killpg(worker.pid, signal.SIGKILL)  # the whole worker (parent + pool child); the trainer follows
    worker.wait(timeout=10)
    stack.wait(job_id, lambda j: not _alive(pid), 10, "trainer gone")
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.01"})
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert job.attempt == 1
    resumed = [e for e in stack.rows(JobEvent, job_id) if e.kind == "resumed" and "attempt 1" in e.message]
    assert resumed and "resumed from checkpoint step" in resumed[0].message
    _assert_metrics_complete(stack, job_id, 80)
    run = stack.settings.resolved_artifact_root() / job_id
    assert json.loads((run / "export" / "weights.json").read_text())["w"] == _expected_w(80)


def test_kill9_trainer_requeues_and_resumes(make_stack, spec_for):
    stack = make_stack("embedded")
    stack.start_reaper()
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.05"})
    job_id = stack.submit(spec_for(steps=60, every=10))
    stack.wait(job_id, lambda j: (j.latest_checkpoint_step or 0) >= 10, 60, "a checkpoint")
    import os
    import signal

    os.kill(_trainer_pid(stack, job_id), signal.SIGKILL)
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=60)  # max_tasks_per_child=1: new child
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert job.attempt == 1
    assert any("SIGKILL" in e.message and e.kind == "resumed" for e in stack.rows(JobEvent, job_id))
    _assert_metrics_complete(stack, job_id, 60)


def test_restarts_exhausted_fail(make_stack, spec_for):
    stack = make_stack("embedded")
    stack.start_reaper()
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.05"})
    job_id = stack.submit(spec_for(steps=400, every=10, max_restarts=0))
    import os
    import signal

    os.kill(_trainer_pid(stack, job_id), signal.SIGKILL)
    job = stack.wait_status(job_id, "failed", "succeeded", timeout=30)
    assert job.status == "failed" and job.error_code == "host_oom" and job.error_retryable is True
    assert "max_restarts=0" in job.error_message


def test_invalid_data_fails_fast_naming_the_line(make_stack, spec_for, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": []}\n{"messages": [}\n')
    stack = make_stack("embedded")
    stack.start_worker()
    ds_id = stack.add_dataset(data)  # an uploaded dataset: the worker hands the trainer its local file
    job_id = stack.submit(spec_for(data_path=f"dataset:{ds_id}"))
    job = stack.wait_status(job_id, "failed", "succeeded", timeout=30)
    assert job.status == "failed" and job.error_code == "data_invalid"
    assert "line 2" in job.error_message and job.error_retryable is False
    assert str(data) in (stack.settings.resolved_artifact_root() / job_id / "job_spec.json").read_text()
    missing = stack.submit(spec_for(data_path="dataset:ds_nope"))
    job = stack.wait_status(missing, "failed", "succeeded", timeout=30)
    assert job.error_code == "data_invalid" and "data.sources.0.path" in job.error_message


def test_two_workers_never_run_the_same_job(make_stack, backend, spec_for):
    stack = make_stack(backend)
    stack.start_worker()
    stack.start_worker()
    job_id = stack.submit(spec_for(steps=20, every=10))
    stack.producer.send_train(job_id, stack.queue)  # a duplicate message: both workers get one
    stack.producer.send_train(job_id, stack.queue)
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert job.status == "succeeded"
    starts = [e for e in stack.rows(JobEvent, job_id) if e.kind == "started"]
    assert len(starts) == 1
    _assert_metrics_complete(stack, job_id, 20)


def test_retention_after_a_resume_unlists_the_first_attempts_checkpoints(make_stack, spec_for):
    """A resumed attempt's retention deletes checkpoints the first attempt recorded: their rows stop being
    complete (they stayed listed, `[5, 10, 25, 30]` with only 25 and 30 on disk)."""
    stack = make_stack("embedded")
    stack.start_reaper()
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.05", "FAKE_KEEP_LAST": "2"})
    job_id = stack.submit(spec_for(steps=60, every=10))
    stack.wait(job_id, lambda j: (j.latest_checkpoint_step or 0) >= 20, 60, "two checkpoints")
    import os
    import signal

    os.kill(_trainer_pid(stack, job_id), signal.SIGKILL)
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=60)
    assert job.status == "succeeded" and job.attempt == 1, (job.error_code, job.error_message, stack.logs())
    with stack.factory() as s:
        listed = [c.step for c in s.query(Checkpoint).filter_by(job_id=job_id, complete=True)
                  .order_by(Checkpoint.step)]
    assert listed == [50, 60]
