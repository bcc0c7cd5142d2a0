"""Issue 38: an uploaded prompt list (or request-body log) is a `ready` dataset whose report counts its
prompts-only rows; a job that trains on it without regeneration is refused before queueing, naming the
source and the fix, and accepted with `data.regenerate.enabled`."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from service.db.models import Job

PROMPTS = "".join(json.dumps({"prompt": f"Question {i}?", "model": "m", "temperature": 0.2}) + "\n"
                  for i in range(4)).encode()
BODIES = "".join(json.dumps({"model": "m", "messages": m}) + "\n" for m in [
    [{"role": "user", "content": "q1"}],
    [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
]).encode()


def _upload(client: TestClient, headers: dict, data: bytes, name: str) -> dict[str, Any]:
    r = client.post("/v1/datasets", files={"file": (name, data, "application/jsonl")}, headers=headers)
    assert r.status_code == 201, r.text
    return r.json()


def _body(path: str, **regenerate: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"sources": [{"path": path}]}
    if regenerate:
        data["regenerate"] = regenerate
    return {"preset": "tiny", "overrides": {"data": data}}


def _jobs(sim: Any) -> int:
    with sim.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(Job)))


def test_prompts_only_dataset_needs_regeneration(client: TestClient, alice: dict, sim: Any) -> None:
    ds = _upload(client, alice, PROMPTS, "prompts.jsonl")
    rep = ds["report"]
    assert ds["status"] == "ready" and ds["format"] == "prompt", ds
    assert (rep["rows_read"], rep["rows_kept"], rep["prompts_only"], rep["funnel"]["prompts_only"]) == (4, 0, 4, 4)
    r = client.post("/v1/jobs", json=_body(ds["path_ref"]), headers=alice)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "spec_invalid" and err["param"] == "/data/sources/0/path", err
    assert err["details"][0]["message"] == (
        f"dataset {ds['id']}: 4 of 4 rows end with a user turn and have no answer to train on; turn on "
        "data.regenerate.enabled so the target writes them")
    dry = client.post("/v1/jobs?dry_run=true", json=_body(ds["path_ref"]), headers=alice)
    assert dry.status_code == 200 and dry.json()["valid"] is False and dry.json()["problems"] == err["details"]
    assert _jobs(sim) == 0
    # the same data with regeneration: the target writes the answers
    ok = client.post("/v1/jobs?dry_run=true", json=_body(ds["path_ref"], enabled=True), headers=alice)
    assert ok.status_code == 200 and ok.json()["valid"] is True and ok.json()["problems"] == [], ok.text
    # a log of request bodies with some answers trains without regeneration (the prompts-only rows dropped)
    mixed = _upload(client, alice, BODIES, "bodies.jsonl")
    assert (mixed["report"]["rows_kept"], mixed["report"]["prompts_only"]) == (1, 1)
    also = client.post("/v1/jobs?dry_run=true", json=_body(mixed["path_ref"]), headers=alice)
    assert also.status_code == 200 and also.json()["valid"] is True, also.text
    # a prompt set needs prompts only: the prompt list measures AL without regeneration
    as_set = _body(mixed["path_ref"])
    as_set["overrides"]["eval"] = {"prompt_sets": [{"name": ds["path_ref"], "num_prompts": 4}]}
    measured = client.post("/v1/jobs?dry_run=true", json=as_set, headers=alice)
    assert measured.status_code == 200 and measured.json()["valid"] is True, measured.text
