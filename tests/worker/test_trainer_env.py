"""The trainer a worker starts never sees the worker's secrets or service endpoints (its environment is an
allow-list): read from the running trainer's /proc/<pid>/environ, production backends (PostgreSQL + Redis)."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from tests.worker.conftest import process_environ

pytestmark = pytest.mark.integration

SECRET_NAMES = ("PEAGLE_SECRET_KEY", "PEAGLE_DATABASE_URL", "PEAGLE_BROKER_URL", "PEAGLE_REDIS_URL",
                "PEAGLE_SECRET_KEY_PREVIOUS")


def test_trainer_environment_holds_no_worker_secret(make_stack: Any, spec_for: Any) -> None:
    stack = make_stack("services")
    secret = secrets.token_urlsafe(48)
    worker_env = {"PEAGLE_SECRET_KEY": secret, "PEAGLE_SECRET_KEY_PREVIOUS": secrets.token_urlsafe(48),
                  "FAKE_STEP_SECONDS": "0.2"}
    stack.start_worker(env=worker_env)
    job_id = stack.submit(spec_for(steps=40, every=20))
    pid = stack.trainer_pid(job_id, 0)
    env = process_environ(pid)  # read while the trainer runs
    assert env.get("PEAGLE_JOB_ID") == job_id and env.get("PEAGLE_ATTEMPT") == "0", sorted(env)
    leaked = [k for k in SECRET_NAMES if k in env]
    assert not leaked, f"the trainer inherited {leaked}"
    values = [secret, worker_env["PEAGLE_SECRET_KEY_PREVIOUS"], stack.env["PEAGLE_DATABASE_URL"],
              stack.env["PEAGLE_BROKER_URL"], stack.env["PEAGLE_REDIS_URL"]]
    assert not [k for k, v in env.items() if any(x in v for x in values)], "a secret value under another name"
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=120)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
