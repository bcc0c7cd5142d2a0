"""Issue 20: what can be known before queueing is refused before queueing (submit, clone) and reported by
the dry run as `valid: false` with the same problems: uploaded datasets that are not `ready` or have no
usable row, and a target folder under the operator's model roots that is missing or is not a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.main import create_app
from service.db.models import Dataset, Job, Owner, utcnow

ROWS = "\n".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]})
                 for i in range(6)).encode()


def _upload(client: TestClient, headers: dict, data: bytes, name: str = "chats.jsonl") -> dict[str, Any]:
    r = client.post("/v1/datasets", files={"file": (name, data, "application/jsonl")}, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


def _job_count(sim: Any) -> int:
    with sim.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(Job)))


def _with_data(path: str, **source: Any) -> dict[str, Any]:
    return {"preset": "tiny", "overrides": {"data": {"sources": [{"path": path, **source}]}}}


def _refused_both_ways(client: TestClient, headers: dict, body: dict[str, Any], param: str) -> str:
    """Submit is a 422 naming `param`; the dry run answers 200 `valid: false` with the same problems."""
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "spec_invalid" and err["param"] == param, err
    dry = client.post("/v1/jobs?dry_run=true", json=body, headers=headers)
    assert dry.status_code == 200, dry.text
    est = dry.json()
    assert est["valid"] is False, est
    assert est["problems"] == err["details"], (est["problems"], err["details"])
    return next(d["message"] for d in err["details"] if d["param"] == param)


def _insert_dataset(sim: Any, owner: str, status: str, report: dict[str, Any]) -> str:
    with sim.sessions() as s:
        owner_id = s.scalar(sa.select(Owner.id).where(Owner.name == owner))
        ds = Dataset(owner_id=owner_id, filename="x.jsonl", path="/nonexistent/x.jsonl", size=1, sha256="0" * 64,
                     format="sharegpt", status=status, report=report, created_at=utcnow())
        s.add(ds)
        s.commit()
        return ds.id


def test_invalid_dataset_is_refused_with_its_own_error(client: TestClient, alice: dict, sim: Any) -> None:
    bad = _upload(client, alice, b"not json at all", name="bad.jsonl")
    assert bad["status"] == "invalid" and bad["report"]["error"]
    msg = _refused_both_ways(client, alice, _with_data(bad["path_ref"]), "/data/sources/0/path")
    assert bad["id"] in msg and "invalid" in msg and bad["report"]["error"] in msg, msg
    assert _job_count(sim) == 0


def test_dataset_still_validating_is_refused(client: TestClient, alice: dict, sim: Any) -> None:
    ds_id = _insert_dataset(sim, "alice", "validating", {})
    msg = _refused_both_ways(client, alice, _with_data(f"dataset:{ds_id}"), "/data/sources/0/path")
    assert "still being validated" in msg and "ready" in msg, msg
    assert _job_count(sim) == 0


def test_dataset_without_usable_rows_is_refused(client: TestClient, alice: dict, sim: Any) -> None:
    empty = _insert_dataset(sim, "alice", "ready", {"ok": True, "rows_kept": 0})
    msg = _refused_both_ways(client, alice, _with_data(f"dataset:{empty}"), "/data/sources/0/path")
    assert "no usable row" in msg, msg
    ds = _upload(client, alice, ROWS)  # 6 rows, all skipped
    msg = _refused_both_ways(client, alice, _with_data(ds["path_ref"], skip=6), "/data/sources/0/path")
    assert "6 usable rows" in msg and "skip" in msg, msg
    assert _job_count(sim) == 0
    ok = client.post("/v1/jobs?dry_run=true", json=_with_data(ds["path_ref"], skip=1), headers=alice)
    assert ok.status_code == 200 and ok.json()["valid"] is True and ok.json()["problems"] == [], ok.text


def test_every_problem_is_listed_at_once(client: TestClient, alice: dict, sim: Any) -> None:
    bad = _upload(client, alice, b"not json at all", name="bad.jsonl")
    body = {"preset": "tiny", "overrides": {"data": {"sources": [{"path": "builtin:sharegpt"}, {"path": bad["path_ref"]},
                                                                 {"path": "/etc/passwd"}]}}}
    r = client.post("/v1/jobs?dry_run=true", json=body, headers=alice)  # an access problem: 422 even when dry
    assert r.status_code == 422, r.text
    assert [d["param"] for d in r.json()["error"]["details"]] == ["/data/sources/1/path", "/data/sources/2/path"]


def test_clone_is_checked_too(client: TestClient, alice: dict, sim: Any, submit: Any) -> None:
    jid = submit(client, alice)["id"]
    bad = _upload(client, alice, b"not json at all", name="bad.jsonl")
    r = client.post(f"/v1/jobs/{jid}/clone", json={"overrides": {"data": {"sources": [{"path": bad["path_ref"]}]}}},
                    headers=alice)
    assert r.status_code == 422 and r.json()["error"]["param"] == "/data/sources/0/path", r.text
    assert _job_count(sim) == 1


def test_target_under_model_roots_must_be_a_model_folder(settings_factory: Any, sim: Any, tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "empty").mkdir(parents=True)
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text("{}")
    (root / "file").write_text("x")
    with TestClient(create_app(settings_factory(model_roots=[root]))) as c:
        h = {"Authorization": f"Bearer {sim.key('carol', 'write')}"}
        tiny = {"preset": "tiny"}
        for name, why in (("missing", "no such folder"), ("empty", "no config.json"), ("file", "no such folder")):
            body = {**tiny, "overrides": {"target": {"model": str(root / name)}}}
            msg = _refused_both_ways(c, h, body, "/target/model")
            assert why in msg, (name, msg)
        r = c.post("/v1/jobs?dry_run=true", json={**tiny, "overrides": {"target": {"model": str(root / "llama")}}},
                   headers=h)
        assert r.status_code == 200 and r.json()["valid"] is True, r.text
    assert _job_count(sim) == 0


def _with_prompt_set(name: str) -> dict[str, Any]:
    return {"preset": "tiny", "overrides": {"eval": {"prompt_sets": [{"name": "humaneval", "num_prompts": 2},
                                                                     {"name": name, "num_prompts": 4}]}}}


def test_an_uploaded_dataset_is_a_prompt_set_of_its_owner_only(client: TestClient, alice: dict, bob: dict,
                                                                sim: Any) -> None:
    """Issue 18 item 2: `dataset:<id>` in eval.prompt_sets is checked as a data source is (owned, ready)."""
    ds = _upload(client, alice, ROWS)
    ok = client.post("/v1/jobs?dry_run=true", json=_with_prompt_set(ds["path_ref"]), headers=alice)
    assert ok.status_code == 200 and ok.json()["valid"] is True, ok.text
    theirs = client.post("/v1/jobs", json=_with_prompt_set(ds["path_ref"]), headers=bob)
    assert theirs.status_code == 422 and theirs.json()["error"]["param"] == "/eval/prompt_sets/1/name", theirs.text
    assert "no dataset" in theirs.json()["error"]["details"][0]["message"]
    validating = _insert_dataset(sim, "alice", "validating", {})
    msg = _refused_both_ways(client, alice, _with_prompt_set(f"dataset:{validating}"), "/eval/prompt_sets/1/name")
    assert "still being validated" in msg, msg
    server_path = client.post("/v1/jobs", json=_with_prompt_set("/etc/passwd"), headers=alice)
    assert server_path.status_code == 422 and "server paths are not accepted" in server_path.text
    assert _job_count(sim) == 0
    created = client.post("/v1/jobs", json=_with_prompt_set(ds["path_ref"]), headers=alice)
    assert created.status_code == 201, created.text
