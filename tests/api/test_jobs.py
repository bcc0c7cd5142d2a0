"""Jobs API on SQLite and PostgreSQL: create, validation, idempotency, quotas, state machine, pages, access."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.main import create_app
from peagle.spec.hardware import auto_target_dtype, cpu_facts
from service.db import states
from service.db.models import Job, JobMetric
from service.db.session import session_scope

Sim = Any


def test_create_get_list(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    job = submit(client, alice, preset="tiny", overrides={"optim": {"lr": 0.002}}, tags=["a", "b"], name="first")
    assert job["status"] == "queued" and job["id"].startswith("job_") and len(job["id"]) == 30
    assert job["spec"]["optim"]["lr"] == 0.002 and job["tags"] == ["a", "b"]
    got = client.get(f"/v1/jobs/{job['id']}", headers=alice).json()
    assert got["queue_position"] == 0 and got["event_seq"] == 1
    ev = client.get(f"/v1/jobs/{job['id']}/events", headers=alice).json()
    assert [e["seq"] for e in ev["data"]] == [1] and ev["data"][0]["data"]["status"] == "queued"
    lst = client.get("/v1/jobs", headers=alice).json()
    assert [j["id"] for j in lst["data"]] == [job["id"]] and lst["has_more"] is False
    assert "spec" not in lst["data"][0]


def test_validation_lists_every_problem(client: TestClient, alice: dict) -> None:
    spec = {"target": {"model": "x"}, "peagle": {"num_depths": 0, "down_sample_ratio": 0.1,
                                                 "down_sample_ratio_min": 0.5}, "bogus": 1}
    r = client.post("/v1/jobs", json={"spec": spec}, headers=alice)
    assert r.status_code == 422
    err = r.json()["error"]
    params = {d["param"] for d in err["details"]}
    assert err["code"] == "spec_invalid"
    assert {"/peagle/num_depths", "/bogus"} <= params
    # FastAPI's own validation errors use the same envelope with pointers
    r = client.post("/v1/jobs", json={"spec": 3, "extra": True}, headers=alice)
    assert r.status_code == 422
    assert {d["param"] for d in r.json()["error"]["details"]} >= {"/spec", "/extra"}
    r = client.get("/v1/jobs?limit=0", headers=alice)
    assert r.status_code == 422 and r.json()["error"]["details"][0]["param"] == "/limit"


def test_cross_field_problem_pointer(client: TestClient, alice: dict) -> None:
    r = client.post("/v1/jobs", json={"preset": "tiny", "overrides": {
        "peagle": {"down_sample_ratio": 0.1, "down_sample_ratio_min": 0.5}}}, headers=alice)
    assert r.status_code == 422
    assert r.json()["error"]["details"] == [{"param": "/peagle/down_sample_ratio_min",
                                             "message": r.json()["error"]["details"][0]["message"]}]


def test_auth_and_scopes(client: TestClient, sim: Sim) -> None:
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    reader = {"Authorization": f"Bearer {sim.key('carol', 'read')}"}
    assert client.get("/v1/jobs", headers=reader).status_code == 200
    r = client.post("/v1/jobs", json={"preset": "tiny"}, headers=reader)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_revoked_key(client: TestClient, sim: Sim) -> None:
    from service.db import repo
    from service.db.session import session_scope

    key = sim.key("dave", "write")
    h = {"Authorization": f"Bearer {key}"}
    assert client.get("/v1/jobs", headers=h).status_code == 200
    with session_scope(sim.sessions) as s:
        assert repo.revoke_key(s, repo.parse_key(key))
    assert client.get("/v1/jobs", headers=h).status_code == 200  # cached for AUTH_CACHE_S
    client.app.state.peagle.principals.entries.clear()  # as if AUTH_CACHE_S had passed
    assert client.get("/v1/jobs", headers=h).status_code == 401


def test_cross_owner_is_404(client: TestClient, alice: dict, bob: dict, sim: Sim, submit: Any) -> None:
    job = submit(client, alice)
    sim.checkpoint(job["id"], 4, {"model.safetensors": b"x" * 10})
    for path in ("", "/events", "/metrics", "/logs", "/checkpoints", "/checkpoints/4/serve",
                 "/checkpoints/4/files/model.safetensors", "/checkpoints/4/archive"):
        r = client.get(f"/v1/jobs/{job['id']}{path}", headers=bob)
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == "not_found"
    for action in ("cancel", "pause", "resume", "clone"):
        assert client.post(f"/v1/jobs/{job['id']}/{action}", headers=bob).status_code == 404
    assert client.get("/v1/jobs", headers=bob).json()["data"] == []


def test_idempotency(client: TestClient, alice: dict) -> None:
    h = {**alice, "Idempotency-Key": "k1"}
    a = client.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
    b = client.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
    assert a.status_code == b.status_code == 201
    assert a.json() == b.json() and b.headers["Idempotent-Replayed"] == "true"
    c = client.post("/v1/jobs", json={"preset": "demo"}, headers=h)
    assert c.status_code == 409 and c.json()["error"]["code"] == "idempotency_mismatch"
    assert len(client.get("/v1/jobs", headers=alice).json()["data"]) == 1


def test_dry_run_estimate(client: TestClient, alice: dict) -> None:
    r = client.post("/v1/jobs?dry_run=true", json={"preset": "demo", "overrides": {"resources": {
        "capture": "offline"}}}, headers=alice)
    assert r.status_code == 200, r.text
    est = r.json()
    assert est["object"] == "estimate" and est["optimizer_steps"] > 0 and est["tokens"] > 0
    # offline: the whole dump (training and held-out tokens) at the bytes per token of the resolved engine
    assert est["hidden_state_bytes"] == est["offline_dump_bytes"] >= est["tokens"] * est["feature_bytes_per_token"]
    # vllm / hf on CPU: the final state (and through vLLM the aux states too) in the target's dtype, which
    # `auto` makes bf16 only where this CPU runs it natively (docs/testing.md 3)
    assert est["target_dtype"] == auto_target_dtype(device="cpu", facts=cpu_facts())
    width = 2 if est["target_dtype"] == "bfloat16" else 4
    assert est["feature_bytes_per_token"] in (4 * 576 * width + 24, 3 * 576 * 4 + 576 * width + 24)
    assert est["queue_position"] == 0
    assert client.get("/v1/jobs", headers=alice).json()["data"] == []


def test_state_machine(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    job = submit(client, alice)
    jid = job["id"]
    assert client.post(f"/v1/jobs/{jid}/pause", headers=alice).json()["status"] == "paused"
    assert client.post(f"/v1/jobs/{jid}/pause", headers=alice).json()["status"] == "paused"  # idempotent
    assert client.post(f"/v1/jobs/{jid}/resume", headers=alice).json()["status"] == "queued"
    sim.set(jid, status="running")
    r = client.post(f"/v1/jobs/{jid}/pause", headers=alice).json()
    assert r["status"] == "pausing" and r["desired_state"] == "paused"
    r = client.post(f"/v1/jobs/{jid}/resume", headers=alice)
    assert r.status_code == 409 and "pausing" in r.json()["error"]["message"]
    assert r.json()["error"]["details"] == [{"current_state": "pausing", "param": None, "message": ""}] or \
        r.json()["error"]["details"][0]["current_state"] == "pausing"
    assert client.post(f"/v1/jobs/{jid}/cancel", headers=alice).json()["status"] == "cancelling"
    sim.set(jid, status="cancelled")
    assert client.post(f"/v1/jobs/{jid}/cancel", headers=alice).json()["status"] == "cancelled"
    for action in ("pause", "resume"):
        r = client.post(f"/v1/jobs/{jid}/{action}", headers=alice)
        assert r.status_code == 409 and r.json()["error"]["code"] == "illegal_transition"
    clone = client.post(f"/v1/jobs/{jid}/clone", json={"overrides": {"optim": {"seed": 7}}}, headers=alice)
    assert clone.status_code == 201 and clone.json()["spec"]["optim"]["seed"] == 7
    assert clone.json()["status"] == "queued" and clone.json()["id"] != jid


def test_state_table_is_consistent() -> None:
    for s, targets in states.TRANSITIONS.items():
        assert (not targets) == (s in states.TERMINAL)
    with pytest.raises(states.IllegalTransition, match="succeeded"):
        states.action_target("cancel", "succeeded")
    assert states.action_target("cancel", "queued") == "cancelled"


def test_pagination_and_filters(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    ids = [submit(client, alice, preset="tiny", name=f"run {i}", tags=["even" if i % 2 == 0 else "odd"])["id"]
           for i in range(5)]
    sim.set(ids[0], status="failed")
    seen, after = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 2, **({"after": after} if after else {})}, headers=alice).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["next_after"]
    assert seen == ids[::-1]
    assert {j["id"] for j in client.get("/v1/jobs?tag=even", headers=alice).json()["data"]} == set(ids[0::2])
    assert [j["id"] for j in client.get("/v1/jobs?status=failed", headers=alice).json()["data"]] == [ids[0]]
    assert [j["id"] for j in client.get("/v1/jobs?q=RUN 3", headers=alice).json()["data"]] == [ids[3]]
    assert client.get("/v1/jobs?q=%25", headers=alice).json()["data"] == []
    r = client.get("/v1/jobs", params={"created_after": "2100-01-01T00:00:00Z"}, headers=alice)
    assert r.json()["data"] == []
    assert client.get("/v1/jobs?status=bogus", headers=alice).status_code == 422


def test_quota_queued_jobs(settings_factory: Any, sim: Sim, submit: Any) -> None:
    settings = settings_factory(max_queued_jobs=2)
    with TestClient(create_app(settings)) as c:
        h = {"Authorization": f"Bearer {sim.key('erin', 'write')}"}
        submit(c, h)
        submit(c, h)
        r = c.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
        assert r.status_code == 429 and r.headers["Retry-After"] == "30"
        assert r.json()["error"]["code"] == "quota_exceeded"


def test_metrics_logs_pages(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    jid = submit(client, alice)["id"]
    sim.emit(jid, "metrics", 200, start_step=1)
    sim.emit(jid, "logs", 30)
    r = client.get(f"/v1/jobs/{jid}/metrics", params={"keys": "loss", "step_from": 10, "step_to": 19},
                   headers=alice).json()
    assert [p["step"] for p in r["data"]] == list(range(10, 20)) and set(r["data"][0]["values"]) == {"loss"}
    r = client.get(f"/v1/jobs/{jid}/metrics", params={"max_points": 40, "keys": "loss"}, headers=alice).json()
    steps = [p["step"] for p in r["data"]]
    assert r["downsampled"] and r["total_points"] == 200 and len(steps) <= 40
    assert steps[0] == 1 and steps[-1] == 200 and steps == sorted(steps)
    r = client.get(f"/v1/jobs/{jid}/logs?tail=5", headers=alice).json()
    assert [x["message"] for x in r["data"]] == [f"line {i}" for i in range(26, 31)]
    r = client.get(f"/v1/jobs/{jid}/logs?after=10&limit=5", headers=alice).json()
    assert [x["seq"] for x in r["data"]] == [11, 12, 13, 14, 15] and r["has_more"]


def test_ops_endpoints(client: TestClient, alice: dict) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"database": True, "broker": True}
    client.get("/v1/jobs", headers=alice)
    m = client.get("/metrics").text
    assert 'peagle_http_requests_total{method="GET",route="/v1/jobs",status="200"}' in m
    presets = client.get("/v1/presets").json()["data"]
    assert {p["name"] for p in presets} >= {"tiny", "demo"}
    assert "properties" in client.get("/v1/spec/schema").json()
    ops = [op["operationId"] for p in client.get("/openapi.json").json()["paths"].values() for op in p.values()]
    assert len(ops) == len(set(ops)) and all("-" in o for o in ops)


def test_browser_session_and_stream_token(client: TestClient, sim: Sim, submit: Any) -> None:
    key = sim.key("frank", "write")
    r = client.post("/v1/auth/session", json={"api_key": key})
    assert r.status_code == 200 and "httponly" in r.headers["set-cookie"].lower()
    assert client.get("/v1/jobs").status_code == 200  # cookie
    jid = submit(client, {"Authorization": f"Bearer {key}"})["id"]
    tok = client.post("/v1/auth/stream-token", json={"job_id": jid}).json()["token"]
    client.delete("/v1/auth/session")
    client.cookies.clear()
    assert client.get("/v1/jobs").status_code == 401
    assert client.post("/v1/auth/session", json={"api_key": key + "x"}).status_code == 401
    assert client.get(f"/v1/jobs/{jid}/events?token={tok}").status_code == 401  # token only on streams
    sim.set(jid, status="succeeded")
    # a token the signed-out session minted died with it (tests/api/test_token_revocation.py)
    assert client.get(f"/v1/jobs/{jid}/events/stream?token={tok}").status_code == 401
    tok = client.post("/v1/auth/stream-token", json={"job_id": jid},
                      headers={"Authorization": f"Bearer {key}"}).json()["token"]  # an API key's token
    with client.stream("GET", f"/v1/jobs/{jid}/events/stream?token={tok}") as s:
        assert s.status_code == 200
        assert "event: end" in s.read().decode()
    assert client.get(f"/v1/jobs/{jid}/events/stream?token=bad.token").status_code == 401


def test_metrics_downsampling_keeps_spikes_and_sparse_eval_rows(
    client: TestClient, alice: dict, sim: Sim, submit: Any
) -> None:
    jid = submit(client, alice)["id"]
    sim.emit(jid, "metrics", 500, start_step=1)
    with session_scope(sim.sessions) as s:
        # a loss spike at step 250 and three sparse evaluation records (no training loss key)
        s.execute(sa.update(JobMetric).where(JobMetric.job_id == jid, JobMetric.step == 250)
                  .values(values={"loss": 99.0, "acc_0": 0.1}))
        last = s.scalar(sa.update(Job).where(Job.id == jid).values(metric_seq=Job.metric_seq + 3)
                        .returning(Job.metric_seq))
        for i, step in enumerate((100, 300, 500)):
            s.add(JobMetric(job_id=jid, seq=last - 2 + i, step=step, values={"acceptance_length": 1.5 + i}))
    r = client.get(f"/v1/jobs/{jid}/metrics", params={"max_points": 40}, headers=alice).json()
    assert r["downsampled"] and r["total_points"] == 503 and len(r["data"]) <= 40
    losses = [p["values"].get("loss") for p in r["data"]]
    assert 99.0 in losses
    als = [p["values"]["acceptance_length"] for p in r["data"] if "acceptance_length" in p["values"]]
    assert als == [1.5, 2.5, 3.5]
    seqs = [p["seq"] for p in r["data"]]
    assert seqs == sorted(seqs) and seqs[0] == 1
