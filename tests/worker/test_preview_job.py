"""A real job with a preview through the worker (issue 39): its preview metrics are stored before the main
run's, none of its steps is a checkpoint of the job, the `preview` phase is on the job's timeline, and a
pause during the preview resumes it without storing a step twice."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from service.db.models import JobEvent, JobMetric

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# the main run: 6 steps, checkpoints at 4 and 6; the preview's 3 steps would add one at its last step
BASE = {"data": {"eval_samples": 0}, "optim": {"max_steps": 6}, "checkpoints": {"every_steps": 4},
        "eval": {"prompt_sets": []}}


def _submit(client: Any, preview: dict[str, int]) -> str:
    r = client.post("/v1/jobs", json={"preset": "tiny", "overrides": {**BASE, "preview": preview}})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _steps(stack: Any, job_id: str) -> tuple[list[int], list[int]]:
    """(preview steps, main training steps) of the job's stored metric records, in storage order."""
    rows = sorted(stack.rows(JobMetric, job_id), key=lambda m: m.seq)
    pre = [m.step for m in rows if "preview_loss" in m.values]
    main = [m.step for m in rows if "loss" in m.values]
    return pre, main


def _checkpoints(client: Any, job_id: str) -> list[int]:
    r = client.get(f"/v1/jobs/{job_id}/checkpoints")
    assert r.status_code == 200, r.text
    body = r.json()
    return sorted(c["step"] for c in (body["data"] if isinstance(body, dict) else body))


def test_a_preview_job_through_the_worker(make_stack: Any, api: Any) -> None:
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    client = api(stack)
    job_id = _submit(client, {"conversations": 8, "steps": 3})
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    rows = sorted(stack.rows(JobMetric, job_id), key=lambda m: m.seq)
    pre, main = _steps(stack, job_id)
    assert pre == [1, 2, 3] and main == [1, 2, 3, 4, 5, 6]
    first_main = next(m.seq for m in rows if "loss" in m.values)
    assert all(m.seq < first_main for m in rows if "preview_loss" in m.values)  # the first curve came first
    assert _checkpoints(client, job_id) == [4, 6]
    phases = [e.phase for e in sorted(stack.rows(JobEvent, job_id), key=lambda e: e.seq) if e.kind == "phase"]
    assert phases[:3] == ["validating", "preview", "preparing_data"], phases
    r = client.get(f"/v1/jobs/{job_id}/metrics", params={"keys": "preview_loss"})
    assert [p["step"] for p in r.json()["data"] if p["values"]] == [1, 2, 3]


def test_a_pause_during_the_preview_resumes_it_and_stores_each_step_once(make_stack: Any, api: Any) -> None:
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    client = api(stack)
    job_id = _submit(client, {"conversations": 8, "steps": 1000})  # long enough to be paused in it
    stack.wait(job_id, lambda j: (j.progress or {}).get("phase") == "preview" and j.status == "running", 180,
               "preview training")
    r = client.post(f"/v1/jobs/{job_id}/pause")
    assert r.status_code == 200, r.text
    job = stack.wait_status(job_id, "paused", "failed", "succeeded", timeout=120)
    assert job.status == "paused", (job.error_code, job.error_message, stack.logs())
    pre, main = _steps(stack, job_id)
    assert 1 <= len(pre) < 1000 and not main, (len(pre), main)
    assert client.post(f"/v1/jobs/{job_id}/resume").status_code == 200
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=600)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    pre, main = _steps(stack, job_id)
    twice = [s for s, n in Counter(pre).items() if n > 1]
    assert sorted(pre) == list(range(1, 1001)) and not twice, twice[:10]
    assert main == [1, 2, 3, 4, 5, 6]
    assert _checkpoints(client, job_id) == [4, 6]
