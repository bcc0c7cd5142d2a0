"""A warm-started job through the worker: the real trainer of `job:<parent>` starts from the parent's best
checkpoint (the worker hands it the folder), and what the owner reads names the parent, never its folder."""

from __future__ import annotations

import json

import pytest

from service.db.models import JobMetric

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _first_loss(stack, job_id: str) -> float:
    rows = [m for m in stack.rows(JobMetric, job_id) if "loss" in m.values]
    return float(min(rows, key=lambda m: m.step).values["loss"])


def test_a_job_continues_from_its_parents_best_checkpoint(make_stack, tiny_target_path) -> None:
    from peagle.spec import preset

    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    spec = preset("tiny").model_dump(mode="json")
    spec["optim"]["max_steps"] = 8
    spec["eval"]["prompt_sets"] = []
    parent = stack.submit(spec)
    job = stack.wait_status(parent, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message)

    child_spec = json.loads(json.dumps(spec))
    child_spec["draft"]["init_from"] = f"job:{parent}"
    child = stack.submit(child_spec)
    job = stack.wait_status(child, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message)
    assert _first_loss(stack, child) < 0.75 * _first_loss(stack, parent)  # same data and seed, trained start
    assert job.resolved_spec["draft"]["init_from"] == f"job:{parent}"
    warm = job.provenance["trainer"]["resolved"]["init_from"]
    assert warm["step"] == stack.job(parent).best_checkpoint_step
    seen = json.dumps([job.resolved_spec, job.provenance])
    assert str(stack.settings.resolved_artifact_root()) not in seen


def test_a_parent_that_is_not_the_owners_fails_the_job_naming_the_field(make_stack, spec_for) -> None:
    from service.db.jobs import create_job
    from service.db.models import Owner
    from service.db.session import session_scope
    from service.queue import make_producer

    stack = make_stack("embedded")
    stack.start_worker()
    parent = stack.submit(spec_for())
    stack.wait_status(parent, "succeeded", "failed", timeout=120)
    spec = spec_for()
    spec["draft"]["init_from"] = f"job:{parent}"
    with session_scope(stack.factory) as s:
        other = Owner(name="someone-else")
        s.add(other)
        s.flush()
        other_id = int(other.id)
    stack.producer = stack.producer or make_producer(stack.settings)
    with stack.factory() as s:  # past the API (which refuses it): the worker still checks the owner
        job = create_job(s, owner_id=other_id, spec=spec, name="", tags=[], queue=stack.queue, max_restarts=0,
                         send=stack.producer.send_train)
    failed = stack.wait_status(job.id, "failed", "succeeded", timeout=120)
    assert failed.error_code == "spec_invalid"
    assert failed.error_message == f"draft.init_from: no job {parent!r}"
