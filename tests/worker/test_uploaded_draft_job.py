"""An uploaded draft through the worker (issue 38): a tiny job's export is uploaded through the API
(`POST /v1/drafts`, the real unpack and validator), and a job of `draft.init_from: draft:<id>` run by the real
trainer starts from those weights: its first-step loss is well below the from-scratch job's on the same data
and seed (tests/worker/test_warm_start_job.py does the same for `job:<parent>`)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.worker.test_warm_start_job import _first_loss

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_job_starts_from_an_uploaded_draft(make_stack, tiny_target_path) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app
    from peagle.spec import preset
    from service.db import repo
    from service.db.session import session_scope

    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    spec = preset("tiny").model_dump(mode="json")
    spec["optim"]["max_steps"] = 8
    spec["eval"]["prompt_sets"] = []
    scratch = stack.submit(spec)
    job = stack.wait_status(scratch, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message)
    export = Path(job.artifact_dir) / "export"
    assert (export / "config.json").is_file(), sorted(p.name for p in Path(job.artifact_dir).iterdir())

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(export.iterdir()):
            tar.add(f, arcname=f"my-draft/{f.name}")
    with session_scope(stack.factory) as s:
        key = repo.create_key(s, "tests", ["write"])[1]
    with TestClient(create_app(stack.settings)) as api:
        r = api.post("/v1/drafts", files={"file": ("my-draft.tar.gz", buf.getvalue(), "application/gzip")},
                     headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text
    draft_id = r.json()["id"]

    child_spec = json.loads(json.dumps(spec))
    child_spec["draft"]["init_from"] = f"draft:{draft_id}"
    child = stack.submit(child_spec)
    job = stack.wait_status(child, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message)
    assert _first_loss(stack, child) < 0.75 * _first_loss(stack, scratch)  # same data and seed, trained start
    assert job.resolved_spec["draft"]["init_from"] == f"draft:{draft_id}"
    seen = json.dumps([job.resolved_spec, job.provenance])
    assert str(stack.settings.resolved_dataset_root()) not in seen  # the draft's folder is not shown
