"""A target engine that dies (`engine_failed`, exit 11) is retried like a crash: a new attempt within the
job's `max_restarts` resumes from what was done (its checkpoint, the owner's regeneration cache); with no
restart left the job fails with `engine_failed`. Real Celery worker processes and the fake trainer."""

from __future__ import annotations

from typing import Any

import pytest

from service.db.models import JobEvent, JobMetric

pytestmark = pytest.mark.integration


def test_engine_failure_requeues_and_the_new_attempt_resumes(make_stack: Any, spec_for: Any) -> None:
    stack = make_stack("embedded")
    stack.start_worker(env={"FAKE_ENGINE_FAIL_ATTEMPTS": "0", "FAKE_STEP_SECONDS": "0.02"})
    job_id = stack.submit(spec_for(steps=12, every=4, max_restarts=1))
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=90)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert job.attempt == 1 and job.error_code is None
    events = stack.rows(JobEvent, job_id)
    requeued = [e for e in events if e.kind == "resumed" and e.attempt == 1 and "engine_failed" in e.message]
    assert requeued and "checkpoint step 4" in requeued[0].message, [(e.kind, e.message) for e in events]
    # the new attempt resumed from attempt 0's checkpoint and found the answers it had regenerated
    resumed = [e for e in events if e.kind == "resumed" and e.attempt == 1 and e.data.get("step") == 4]
    assert resumed and resumed[0].data.get("regen_cached") == 1, [(e.kind, e.attempt, e.data) for e in events]
    assert [m.step for m in stack.rows(JobMetric, job_id)] == list(range(1, 13))


def test_engine_failure_without_restarts_left_fails_the_job(make_stack: Any, spec_for: Any) -> None:
    stack = make_stack("embedded")
    stack.start_worker(env={"FAKE_ENGINE_FAIL_ATTEMPTS": "0,1", "FAKE_STEP_SECONDS": "0.02"})
    job_id = stack.submit(spec_for(steps=12, every=4, max_restarts=1))
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=90)
    assert job.status == "failed" and job.error_code == "engine_failed", (job.error_code, job.error_message)
    assert job.attempt == 1 and job.error_retryable is True
    assert "vLLM target engine died" in (job.error_message or "") and "max_restarts=1" in (job.error_message or "")
