"""Issue 17: a job that asks for the vLLM engine where the workers have none is refused before queueing,
and the dry run says where the target will run and what its features cost on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from peagle.spec.hardware import auto_target_dtype, cpu_facts
from tests.api.conftest import make_settings

VLLM_JOB = {"preset": "demo", "overrides": {"resources": {"target_engine": "vllm"}}}


@pytest.fixture
def no_vllm(tmp_path: Path, db_url: str) -> Any:
    return make_settings(tmp_path, db_url, vllm_on_workers="no")


def test_vllm_asked_where_workers_have_none_is_refused(no_vllm: Any, sim: Any) -> None:
    headers = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    with TestClient(create_app(no_vllm)) as client:
        r = client.post("/v1/jobs", json=VLLM_JOB, headers=headers)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "/resources/target_engine" and "workers do not have" in err["message"]
        dry = client.post("/v1/jobs?dry_run=true", json=VLLM_JOB, headers=headers).json()
        assert dry["valid"] is False and dry["problems"] == err["details"]
        # auto falls back to transformers there: valid, and the estimate says so
        auto = client.post("/v1/jobs?dry_run=true", json={"preset": "demo"}, headers=headers).json()
        assert auto["valid"] is True and auto["target_engine"] == "hf"
        assert auto["phase_seconds"]["regenerating"] == 0  # regeneration auto = only with the engine


def test_dry_run_shows_the_engine_and_the_feature_disk(client: TestClient, alice: dict, settings: Any) -> None:
    from service.settings import get_settings

    est = client.post("/v1/jobs?dry_run=true", json=VLLM_JOB, headers=alice).json()
    if not get_settings(**{"home": settings.home}).vllm_available():
        pytest.skip("this machine has no vLLM venv: the refusal is tested above")
    assert est["valid"] is True and est["target_engine"] == "vllm"
    # SmolLM2 through the engine: aux 3 x 576 and final 576 in the target's dtype, plus ids/mask/document id;
    # `auto` is bf16 where this CPU runs it natively, else fp32 (docs/testing.md 3)
    assert est["target_dtype"] == auto_target_dtype(device="cpu", facts=cpu_facts())
    width = 2 if est["target_dtype"] == "bfloat16" else 4
    assert est["feature_bytes_per_token"] == 4 * 576 * width + 24
    assert est["offline_dump_bytes"] >= est["tokens"] * est["feature_bytes_per_token"]
    assert est["hidden_state_bytes"] == est["offline_dump_bytes"]  # the demo captures offline
    assert est["phase_seconds"]["regenerating"] > 60  # the demo regenerates its answers with the target
