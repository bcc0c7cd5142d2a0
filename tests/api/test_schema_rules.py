"""The OpenAPI document states the rules the API enforces (schemathesis' positive-data check found three it
did not): an empty `status=` filter, a create body with an empty `preset`, a webhook `url` of `0`."""

from __future__ import annotations

from typing import Any

import jsonschema_rs
from fastapi.testclient import TestClient

from peagle.spec import preset_names
from service.db import states


def _valid(doc: dict[str, Any], schema: dict[str, Any], value: Any) -> bool:
    """`value` against `schema` of the app's OpenAPI 3.1 document (JSON Schema 2020-12, local refs)."""
    return bool(jsonschema_rs.Draft202012Validator({**schema, "components": doc["components"]}).is_valid(value))


def _body_schema(doc: dict[str, Any], path: str) -> dict[str, Any]:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_an_empty_status_filter_is_outside_the_schema_and_refused(client: TestClient, alice: dict) -> None:
    doc = client.app.openapi()
    (param,) = [p for p in doc["paths"]["/v1/jobs"]["get"]["parameters"] if p["name"] == "status"]
    assert not _valid(doc, param["schema"], [""])
    assert not _valid(doc, param["schema"], ["queued", "nope"])
    assert _valid(doc, param["schema"], list(states.ALL_STATES))
    r = client.get("/v1/jobs?status=", headers=alice)
    assert r.status_code == 422 and r.json()["error"]["param"] == "/status"
    assert client.get("/v1/jobs?" + "&".join(f"status={s}" for s in states.ALL_STATES), headers=alice
                      ).status_code == 200


def test_an_empty_or_unknown_preset_is_outside_the_schema_and_refused(client: TestClient, alice: dict) -> None:
    doc = client.app.openapi()
    schema = _body_schema(doc, "/v1/jobs")
    assert not _valid(doc, schema, {"preset": ""})
    assert not _valid(doc, schema, {"preset": "no-such-preset"})
    assert all(_valid(doc, schema, {"preset": name}) for name in preset_names())
    spec = {"target": {"model": "org/m"}}  # the smallest documented spec (`{}` lacks its target: 422)
    assert _valid(doc, schema, {"spec": spec}) and _valid(doc, schema, {"preset": None, "spec": spec})
    for bad_body in ({}, {"preset": None}, {"preset": "tiny", "spec": {}}, {"spec": {}, "overrides": {"a": 1}}):
        assert not _valid(doc, schema, bad_body), bad_body
        assert client.post("/v1/jobs", json=bad_body, headers=alice).status_code == 422, bad_body
    assert _valid(doc, schema, {"preset": "tiny", "overrides": {"optim": {"lr": 0.001}}})
    for bad in ("", "no-such-preset"):
        r = client.post("/v1/jobs", json={"preset": bad}, headers=alice)
        assert r.status_code == 422 and r.json()["error"]["param"] == "/preset", r.text
    assert client.post("/v1/jobs", json={"preset": "tiny"}, headers=alice).status_code == 201


def test_a_webhook_url_that_is_not_http_is_outside_the_schema_and_refused(client: TestClient, alice: dict) -> None:
    doc = client.app.openapi()
    schema = _body_schema(doc, "/v1/webhooks")
    for bad in ("0", "ftp://example.com/x", "http://", "http://:80/", "http://a b/", "http://h:65536/"):
        assert not _valid(doc, schema, {"url": bad, "events": ["job.succeeded"]}), bad
        r = client.post("/v1/webhooks", json={"url": bad, "events": ["job.succeeded"]}, headers=alice)
        assert r.status_code == 422, (bad, r.text)
    for good in ("https://hooks.example.com/peagle", "HTTP://user@example.com:8443/p?q=1#f"):
        assert _valid(doc, schema, {"url": good, "events": ["job.succeeded"]}), good
