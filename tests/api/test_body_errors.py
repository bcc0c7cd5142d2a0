"""Issue 39: the errors of a request body are located where a person looks: a malformed JSON body by line
and column (it was a byte offset, "/18: JSON decode error"), and a spec's every problem in one answer."""

from __future__ import annotations

from fastapi.testclient import TestClient


def test_malformed_json_names_line_and_column(client: TestClient, alice: dict[str, str]) -> None:
    body = '{\n  "preset": "tiny",\n  "name": "x" "queue": "cpu"\n}'
    r = client.post("/v1/jobs", content=body, headers={**alice, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "validation_error"
    detail = err["details"][0]
    assert detail["in"] == "body"
    assert detail["param"] == ""  # the body itself, not a byte offset
    assert detail["message"] == "line 3, column 15: Expecting ',' delimiter"
    assert "line 3, column 15: Expecting ',' delimiter" in err["message"]


def test_every_spec_problem_in_one_answer(client: TestClient, alice: dict[str, str]) -> None:
    r = client.post("/v1/jobs", json={"preset": "tiny", "overrides": {
        "optim": {"betas": [1.5, 0.9]}, "resources": {"gpus": 100}}}, headers=alice)
    assert r.status_code == 422, r.text
    params = {d["param"] for d in r.json()["error"]["details"]}
    assert {"/resources/gpus", "/optim/betas/0"} <= params, params  # a preset's spec paths
