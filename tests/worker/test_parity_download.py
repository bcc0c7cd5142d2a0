"""Issue 38 part 5: a checkpoint downloaded through the API carries its served-parity record.

The real trainer (tiny preset) measures the best checkpoint with the reference decoder, which writes the
parity record (`peagle.eval.parity`) into RUN/export and into that checkpoint's folder; the `eval` event adds
it to the checkpoint's file list, so the files route and the archive serve it (docs/export.md 7).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from tests.worker.test_worker_real import submit

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OVERRIDES = {"data": {"eval_samples": 0}, "optim": {"max_steps": 4}, "checkpoints": {"every_steps": 2},
             "eval": {"engine": "reference", "prompt_sets": [{"name": "humaneval", "num_prompts": 1}],
                      "max_new_tokens": 4}}


def test_best_checkpoint_download_carries_parity_json(make_stack, api, tmp_path):
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    client = api(stack)
    job = submit(client, OVERRIDES)
    done = stack.wait_status(job, "succeeded", "failed", timeout=300)
    assert done.status == "succeeded", (done.error_code, done.error_message, stack.logs())

    exported = (stack.settings.resolved_artifact_root() / job / "export" / "parity.json").read_bytes()
    best = next(c for c in client.get(f"/v1/jobs/{job}/checkpoints").json()["data"] if c["is_best"])
    entry = next((f for f in best["files"] if f["path"] == "parity.json"), None)
    assert entry is not None, best["files"]
    assert entry["sha256"] == hashlib.sha256(exported).hexdigest() and entry["size"] == len(exported)

    r = client.get(entry["url"])
    assert r.status_code == 200 and r.content == exported
    assert r.headers["X-Checksum-SHA256"] == entry["sha256"]

    # the archive (`peagle jobs download`'s folder) holds it next to the weights
    r = client.get(f"/v1/jobs/{job}/checkpoints/{best['step']}/archive")
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(tmp_path / "draft", filter="data")
    (folder,) = (tmp_path / "draft").iterdir()
    assert {"config.json", "model.safetensors", "parity.json"} <= {p.name for p in folder.iterdir()}
    assert (folder / "parity.json").read_bytes() == exported
    assert json.loads(exported)["checkpoint"] == f"step_{best['step']:06d}"


def test_eval_files_merge_into_the_checkpoint_by_path(factory) -> None:
    """The collector carries an eval event's `files`; ingest adds them to the checkpoint row (same path:
    replaced, not listed twice)."""
    import sqlalchemy as sa

    from service.db import lease as L
    from service.db import progress as P
    from service.db.models import Checkpoint
    from service.db.session import session_scope
    from tests.worker.conftest import new_job
    from worker.progress import ProgressCollector

    job_id = new_job(factory)
    with session_scope(factory) as s:
        lease = L.claim_job(s, job_id, owner="w1", lease_seconds=60.0, artifact_dir="/tmp/x")
    assert lease is not None
    weights = {"path": "model.safetensors", "size": 3, "sha256": "a" * 64}
    c = ProgressCollector()
    c.add({"type": "event", "kind": "checkpoint", "step": 4, "files": [weights], "is_best": True})
    for sha in ("b" * 64, "c" * 64):
        c.add({"type": "event", "kind": "eval", "checkpoint_step": 4, "metrics": {"acceptance_length": 1.3},
               "files": [{"path": "parity.json", "size": 9, "sha256": sha}]})
    with session_scope(factory) as s:
        P.ingest(s, lease, c.take())
    with factory() as s:
        ck = s.scalars(sa.select(Checkpoint).where(Checkpoint.job_id == job_id)).one()
    assert ck.files == [weights, {"path": "parity.json", "size": 9, "sha256": "c" * 64}]
