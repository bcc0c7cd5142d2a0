"""A retrain child through the worker: the real trainer warm-starts from its parent, and at its end the
worker compares it with the current draft (here: its parent) and stores a promotion decision. The `tiny`
target's head_dim 16 is one vLLM's CPU attention refuses, so on a CPU worker the comparison says so and
the decision is `not_measured` (the measured path: tests/engine/test_promotion_vllm.py)."""

from __future__ import annotations

import json

import pytest

from service.db.models import JobEvent

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_retrain_child_runs_and_stores_a_decision(make_stack) -> None:
    from peagle.engine.locate import vllm_python
    from peagle.engine.machine import vllm_runs_on_cpu
    from peagle.spec import preset
    from service.db import promotion
    from service.db.session import session_scope

    python = vllm_python()
    if python is not None and not vllm_runs_on_cpu(python):
        pytest.skip("vLLM runs on a GPU here: the tiny drafts would be measured (tests/engine covers that path)")
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    spec = preset("tiny").model_dump(mode="json")
    spec["optim"]["max_steps"] = 4
    parent = stack.submit(spec)
    job = stack.wait_status(parent, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message)

    child_spec = json.loads(json.dumps(spec))
    child_spec["draft"]["init_from"] = f"job:{parent}"
    child_spec["data"]["sources"] = [{"path": "builtin:sharegpt", "skip": 50, "max_samples": 40}]
    child = stack.submit(child_spec)
    with session_scope(stack.factory) as s:  # what POST /v1/jobs/{id}/retrain records beside the job
        promotion.add_retrain(s, child_job_id=child, parent_job_id=parent, owner_id=stack.owner_id(),
                              target=spec["target"]["model"], batch_sizes=[1, 4])
    job = stack.wait_status(child, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message)

    def decided(_job: object) -> bool:
        return any(e.kind == "promotion" for e in stack.rows(JobEvent, child))

    stack.wait(child, decided, timeout=120, what="the promotion decision")
    with session_scope(stack.factory) as s:
        rows = promotion.decisions(s, stack.owner_id(), job_id=child)
        assert len(rows) == 1
        d = promotion.decision_out(rows[0])
        assert promotion.current_drafts(s, stack.owner_id()) == []  # nothing measured: nothing promoted
    assert (d["decision"], d["compared_with"], d["batch_sizes"]) == ("not_measured", parent, [1, 4])
    assert d["numbers"]["jobs"] == {"child": child, "parent": parent}
    assert d["numbers"]["checkpoint_step"] == job.best_checkpoint_step
    assert "head_dim 16" in d["reason"] or "vLLM is not installed" in d["reason"], d["reason"]
    event = next(e for e in stack.rows(JobEvent, child) if e.kind == "promotion")
    assert event.data["decision"] == "not_measured" and event.data["decision_id"] == d["id"]
