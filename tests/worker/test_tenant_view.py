"""What a job's owner reads (its events, logs, error and provenance) names no infrastructure: not the
worker's host or pids, not a service address (`127.0.0.1:port`, the Redis/PostgreSQL URLs). Production
backends (PostgreSQL + Redis), a real worker, the fake trainer failing as a dead vLLM engine does."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from service.db.models import JobEvent, JobLog

pytestmark = pytest.mark.integration


def test_events_logs_and_error_name_no_host_pid_or_address(make_stack: Any, spec_for: Any) -> None:
    stack = make_stack("services")
    stack.start_worker(env={"FAKE_ENGINE_FAIL_ATTEMPTS": "0", "FAKE_STEP_SECONDS": "0.02"})
    job_id = stack.submit(spec_for(steps=8, every=4, max_restarts=0))
    pid = stack.trainer_pid(job_id, 0)
    job = stack.wait_status(job_id, "failed", "succeeded", timeout=90)
    assert job.status == "failed" and job.error_code == "engine_failed", (job.error_code, job.error_message)
    assert "vLLM target engine died" in (job.error_message or "")  # the reason stays, its addresses do not

    events = stack.rows(JobEvent, job_id)
    shown = [job.error_message or "", json.dumps(job.provenance)]
    shown += [f"{e.message} {json.dumps(e.data)}" for e in events]
    shown += [g.message for g in stack.rows(JobLog, job_id)]
    host = socket.gethostname()
    forbidden = ["127.0.0.1", "localhost:", ":41234", stack.env["PEAGLE_REDIS_URL"], stack.env["PEAGLE_DATABASE_URL"],
                 f"pid {pid}", f"pid {pid + 1}", '"pid"', "lease_owner"]
    if len(host) >= 3:
        forbidden.append(host)
    found = sorted({(f, text[:200]) for text in shown for f in forbidden if f in text})
    assert not found, found
    assert any(e.kind == "started" for e in events) and any(e.kind == "trainer" for e in events)
