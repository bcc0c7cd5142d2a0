"""Issue 18 item 2: an uploaded dataset is a prompt set. A real job (tiny preset, the real trainer through
the worker) measures AL on `dataset:<id>` (each conversation up to its first answer) beside HumanEval, and
what the owner reads names the dataset, never its file on the server."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from service.db.models import Checkpoint, JobEvent, JobLog

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_job_measures_al_on_an_uploaded_dataset(make_stack, tmp_path, tiny_target_path):
    from peagle.spec import preset

    data = tmp_path / "owner-a-secret-chats.json"
    data.write_text(json.dumps([
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": f"Question {i}?"},
                           {"from": "gpt", "value": f"Answer {i}."}]} for i in range(4)]))
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    ds_id = stack.add_dataset(data)
    spec = preset("tiny").model_dump(mode="json")
    spec["optim"]["max_steps"] = 4
    spec["eval"]["prompt_sets"] = [{"name": "humaneval", "num_prompts": 1},
                                   {"name": f"dataset:{ds_id}", "num_prompts": 3}]
    job_id = stack.submit(spec)
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message)

    events = stack.rows(JobEvent, job_id)
    final = [e.data for e in events if e.kind == "eval" and "prompt_sets" in (e.data.get("evaluation") or {})]
    assert final, [e.kind for e in events]
    sets = final[-1]["evaluation"]["prompt_sets"]
    assert set(sets) == {"humaneval", f"dataset:{ds_id}"}
    assert sets[f"dataset:{ds_id}"]["num_prompts"] == 3 and sets[f"dataset:{ds_id}"]["acceptance_length"] >= 1.0
    with stack.factory() as s:
        evaluations = [c.evaluation for c in s.scalars(sa.select(Checkpoint).where(Checkpoint.job_id == job_id))]
    seen = json.dumps([e.data for e in events] + [e.message for e in events]
                      + [r.message for r in stack.rows(JobLog, job_id)] + evaluations + [job.resolved_spec])
    assert f"dataset:{ds_id}" in seen and str(data) not in seen and "owner-a-secret" not in seen


def test_a_prompt_set_dataset_that_is_gone_fails_the_job_naming_the_field(make_stack, spec_for):
    stack = make_stack("embedded")
    stack.start_worker()
    spec = spec_for()
    spec["eval"] = {**spec.get("eval", {}), "prompt_sets": [{"name": "dataset:ds_gone", "num_prompts": 2}]}
    job = stack.wait_status(stack.submit(spec), "failed", "succeeded", timeout=60)
    assert job.error_code == "data_invalid" and "eval.prompt_sets.0.name: dataset 'ds_gone' not found" in \
        job.error_message, (job.error_code, job.error_message)
