"""Issue 19: a queued job whose broker message was lost (Redis lost its data) is re-sent after
`requeue_lost_after_seconds` and runs. Real PostgreSQL, real Redis broker (flushed), real worker + reaper."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.integration

LOST_AFTER_S = 3.0


def test_queued_job_whose_message_was_flushed_runs_within_the_bound(make_stack, spec_for, redis_url):
    import redis

    # a Redis database of its own: flushing it is Redis losing its data, without touching other tests' data
    broker = redis_url.rsplit("/", 1)[0] + "/13"
    client = redis.Redis.from_url(broker)
    client.flushdb()
    stack = make_stack("services", redis_url=broker)
    stack.env["PEAGLE_REQUEUE_LOST_AFTER_SECONDS"] = str(LOST_AFTER_S)
    lost = stack.submit(spec_for(steps=6, every=3))
    assert client.llen(stack.queue) == 1
    client.flushdb()  # the broker loses the message before any worker consumed it
    assert client.llen(stack.queue) == 0 and stack.job(lost).celery_task_id is not None
    stack.start_reaper()
    stack.start_worker(env={"FAKE_STEP_SECONDS": "0.01"})
    later = stack.submit(spec_for(steps=6, every=3))  # sent after the loss: runs at once
    start = time.monotonic()
    assert stack.wait_status(later, "succeeded", "failed", timeout=60).status == "succeeded"
    job = stack.wait_status(lost, "succeeded", "failed", timeout=LOST_AFTER_S + 30)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert time.monotonic() - start < LOST_AFTER_S + 30
    assert "sending it again" in stack.logs()
    client.close()
