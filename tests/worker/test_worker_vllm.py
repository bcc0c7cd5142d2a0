"""Issue 17 end to end: jobs whose target runs in vLLM, through a real worker (slow: real SmolLM2 and vLLM).

- A whole job: regeneration by the engine, capture by the engine, a draft-only trainer, AL measured by
  vLLM, the export served by vLLM with parallel drafting; nothing of the engine left afterwards.
- No engine process survives a cancelled job, or a worker (the supervisor) killed with -9.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from peagle.spec.hardware import auto_target_dtype, cpu_facts
from service.db.models import JobLog

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _need_vllm() -> None:
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        assert not (REPO / ".vllm-venv" / "bin" / "python").exists(), "vllm_python() misses .vllm-venv"
        pytest.skip("vLLM venv missing: run `make vllm-env` (builds .vllm-venv)")


def vllm_spec(**over: Any) -> dict[str, Any]:
    """A small SmolLM2 job with its target in vLLM (the demo preset, scaled down)."""
    from peagle.spec import parse_spec, preset

    spec = preset("demo").model_dump(mode="json")
    spec["name"] = "vllm engine test"
    spec["data"].update(sources=[{"path": "builtin:sharegpt", "max_samples": 24, "skip": 0, "format": "auto"}],
                        max_length=256, eval_samples=4)
    spec["data"]["regenerate"].update(enabled=True, max_new_tokens=32, batch_size=16)
    spec["draft"].update(num_layers=1, draft_vocab_size=2048)
    spec["peagle"]["num_depths"] = 3
    spec["optim"].update(max_steps=6, pack_length=512)
    spec["checkpoints"].update(every_steps=3)
    # one timed round at K = 3 only: the speedup path runs; its sweep is tested in tests/worker/
    spec["eval"].update(prompt_sets=[{"name": "humaneval", "num_prompts": 2}], max_new_tokens=16,
                        al_every_steps=None, serve_check=True, speedup_sweep=False, speedup_rounds=1)
    spec["resources"].update(target_engine="vllm", capture="offline", max_restarts=0)
    for section, values in over.items():
        spec[section].update(values)
    return parse_spec(spec).model_dump(mode="json")


def wait_gone(processes_mentioning, marker: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"still running: {left}"


def log_lines(stack: Any, job_id: str) -> list[str]:
    return [g.message for g in stack.rows(JobLog, job_id)]


def test_whole_job_with_the_target_in_vllm(make_stack, processes_mentioning):
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    job_id = stack.submit(vllm_spec())
    job = stack.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=1500)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    run = stack.settings.resolved_artifact_root() / job_id
    assert job.resolved_spec["resources"]["target_engine"] == "vllm"
    assert job.resolved_spec["data"]["regenerate"]["enabled"] is True
    assert job.resolved_spec["eval"]["engine"] == "vllm"
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["resolved"]["target_engine"] == "vllm"
    logs = "\n".join(log_lines(stack, job_id))
    assert "regenerat" in logs and "capture engine ready" in logs, logs[-3000:]
    assert (run / "logs" / "engine-capture.log").exists()
    report = json.loads((run / "data" / "report.json").read_text())
    assert report["funnel"]["kept"] > 0
    manifest = json.loads((run / "data" / "features" / "train" / "manifest.json").read_text())
    # the engine's features are stored in the target's dtype, which `auto` makes bf16 only where this CPU runs
    # it natively (float32 on an AVX2-only one, docs/testing.md 3)
    dtype = auto_target_dtype(device="cpu", facts=cpu_facts())
    assert job.resolved_spec["target"]["dtype"] == dtype
    assert manifest["complete"] is True and manifest["aux_dtype"] == dtype
    # eval.engine resolved to vllm: the evaluation itself loads the export in vLLM with parallel drafting
    ev = json.loads((run / "export" / "eval.json").read_text())
    assert ev["engine"] == "vllm" and ev["parallel_drafting_ok"] is True, ev
    assert ev["num_speculative_tokens"] == 3 and ev["acceptance_length"] >= 1.0
    assert ev["serving"]["batch_1"]["speedup"] > 0 and ev["serving"]["hardware"]["device"] == "cpu"
    wait_gone(processes_mentioning, str(run), 30)


def _running_engine_job(stack: Any, processes_mentioning: Any) -> tuple[str, Path]:
    """A long streaming job (the engine runs beside the trainer), once the engine is up and training runs."""
    spec = vllm_spec(optim={"max_steps": 5000, "epochs": 200}, checkpoints={"every_steps": 1000},
                     eval={"prompt_sets": [], "serve_check": False, "engine": "auto"},
                     resources={"capture": "online"})
    spec["data"]["regenerate"]["enabled"] = False
    spec["data"]["eval_samples"] = 0
    job_id = stack.submit(spec)
    run = stack.settings.resolved_artifact_root() / job_id
    stack.wait(job_id, lambda j: (j.progress or {}).get("step", 0) >= 1, 600, "training with the engine up")
    engine = [p for p in processes_mentioning(str(run / "data" / "features"))]
    assert engine, "the capture engine is not running beside the trainer"
    return job_id, run


def test_pause_and_cancel_leave_no_engine_process(make_stack, processes_mentioning):
    """Pause while the engine streams features beside the trainer: paused, nothing of the engine left;
    resume starts a new engine; cancel: cancelled, nothing left again."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from service.db import repo
    from service.db.session import session_scope

    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    job_id, run = _running_engine_job(stack, processes_mentioning)
    with session_scope(stack.factory) as s:
        _row, key = repo.create_key(s, "tests", ["read", "write"])
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(stack.settings)) as client:
        assert client.post(f"/v1/jobs/{job_id}/pause", headers=auth).status_code == 200
        job = stack.wait_status(job_id, "paused", "failed", "succeeded", "cancelled", timeout=120)
        assert job.status == "paused", (job.error_code, job.error_message, stack.logs())
        wait_gone(processes_mentioning, str(run), 60)
        step = (job.progress or {}).get("step", 0)
        assert client.post(f"/v1/jobs/{job_id}/resume", headers=auth).status_code == 200
        stack.wait(job_id, lambda j: j.status == "running" and (j.progress or {}).get("step", 0) > step, 600,
                   "training again after resume")
        assert processes_mentioning(str(run / "data" / "features")), "resumed without its engine"
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth).status_code == 200
    job = stack.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=120)
    assert job.status == "cancelled", (job.error_code, job.error_message)
    wait_gone(processes_mentioning, str(run), 60)


def test_kill9_of_the_worker_leaves_no_engine_process(make_stack, processes_mentioning):
    stack = make_stack("embedded", fake_trainer=False)
    worker = stack.start_worker()
    _job_id, run = _running_engine_job(stack, processes_mentioning)
    os.killpg(worker.pid, signal.SIGKILL)  # the worker and its supervisor; the trainer dies with them
    worker.wait(timeout=10)
    wait_gone(processes_mentioning, str(run), 60)
