"""A promotion names a complete checkpoint on disk (issue 46, item 7): a forced promotion of a step that does
not exist (`999999`), or whose folder has no `COMPLETE` marker, is a 422 naming the step and the job, and
nothing is recorded. Before: it was recorded as the current draft, and later comparisons measured against
a folder that was never there. The worker's side (`worker.promotion.checkpoint_dir`) gives no folder for
such a step either, so a current draft stored before this check is `not_measured` with the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.db import promotion
from service.db.models import Job
from service.db.session import session_scope
from service.settings import Settings
from tests.api.test_retrain import EXPORT_CONFIG, NEW_DATA, _succeeded
from worker.promotion import after_success, checkpoint_dir


def _decisions(sim: Any, owner_id: int = 1) -> list[Any]:
    with session_scope(sim.sessions) as s:
        return [promotion.decision_out(d) for d in promotion.decisions(s, owner_id)]


@pytest.mark.parametrize("step", [999999, 7])
def test_a_forced_promotion_of_a_missing_or_incomplete_checkpoint_is_refused(
        client: TestClient, sim: Any, alice: dict, submit: Any, step: int) -> None:
    job = _succeeded(client, sim, alice, submit)
    if step == 7:  # a folder (and its row) without the marker the trainer writes last: an interrupted save
        d = sim.checkpoint(job["id"], 7, {"model.safetensors": b"\0" * 16}, best=False)
        (d / "config.json").write_text(json.dumps(EXPORT_CONFIG))
        (d / "COMPLETE").unlink()
    r = client.post("/v1/promotion/promote", headers=alice, json={"job_id": job["id"], "checkpoint_step": step})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "/checkpoint_step", err
    assert job["id"] in err["message"] and f"step {step}" in err["message"], err
    assert _decisions(sim) == []
    assert client.get("/v1/promotion/current", headers=alice).json()["data"] == []


def test_a_forced_promotion_of_a_complete_checkpoint_still_works(client: TestClient, sim: Any, alice: dict,
                                                                 submit: Any) -> None:
    job = _succeeded(client, sim, alice, submit)
    r = client.post("/v1/promotion/promote", headers=alice, json={"job_id": job["id"], "checkpoint_step": 4})
    assert r.status_code == 201, r.text
    r = client.post("/v1/promotion/promote", headers=alice, json={"job_id": job["id"]})  # its best: step 4
    assert r.status_code == 201, r.text
    cur = client.get("/v1/promotion/current", headers=alice).json()["data"]
    assert [(c["job_id"], c["checkpoint_step"]) for c in cur] == [(job["id"], 4)]


def test_a_succeeded_job_without_a_checkpoint_cannot_be_promoted(client: TestClient, sim: Any, alice: dict,
                                                                 submit: Any) -> None:
    job = submit(client, alice)
    sim.set(job["id"], status="succeeded")
    r = client.post("/v1/promotion/promote", headers=alice, json={"job_id": job["id"]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "/checkpoint_step", r.text
    assert job["id"] in r.json()["error"]["message"]
    assert _decisions(sim) == []


def test_the_worker_finds_no_folder_for_a_missing_step(client: TestClient, sim: Any, alice: dict, submit: Any,
                                                       settings: Settings) -> None:
    job = _succeeded(client, sim, alice, submit)
    with session_scope(sim.sessions) as s:
        row = s.get(Job, job["id"])
        assert row is not None
        assert checkpoint_dir(s, settings, row, None) == Path(sim.settings.resolved_artifact_root()) / job["id"] \
            / "checkpoints" / "step_000004"
        assert checkpoint_dir(s, settings, row, 4) is not None
        assert checkpoint_dir(s, settings, row, 999999) is None


def test_a_current_draft_at_a_missing_step_is_not_measured_against(client: TestClient, sim: Any, alice: dict,
                                                                   submit: Any, settings: Settings) -> None:
    """A current draft stored before the check (its step never existed): the child's decision names it and
    measures nothing (`measure` would fail the test if it were called)."""
    parent = _succeeded(client, sim, alice, submit)
    legacy = _succeeded(client, sim, alice, submit)
    target = parent["spec"]["target"]["model"]
    with session_scope(sim.sessions) as s:  # what the unchecked route stored
        promotion.record_decision(s, owner_id=1, target=target, job_id=legacy["id"], decision="forced",
                                  decided_by="alice", checkpoint_step=999999)
    r = client.post(f"/v1/jobs/{parent['id']}/retrain", headers=alice, json=NEW_DATA)
    assert r.status_code == 201, r.text
    child = r.json()["id"]
    sim.set(child, status="succeeded")
    d = sim.checkpoint(child, 2, {"model.safetensors": b"\0" * 16})
    (d / "config.json").write_text(json.dumps(EXPORT_CONFIG))

    def measure(*_: Any, **__: Any) -> Any:
        raise AssertionError("nothing may be measured against a checkpoint that does not exist")

    decided = after_success(settings, sim.sessions, child, measure=measure, holder="test")
    assert decided is not None
    out = promotion.decision_out(decided)
    assert out["decision"] == "not_measured", out
    assert f"current ({legacy['id']})" in out["reason"] and "step 999999" in out["reason"], out["reason"]
