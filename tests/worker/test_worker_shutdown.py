"""Issue 19: SIGTERM to `python -m worker` checkpoints the running job and requeues it (real worker process,
real SIGTERM, fake trainer with the real trainer's signal contract: checkpoint, exit 75)."""

from __future__ import annotations

import signal
import time

import pytest

from service.db.models import JobEvent, JobMetric

pytestmark = pytest.mark.integration


def test_sigterm_to_worker_checkpoints_and_requeues_then_resumes(make_stack, spec_for):
    stack = make_stack("embedded")
    stack.env["PEAGLE_SHUTDOWN_GRACE_SECONDS"] = "20"
    worker = stack.start_worker(env={"FAKE_STEP_SECONDS": "0.2"})
    stack.wait_workers_ready(1)
    job_id = stack.submit(spec_for(steps=150, every=50, max_restarts=2))
    stack.wait(job_id, lambda j: (j.progress or {}).get("step", 0) >= 3, 60, "training")
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)  # what `docker compose stop` sends to the container's PID 1
    try:
        worker.wait(timeout=30)
    except Exception:
        pytest.fail(f"the worker did not exit within 30 s of SIGTERM\n{stack.logs()}")
    took = time.monotonic() - started
    job = stack.job(job_id)
    assert job.status == "queued", (job.status, job.error_code, job.error_message, stack.logs())
    assert job.attempt == 1 and job.lease_owner is None and job.celery_task_id is None
    saved = job.latest_checkpoint_step
    assert saved is not None and 3 <= saved < 50, saved  # written on the signal, not a periodic one
    assert took < 20, took
    events = stack.rows(JobEvent, job_id)
    assert any(e.kind == "interrupted" and "worker shut down" in e.message for e in events), \
        [(e.kind, e.message) for e in events]

    stack.start_reaper()  # sends the queued job (it has no broker message) once a worker is there
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.01"})
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=90)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert job.attempt == 1
    resumed = [e.data["step"] for e in stack.rows(JobEvent, job_id)
               if e.kind == "resumed" and "step" in (e.data or {})]  # the trainer's own resume event
    assert resumed == [saved]
    steps = [m.step for m in stack.rows(JobMetric, job_id) if "loss" in m.values]
    assert steps == list(range(1, 151))  # nothing lost, nothing twice
