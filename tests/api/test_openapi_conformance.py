"""The OpenAPI document matches the API: schemathesis with every response check, on a real server.

Each operation gets `MAX_EXAMPLES` positive and negative cases (derandomized: the same cases every run),
sent with a write key (one in five without credentials, one in five with a read-only key: the documented
401 and 403), and each answer must be
documented: status code, content type, headers and body schema; and never a 5xx. Path parameters are
sometimes replaced by ids that exist (a terminal job with a checkpoint, a dataset, a webhook) so the
success answers are checked too. Also: a method a path does not serve is 405 with an `Allow` header naming
exactly the methods the document lists for it (RFC 9110).
"""

from __future__ import annotations

import io
import time
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.main import create_app

pytestmark = pytest.mark.integration

MAX_EXAMPLES = 80  # per operation and generation mode: about 4,000 calls, about a minute on 2 cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


@pytest.fixture
def conformance_app(settings_factory: Any) -> Any:
    # Small limits, so the quota and size answers (429, 413, 409) are reachable within a few cases.
    return create_app(settings_factory(max_upload_bytes=4096, max_queued_jobs=3, max_concurrent_jobs=1,
                                       max_webhooks_per_owner=3, webhook_allow_hosts="127.0.0.1"))


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_openapi_conformance(conformance_app: Any, sim: Any, live_server: Any) -> None:
    app = conformance_app
    headers = {"Authorization": f"Bearer {sim.key('conformance', 'write')}"}
    reader = {"Authorization": f"Bearer {sim.key('conformance', 'read')}"}
    with live_server(app) as srv:
        ids = _fixtures(srv.url, headers, sim)
        schema = schemathesis.openapi.from_dict(app.openapi())
        ops = [r.ok() for r in schema.get_all_operations()]
        assert len(ops) >= 30, [op.label for op in ops]
        failures: dict[str, str] = {}
        calls: dict[int, int] = {}
        started = time.monotonic()
        with requests.Session() as http:
            for op in ops:
                _run_operation(op, srv.url, (headers, reader), ids, http, failures, calls)
        elapsed = time.monotonic() - started
        print(f"schemathesis: {sum(calls.values())} calls on {len(ops)} operations in {elapsed:.0f} s; "
              f"statuses {dict(sorted(calls.items()))}")
        assert not failures, f"{len(failures)} conformance failure(s):\n\n" + "\n\n".join(failures.values())
        assert elapsed < 600, f"the conformance run took {elapsed:.0f} s"


def _fixtures(url: str, headers: dict[str, str], sim: Any) -> dict[str, Any]:
    """Ids that exist: a succeeded job with a checkpoint, a dataset, a webhook endpoint."""
    job = httpx.post(f"{url}/v1/jobs", json={"preset": "tiny"}, headers=headers, timeout=30).json()
    sim.set(job["id"], status="succeeded")
    sim.checkpoint(job["id"], 5, {"model.safetensors": b"\0" * 64, "sub/extra.json": b"{}"})
    ds = httpx.post(f"{url}/v1/datasets", headers=headers, timeout=60,
                    files={"file": ("d.jsonl", io.BytesIO(b'{"conversations": [{"from": "human", "value": "hi"}, '
                                                          b'{"from": "gpt", "value": "yo"}]}\n'))}).json()
    wh = httpx.post(f"{url}/v1/webhooks", headers=headers, timeout=30,
                    json={"url": "http://127.0.0.1:9/hook", "events": ["job.succeeded"]}).json()
    return {"job_id": job["id"], "step": 5, "path": "model.safetensors", "dataset_id": ds["id"],
            "webhook_id": wh["id"]}


def _run_operation(op: Any, url: str, keys: tuple[dict[str, str], dict[str, str]], ids: dict[str, Any],
                   http: requests.Session,
                   failures: dict[str, str], calls: dict[int, int]) -> None:
    from schemathesis import GenerationMode

    strategy = st.one_of(op.as_strategy(generation_mode=GenerationMode.POSITIVE),
                         op.as_strategy(generation_mode=GenerationMode.NEGATIVE))

    @settings(max_examples=2 * MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy, pick=st.integers(0, 4))
    def check(case: Any, pick: int) -> None:
        # (not 0 for the rare choices: Hypothesis draws the smallest value far more often than the others)
        params = case.path_parameters or {}
        if pick != 1:  # mostly the existing resources
            for name in params:
                if name in ids:
                    params[name] = ids[name]
        sent = {3: {}, 4: keys[1]}.get(pick, keys[0])  # sometimes no credentials (401), or read-only (403)
        try:
            resp = case.call(base_url=url, session=http, headers=sent, timeout=30)
            calls[resp.status_code] = calls.get(resp.status_code, 0) + 1
            case.validate_response(resp, checks=CHECKS, headers=sent)
        except (Exception, BaseExceptionGroup) as exc:  # one report per operation and failure
            title = str(getattr(exc, "exceptions", [exc])[0]).strip().splitlines() or [""]
            failures.setdefault(f"{op.label}: {type(exc).__name__}: {title[0]}", f"{op.label}\n{exc}"[:3000])

    check()


def test_unsupported_method_is_405_with_allow(client: Any, alice: dict[str, str]) -> None:
    """Every documented path: each method it does not serve is 405 + `Allow` = the documented methods."""
    spec = client.app.openapi()
    for path, item in spec["paths"].items():
        documented = {m.upper() for m in item if m.upper() in (*HTTP_METHODS, "HEAD")}
        concrete = path.replace("{path}", "a/b.bin")
        for name in ("job_id", "step", "dataset_id", "webhook_id"):
            concrete = concrete.replace("{" + name + "}", "1")
        for method in HTTP_METHODS:
            if method in documented:
                continue
            r = client.request(method, concrete, headers=alice)
            assert r.status_code == 405, (method, path, r.status_code, r.text)
            assert "allow" in r.headers, (method, path)
            allowed = {m.strip() for m in r.headers["allow"].split(",")}
            assert allowed == documented, (method, path, allowed, documented)
            assert r.json()["error"]["code"] == "method_not_allowed"
