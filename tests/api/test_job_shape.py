"""One job shape: every route that answers with a job (create, replay, get, list, actions, clone) matches
the documented schema (`JobOut`, `JobSummary` in a `JobPage`), and the OpenAPI document says so."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi.testclient import TestClient

from api.schemas import JobOut, JobPage, JobSummary, job_public
from service.db import repo

Sim = Any


def _ref(schema: dict[str, Any]) -> set[str]:
    """Component names a response schema refers to (directly or through anyOf/oneOf)."""
    refs = {schema["$ref"].rsplit("/", 1)[-1]} if "$ref" in schema else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            refs |= _ref(sub)
    return refs


def _response_refs(doc: dict[str, Any], path: str, method: str, status: str) -> set[str]:
    response = doc["paths"][path][method]["responses"][status]
    return _ref(response["content"]["application/json"]["schema"])


def _full(body: dict[str, Any]) -> None:
    JobOut.model_validate(body)
    assert set(body) == set(JobOut.model_fields), set(body) ^ set(JobOut.model_fields)


def test_openapi_documents_the_job_models(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert "JobOut" in _response_refs(doc, "/v1/jobs", "post", "201")
    assert _response_refs(doc, "/v1/jobs/{job_id}", "get", "200") == {"JobOut"}
    assert _response_refs(doc, "/v1/jobs", "get", "200") == {"JobPage"}
    page = doc["components"]["schemas"]["JobPage"]
    assert _ref(page["properties"]["data"]["items"]) == {"JobSummary"}
    for action in ("cancel", "pause", "resume"):
        assert _response_refs(doc, f"/v1/jobs/{{job_id}}/{action}", "post", "200") == {"JobOut"}
    assert _response_refs(doc, "/v1/jobs/{job_id}/clone", "post", "201") == {"JobOut"}
    # the documented component is the model's own schema
    documented = doc["components"]["schemas"]["JobOut"]
    assert set(documented["properties"]) == set(JobOut.model_fields)
    assert set(doc["components"]["schemas"]["JobSummary"]["properties"]) == set(JobSummary.model_fields)


def test_every_job_answer_matches_the_schema(client: TestClient, alice: dict, sim: Sim) -> None:
    created = client.post("/v1/jobs", json={"preset": "tiny", "tags": ["x"]}, headers=alice)
    assert created.status_code == 201, created.text
    _full(created.json())
    jid = created.json()["id"]

    h = {**alice, "Idempotency-Key": "shape-1"}
    first = client.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
    replay = client.post("/v1/jobs", json={"preset": "tiny"}, headers=h)
    assert first.status_code == replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    _full(first.json())
    assert replay.json() == first.json()

    got = client.get(f"/v1/jobs/{jid}", headers=alice)
    assert got.status_code == 200
    _full(got.json())
    assert got.json()["queue_position"] == 0

    page = client.get("/v1/jobs", headers=alice, params={"limit": 1})
    assert page.status_code == 200
    JobPage.model_validate(page.json())
    assert page.json()["has_more"] is True
    for item in page.json()["data"]:
        assert set(item) == set(JobSummary.model_fields)
    for status in ("queued", None):  # the filtered and the plain statement (both list paths)
        params = {"status": status} if status else {}
        for item in client.get("/v1/jobs", headers=alice, params=params).json()["data"]:
            JobSummary.model_validate(item)
            assert set(item) == set(JobSummary.model_fields)

    for action, status in (("pause", "paused"), ("resume", "queued"), ("cancel", "cancelled")):
        r = client.post(f"/v1/jobs/{jid}/{action}", headers=alice)
        assert r.status_code == 200, r.text
        _full(r.json())
        assert r.json()["status"] == status
    sim.checkpoint(jid, 4, {"model.safetensors": b"w"})
    clone = client.post(f"/v1/jobs/{jid}/clone", headers=alice)
    assert clone.status_code == 201
    _full(clone.json())
    again = client.get(f"/v1/jobs/{jid}", headers=alice).json()
    _full(again)
    assert again["best_checkpoint"] == {"step": 4, "url": f"/v1/jobs/{jid}/checkpoints/4"}


def test_summary_reads_only_the_list_columns() -> None:
    now = datetime.now(UTC)
    row = {c: None for c in repo.SUMMARY_COLUMNS}
    row.update(id="job_1", name="n", status="queued", attempt=0, queue="default", created_at=now, updated_at=now,
               error_code="boom", error_message="m", error_retryable=False)
    out = job_public(row, full=False)  # a KeyError here: the builder needs a column the list does not read
    JobSummary.model_validate(out)
    assert set(out) == set(JobSummary.model_fields) and out["tags"] == [] and out["progress"] == {}
    assert out["error"] == {"code": "boom", "message": "m", "retryable": False}
