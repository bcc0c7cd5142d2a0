"""The OpenAPI document and the API agree where schemathesis found they did not (issue 46, item 7), all 4xx:

1. `Last-Event-ID: null` was refused (422) though the document typed the header as any string (or null);
2. `GET /v1/jobs?created_after=0.5` was accepted (a Unix time) though the document says `date-time`;
3. `POST /v1/jobs` `{"spec": {}}` was refused (no `target`) though the document took any object as `spec`;
4. `POST /v1/jobs/{id}/clone` with an unknown `overrides` key was refused though any object was documented.
(And `POST /v1/jobs/{id}/retrain` `{}`: refused, "name the new data", though every field was optional.)

Each is checked both ways: what the document says is valid is answered as valid, and what it says is
invalid is refused, with the body schemas validated by `jsonschema` against the served document.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema_rs
from fastapi.testclient import TestClient

from peagle.spec import preset, preset_names
from tests.api.test_retrain import _succeeded

STREAMS = ("events", "metrics", "logs")


def _doc(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()


def _body_validator(doc: dict[str, Any], path: str) -> jsonschema_rs.Draft202012Validator:
    body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema_rs.Draft202012Validator({**body, "components": doc["components"]}, validate_formats=True)


def _param(doc: dict[str, Any], path: str, name: str) -> dict[str, Any]:
    return next(p for p in doc["paths"][path]["get"]["parameters"] if p["name"].lower() == name)


LAST_EVENT_IDS_OK = ["0", "7", "2147483647", "0002147483647", "2147483639", "1999999999"]
LAST_EVENT_IDS_BAD = ["null", "-1", "2147483648", "2147483650", "9999999999", "1.0", "1e3", " 5x", "abc", "\xb2"]


def test_last_event_id_is_documented_as_the_sequence_numbers_the_streams_take(
        client: TestClient, sim: Any, alice: dict, submit: Any) -> None:
    doc = _doc(client)
    job = submit(client, alice)
    sim.set(job["id"], status="succeeded")  # a finished job: each stream ends at once
    for kind in STREAMS:
        schema = _param(doc, f"/v1/jobs/{{job_id}}/{kind}/stream", "last-event-id")["schema"]
        assert schema.get("type") == "string" and "anyOf" not in schema, schema  # no `null`: a header is text
        pattern = re.compile(schema["pattern"])
        edges = [*range(0, 12), *range(2**31 - 12, 2**31 + 12), *(10**k + d for k in range(1, 11) for d in (-1, 0, 1)),
                 *(int(str(2**31 - 1)[:i] + "9" * (10 - i)) for i in range(10))]
        for n in edges:  # the pattern is the bound 0 .. 2**31-1, digit by digit
            assert bool(pattern.search(str(n))) == (n <= 2**31 - 1), n
        for value in LAST_EVENT_IDS_OK:
            assert pattern.search(value) and len(value) <= schema["maxLength"], value
            r = client.get(f"/v1/jobs/{job['id']}/{kind}/stream", headers={**alice, "Last-Event-ID": value})
            assert r.status_code == 200, (kind, value, r.text)
        for value in LAST_EVENT_IDS_BAD:
            assert not pattern.search(value), value
            sent = {**alice, "Last-Event-ID": value.encode("latin-1")}
            r = client.get(f"/v1/jobs/{job['id']}/{kind}/stream", headers=sent)
            assert r.status_code == 422 and r.json()["error"]["param"] == "/last-event-id", (kind, value, r.text)


CREATED_AFTER = ["0.5", "1700000000", "2024-01-01", "2024-01-01T00:00:00", "2024-01-01T00:00Z", "tomorrow",
                 "2024-13-01T00:00:00Z", "2024-02-30T00:00:00Z", "2024-01-01 00:00:00Z", "",
                 "2024-01-01T00:00:00Z", "2024-01-01t00:00:00z", "2024-01-01T00:00:00.5+02:00", "2100-01-01T00:00:00-05:30"]


def test_created_after_takes_exactly_an_rfc3339_date_time(client: TestClient, alice: dict) -> None:
    """Answered 200 exactly when the document's schema (`format: date-time`) holds the value valid."""
    schema = _param(_doc(client), "/v1/jobs", "created_after")["schema"]
    documented = jsonschema_rs.Draft202012Validator(schema, validate_formats=True)
    for value in CREATED_AFTER:
        r = client.get("/v1/jobs", params={"created_after": value}, headers=alice)
        assert r.status_code == (200 if documented.is_valid(value) else 422), (value, r.text)
        if r.status_code == 422:
            assert r.json()["error"]["param"] == "/created_after", r.text
    assert documented.is_valid("2024-01-01T00:00:00Z") and not documented.is_valid("0.5")


def test_the_spec_body_is_documented_as_the_job_spec(client: TestClient, alice: dict) -> None:
    doc = _doc(client)
    create = _body_validator(doc, "/v1/jobs")
    assert not create.is_valid({"spec": {}})  # the spec needs its target
    assert client.post("/v1/jobs", json={"spec": {}}, headers=alice).status_code == 422
    assert not create.is_valid({"spec": {"target": {"model": "org/m"}, "bogus": 1}})
    for name in preset_names():  # every preset's full spec is a documented (and accepted) spec
        spec = preset(name).model_dump(mode="json")
        create.validate({"spec": spec})
    tiny = preset("tiny").model_dump(mode="json")
    assert client.post("/v1/jobs", json={"spec": tiny}, headers=alice).status_code == 201


def test_overrides_are_documented_as_a_partial_spec(client: TestClient, sim: Any, alice: dict,
                                                    submit: Any) -> None:
    doc = _doc(client)
    create, clone = _body_validator(doc, "/v1/jobs"), _body_validator(doc, "/v1/jobs/{job_id}/clone")
    unknown = {"optim": {"no_such_field": 1}}
    assert not create.is_valid({"preset": "tiny", "overrides": unknown})
    assert not clone.is_valid({"overrides": {"bogus": {}}}) and not clone.is_valid({"overrides": unknown})
    job = submit(client, alice)
    for bad in ({"bogus": {}}, unknown):
        r = client.post(f"/v1/jobs/{job['id']}/clone", json={"overrides": bad}, headers=alice)
        assert r.status_code == 422, r.text
    fine = {"optim": {"max_steps": 3}, "data": {"sources": [{"path": "builtin:sharegpt", "max_samples": 4}]}}
    create.validate({"preset": "tiny", "overrides": fine})
    clone.validate({"overrides": fine})
    assert client.post(f"/v1/jobs/{job['id']}/clone", json={"overrides": fine}, headers=alice).status_code == 201


def test_retrain_is_documented_as_needing_new_data(client: TestClient, sim: Any, alice: dict, submit: Any) -> None:
    retrain = _body_validator(_doc(client), "/v1/jobs/{job_id}/retrain")
    parent = _succeeded(client, sim, alice, submit)
    for body in ({}, {"datasets": [], "sources": []}, {"checkpoint_step": 4}):
        assert not retrain.is_valid(body), body
        assert client.post(f"/v1/jobs/{parent['id']}/retrain", json=body, headers=alice).status_code == 422
    body = {"sources": [{"path": "builtin:sharegpt", "max_samples": 8}]}
    retrain.validate(body)
    assert client.post(f"/v1/jobs/{parent['id']}/retrain", json=body, headers=alice).status_code == 201
    assert not retrain.is_valid({"sources": [{"path": "builtin:sharegpt", "bogus": 1}]})
