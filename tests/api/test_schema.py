"""Schemathesis against the OpenAPI schema on a real server: zero 5xx (bounded examples)."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from api.main import create_app

pytestmark = pytest.mark.integration


def test_no_server_errors(settings_factory: Any, sim: Any, live_server: Any, db_url: str) -> None:
    app = create_app(settings_factory(max_upload_bytes=4096))
    headers = {"Authorization": f"Bearer {sim.key('fuzz', 'write')}"}
    with live_server(app) as srv:
        import httpx

        job = httpx.post(f"{srv.url}/v1/jobs", json={"preset": "tiny"}, headers=headers).json()
        sim.set(job["id"], status="succeeded")
        schema = schemathesis.openapi.from_dict(app.openapi())
        failures: list[str] = []
        ops = [r.ok() for r in schema.get_all_operations()]
        assert len(ops) >= 25
        def make_check(op: Any) -> Any:
            @settings(max_examples=6, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy())
            def check(case: Any) -> None:
                if "job_id" in (case.path_parameters or {}) and case.path_parameters["job_id"].isascii():
                    case.path_parameters["job_id"] = job["id"]  # exercise a real job too
                resp = case.call(base_url=srv.url, headers=headers, timeout=10)
                if resp.status_code >= 500:
                    failures.append(f"{op.label}: {resp.status_code} {resp.text[:200]}")

            return check

        for op in ops:
            make_check(op)()
        assert not failures, failures
