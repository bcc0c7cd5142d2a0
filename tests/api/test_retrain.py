"""Retrain (`POST /v1/jobs/{id}/retrain`) and promotion (`/v1/promotion/*`) through the API, on a real DB.

The worker's part (the measurement at a child's end) is in tests/worker/test_retrain_stack.py; the rule
itself in tests/unit/eval/test_promotion.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.db import promotion, webhooks
from service.db.models import JobEvent
from service.db.session import session_scope

NEW_DATA = {"sources": [{"path": "builtin:sharegpt", "max_samples": 8}]}


#: The export config of a `tiny` preset draft, as the API's warm-start check reads it.
EXPORT_CONFIG = {
    "architectures": ["PEagleSpeculator"], "draft_vocab_size": 512, "mask_token_id": 3,
    "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "speculators_model_type": "peagle",
    "speculators_config": {"verifier": {"name_or_path": "builtin:tiny-llama"},
                           "proposal_methods": [{"speculative_tokens": 3}]},
    "transformer_layer_config": {"hidden_size": 64, "vocab_size": 49152, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "num_key_value_heads": 2}}


def _succeeded(client: TestClient, sim: Any, headers: dict[str, str], submit: Any) -> dict[str, Any]:
    """A tiny job of the caller, succeeded, its best checkpoint at step 4."""
    job = submit(client, headers)
    sim.set(job["id"], status="succeeded")
    d = sim.checkpoint(job["id"], 4, {"model.safetensors": b"\0" * 16})
    (d / "config.json").write_text(json.dumps(EXPORT_CONFIG))
    return job


def test_retrain_creates_a_warm_started_child_with_the_new_data(client: TestClient, sim: Any, alice: dict,
                                                                submit: Any) -> None:
    parent = _succeeded(client, sim, alice, submit)
    r = client.post(f"/v1/jobs/{parent['id']}/retrain", headers=alice,
                    json={**NEW_DATA, "overrides": {"optim": {"max_steps": 3}}, "promotion_batch_sizes": [8, 1, 8]})
    assert r.status_code == 201, r.text
    child = r.json()
    assert child["id"] != parent["id"] and child["status"] == "queued"
    spec = child["spec"]
    assert spec["draft"]["init_from"] == f"job:{parent['id']}"
    assert spec["data"]["sources"] == [{"path": "builtin:sharegpt", "format": "auto", "max_samples": 8, "skip": 0}]
    assert spec["optim"]["max_steps"] == 3
    assert spec["target"] == parent["spec"]["target"]
    with session_scope(sim.sessions) as s:
        link = promotion.retrain_of(s, child["id"])
        assert link is not None
        assert (link.parent_job_id, link.target, link.batch_sizes) == (parent["id"], spec["target"]["model"], [1, 8])


def test_retrain_from_a_named_step_and_an_uploaded_dataset(client: TestClient, sim: Any, alice: dict,
                                                           submit: Any) -> None:
    parent = _succeeded(client, sim, alice, submit)
    ds = client.post("/v1/datasets", headers=alice, files={"file": (
        "d.jsonl", b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')})
    assert ds.status_code == 201, ds.text
    r = client.post(f"/v1/jobs/{parent['id']}/retrain", headers=alice,
                    json={"datasets": [ds.json()["id"]], "checkpoint_step": 4})
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    assert spec["draft"]["init_from"] == f"job:{parent['id']}@step_4"
    assert [s["path"] for s in spec["data"]["sources"]] == [f"dataset:{ds.json()['id']}"]


def test_retrain_refuses_another_owners_job_unfinished_jobs_and_no_data(client: TestClient, sim: Any, alice: dict,
                                                                        bob: dict, submit: Any) -> None:
    parent = _succeeded(client, sim, alice, submit)
    r = client.post(f"/v1/jobs/{parent['id']}/retrain", headers=bob, json=NEW_DATA)
    assert r.status_code == 404, r.text
    queued = submit(client, alice)
    r = client.post(f"/v1/jobs/{queued['id']}/retrain", headers=alice, json=NEW_DATA)
    assert r.status_code == 409, r.text
    assert "only a succeeded job can be retrained" in r.json()["error"]["message"]
    r = client.post(f"/v1/jobs/{parent['id']}/retrain", headers=alice, json={})
    assert r.status_code == 422 and r.json()["error"]["param"] == "/datasets", r.text
    r = client.post(f"/v1/jobs/{parent['id']}/retrain", headers=alice, json={**NEW_DATA, "promotion_batch_sizes": []})
    assert r.status_code == 422, r.text
    r = client.post(f"/v1/jobs/{parent['id']}/retrain", headers=alice,
                    json={**NEW_DATA, "overrides": {"optim": {"max_steps": -1}}})
    assert r.status_code == 422 and "optim" in r.json()["error"]["param"], r.text
    with session_scope(sim.sessions) as s:
        assert promotion.decisions(s, 1) == []


def test_force_promote_undo_and_the_log(client: TestClient, sim: Any, alice: dict, bob: dict, submit: Any) -> None:
    first = _succeeded(client, sim, alice, submit)
    second = _succeeded(client, sim, alice, submit)
    target = first["spec"]["target"]["model"]
    assert client.get("/v1/promotion/current", headers=alice).json()["data"] == []

    r = client.post("/v1/promotion/promote", headers=alice, json={"job_id": first["id"]})
    assert r.status_code == 201, r.text
    assert r.json()["decision"] == "forced" and r.json()["forced"] and r.json()["current_after"] == first["id"]
    r = client.post("/v1/promotion/promote", headers=alice, json={"job_id": second["id"]})
    assert r.status_code == 201 and r.json()["current_before"] == first["id"], r.text
    cur = client.get("/v1/promotion/current", headers=alice, params={"target": target}).json()["data"]
    assert [(c["target"], c["job_id"], c["checkpoint_step"]) for c in cur] == [(target, second["id"], 4)]

    # another tenant sees none of it and cannot act on it
    assert client.get("/v1/promotion/current", headers=bob).json()["data"] == []
    assert client.get("/v1/promotion/decisions", headers=bob).json()["data"] == []
    assert client.post("/v1/promotion/promote", headers=bob, json={"job_id": first["id"]}).status_code == 404
    assert client.post("/v1/promotion/undo", headers=bob, json={"target": target}).status_code == 409

    r = client.post("/v1/promotion/undo", headers=alice, json={"target": target})
    assert r.status_code == 200, r.text
    assert (r.json()["decision"], r.json()["job_id"], r.json()["current_after"]) == ("undone", second["id"], first["id"])
    cur = client.get("/v1/promotion/current", headers=alice).json()["data"]
    assert [(c["job_id"], c["checkpoint_step"]) for c in cur] == [(first["id"], 4)]
    r = client.post("/v1/promotion/undo", headers=alice, json={"target": target})
    assert r.status_code == 200 and r.json()["current_after"] is None, r.text
    assert client.get("/v1/promotion/current", headers=alice).json()["data"] == []
    assert client.post("/v1/promotion/undo", headers=alice, json={"target": target}).status_code == 409

    log = client.get("/v1/promotion/decisions", headers=alice, params={"target": target}).json()["data"]
    assert [d["decision"] for d in log] == ["undone", "undone", "forced", "forced"]
    about = client.get("/v1/promotion/decisions", headers=alice, params={"job_id": first["id"]}).json()["data"]
    assert {d["job_id"] for d in about} == {first["id"]}

    queued = submit(client, alice)
    r = client.post("/v1/promotion/promote", headers=alice, json={"job_id": queued["id"]})
    assert r.status_code == 409, r.text
    # a target name with a NUL is refused before the database sees it (PostgreSQL text holds none)
    assert client.get("/v1/promotion/current", headers=alice, params={"target": "a\x00"}).status_code == 422
    assert client.post("/v1/promotion/undo", headers=alice, json={"target": "a\x00"}).status_code == 422


@pytest.mark.parametrize("decision,etype", [("promoted", "draft.promoted"), ("declined", "draft.promotion_declined"),
                                            ("not_measured", "draft.promotion_declined")])
def test_a_decision_is_a_job_event_and_a_webhook(client: TestClient, sim: Any, alice: dict, submit: Any,
                                                 decision: str, etype: str) -> None:
    job = _succeeded(client, sim, alice, submit)
    r = client.post("/v1/webhooks", headers=alice, json={"url": "https://hooks.example.com/x",
                                                         "events": ["draft.promoted", "draft.promotion_declined",
                                                                    "draft.promotion_undone"]})
    assert r.status_code == 201, r.text
    with session_scope(sim.sessions) as s:
        row = promotion.record_decision(s, owner_id=sim.job(job["id"]).owner_id, target="builtin:tiny-llama",
                                        job_id=job["id"], decision=decision, decided_by="measurement",
                                        reason="why", batch_sizes=[1], numbers={"child": {"acceptance_length": 2.0}})
        decision_id = row.id
    with session_scope(sim.sessions) as s:
        webhooks.fan_out(s)
    deliveries = client.get(f"/v1/webhooks/{r.json()['id']}/deliveries", headers=alice).json()["data"]
    sent = [d["payload"] for d in deliveries if d["event_type"].startswith("draft.")]
    assert [p["type"] for p in sent] == [etype]
    assert sent[0]["data"]["decision"] == decision and sent[0]["data"]["decision_id"] == decision_id
    assert sent[0]["data"]["job_id"] == job["id"]
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=alice).json()["data"]
    assert any(e["kind"] == "promotion" and e["data"]["decision"] == decision for e in events)
    with session_scope(sim.sessions) as s:
        assert s.query(JobEvent).filter_by(job_id=job["id"], kind="promotion").count() == 1
