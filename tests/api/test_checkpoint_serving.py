"""Issue 18: a checkpoint's measured serving speedup (with the hardware it ran on), its AL per prompt set and
the recommended K per batch size come back from the API, and the serve command uses the recommended K."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from service.db.models import Checkpoint
from service.db.session import session_scope


def _row(k: int, b: int, speedup: float, text: str) -> dict[str, Any]:
    return {"num_speculative_tokens": k, "batch_size": b, "rounds": 3, "speedup": speedup,
            "speedup_per_round": [speedup] * 3, "base_tokens_per_s": 30.0 * b, "spec_tokens_per_s": 30.0 * b * speedup,
            "acceptance_length": 1.3, "per_position": [0.3], "base_tokens": 100, "spec_tokens": 100,
            "speedup_text": text}


HW = {"device": "cpu", "cpu": "AMD EPYC", "cpu_count": 2, "memory_gb": 23.5, "gpu": None, "gpu_count": 0}
SERVING = {
    "num_speculative_tokens": 3, "batch_sizes": [1, 8], "rounds": 3, "num_prompts": 8,
    "batch_1": _row(3, 1, 1.07, "1.07x faster"), "batch_n": _row(3, 8, 0.45, "0.45x (2.22x slower)"),
    "acceptance_length": 1.31, "per_position": [0.3, 0.01],
    "per_request_spread": {"min": 1.1, "p25": 1.2, "median": 1.3, "p75": 1.4, "max": 1.7, "mean": 1.31},
    "table": [_row(2, 1, 1.15, "1.15x faster"), _row(3, 1, 1.07, "1.07x faster"),
              _row(2, 8, 0.62, "0.62x (1.61x slower)"), _row(3, 8, 0.45, "0.45x (2.22x slower)")],
    "recommended": [{"batch_size": 1, "num_speculative_tokens": 2, "speedup": 1.15, "best_measured_k": 2},
                    {"batch_size": 8, "num_speculative_tokens": 0, "speedup": 0.62, "best_measured_k": 2}],
    "recommended_speculative_config": {"model": "", "method": "eagle3", "num_speculative_tokens": 2,
                                       "parallel_drafting": True},
    "engines": "both", "vllm_version": "0.32.0", "hardware": HW, "parallel_drafting_ok": True,
    "summary": "served speedup (vLLM on cpu AMD EPYC x2, K=3, AL 1.31): batch 1 1.07x faster, ...",
}
EVALUATION = {"engine": "vllm", "num_speculative_tokens": 3, "hardware": HW, "serving": SERVING,
              "prompt_sets": {"humaneval": {"acceptance_length": 1.31, "per_position": [0.3, 0.01],
                                            "per_request_spread": SERVING["per_request_spread"], "num_prompts": 8},
                              "sharegpt-heldout": {"acceptance_length": 1.12, "per_position": [0.1, 0.0],
                                                   "per_request_spread": None, "num_prompts": 8}}}


def _evaluated(client: TestClient, alice: dict, sim: Any, evaluation: dict[str, Any] | None) -> str:
    job = client.post("/v1/jobs", json={"preset": "demo"}, headers=alice).json()
    sim.checkpoint(job["id"], 4, {"model.safetensors": b"w"})
    with session_scope(sim.sessions) as s:
        s.execute(sa.update(Checkpoint).where(Checkpoint.job_id == job["id"]).values(evaluation=evaluation))
    return str(job["id"])


def test_checkpoints_carry_the_evaluation(client: TestClient, alice: dict, sim: Any) -> None:
    jid = _evaluated(client, alice, sim, EVALUATION)
    r = client.get(f"/v1/jobs/{jid}/checkpoints", headers=alice)
    assert r.status_code == 200, r.text
    ev = r.json()["data"][0]["evaluation"]
    assert ev["engine"] == "vllm" and set(ev["prompt_sets"]) == {"humaneval", "sharegpt-heldout"}
    assert ev["prompt_sets"]["humaneval"]["per_request_spread"]["median"] == 1.3
    serving = ev["serving"]
    assert serving["batch_1"]["speedup"] == 1.07 and serving["batch_n"]["speedup_text"] == "0.45x (2.22x slower)"
    assert serving["hardware"]["cpu"] == "AMD EPYC" and serving["acceptance_length"] == 1.31
    assert [x["num_speculative_tokens"] for x in serving["recommended"]] == [2, 0]


def test_serve_command_uses_the_recommended_k(client: TestClient, alice: dict, sim: Any) -> None:
    jid = _evaluated(client, alice, sim, EVALUATION)
    serve = client.get(f"/v1/jobs/{jid}/checkpoints/4/serve", headers=alice).json()
    cfg = json.loads(shlex.split(serve["long_command"])[4])
    assert cfg["num_speculative_tokens"] == 2 and cfg["model"] == f"./{jid}-step_000004"
    assert serve["recommended"] == SERVING["recommended"]
    # the slowdown is said plainly, with the hardware it was measured on
    assert "batch 8" in serve["speedup_note"] and "slower" in serve["speedup_note"]
    assert "AMD EPYC" in serve["speedup_note"]


def test_without_an_evaluation_the_trained_k_is_served(client: TestClient, alice: dict, sim: Any) -> None:
    jid = _evaluated(client, alice, sim, None)
    ck = client.get(f"/v1/jobs/{jid}/checkpoints", headers=alice).json()["data"][0]
    assert ck["evaluation"] is None
    serve = client.get(f"/v1/jobs/{jid}/checkpoints/4/serve", headers=alice).json()
    assert json.loads(shlex.split(serve["long_command"])[4])["num_speculative_tokens"] == 3
    assert serve["recommended"] == [] and serve["speedup_note"] is None


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_cli_lists_the_speedup(settings_factory: Any, sim: Any, live_server: Any, db_url: str) -> None:
    from typer.testing import CliRunner

    from api.main import create_app
    from peagle.cli import app as cli_app

    key = sim.key("ivy", "write")
    with live_server(create_app(settings_factory())) as srv:
        env = {"PEAGLE_URL": srv.url, "PEAGLE_API_KEY": key}
        runner = CliRunner()
        jid = json.loads(runner.invoke(cli_app, ["jobs", "submit", "--preset", "demo"], env=env).output)["id"]
        sim.checkpoint(jid, 4, {"model.safetensors": b"w"})
        with session_scope(sim.sessions) as s:
            s.execute(sa.update(Checkpoint).where(Checkpoint.job_id == jid).values(evaluation=EVALUATION))
        r = runner.invoke(cli_app, ["jobs", "checkpoints", jid], env=env)
        assert r.exit_code == 0, r.output
        assert "speedup batch 1 1.07x faster, batch 8 0.45x (2.22x slower) on AMD EPYC (2 CPUs)" in r.output
        r = runner.invoke(cli_app, ["jobs", "checkpoints", jid, "--json"], env=env)
        assert json.loads(r.output)[0]["evaluation"]["serving"]["batch_1"]["speedup"] == 1.07


def test_checkpoints_deleted_by_retention_after_a_resume_are_gone(client: TestClient, alice: dict, sim: Any) -> None:
    """A crash after steps 5 and 10, a resume that saves 25 and 30: the trainer's retention (keep_last 2, the
    best kept too) deletes 5 and 10 while the database still holds their rows (the worker of the second
    attempt never knew them). They are not listed, and their file, archive and serve command are 404."""
    from peagle.train.checkpoint import save_checkpoint  # real retention (torch), as the trainer runs it

    job = client.post("/v1/jobs", json={"preset": "tiny"}, headers=alice).json()
    run = sim.settings.resolved_artifact_root() / job["id"]
    rows = []
    for step in (5, 10, 25, 30):
        info = save_checkpoint(run / "checkpoints", step=step, epoch=0.0, training_state={"step": step},
                               metrics={"tau_sim": float(step)}, keep_last=2)
        rows.append(Checkpoint(job_id=job["id"], step=step, dir=info.dir, metrics=info.metrics, files=info.files,
                               complete=True, is_best=False))
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000025", "step_000030"]
    with session_scope(sim.sessions) as s:
        s.add_all(rows)
    sim.set(job["id"], artifact_dir=str(run), latest_checkpoint_step=30, best_checkpoint_step=30)

    listed = client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=alice).json()["data"]
    assert [c["step"] for c in listed] == [25, 30]
    base = f"/v1/jobs/{job['id']}/checkpoints"
    for step in (5, 10):
        for url in (f"{base}/{step}/files/training_state.pt", f"{base}/{step}/archive", f"{base}/{step}/serve"):
            r = client.get(url, headers=alice)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (url, r.text)
    assert client.get(f"{base}/30/archive", headers=alice).status_code == 200
    assert client.get(f"{base}/30/files/training_state.pt", headers=alice).status_code == 200
    assert client.get(f"{base}/25/serve", headers=alice).status_code == 200
