"""The dry-run estimate: per-phase times from earlier jobs' measured phases, its stated accuracy, the funnel."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient

from api.schemas import Funnel
from peagle.spec.funnel import FUNNEL_KEYS
from service.db.models import JobEvent, utcnow
from service.db.session import session_scope
from tests.api.conftest import Sim

PHASES = ("preparing_data", "regenerating", "capturing", "training", "evaluating", "exporting")


def _finish(sim: Sim, job_id: str, seconds: dict[str, float], steps: int) -> None:
    """Play a succeeded single-attempt job whose trainer announced its phases `seconds` apart."""
    t = utcnow() - timedelta(hours=1)
    order = [("validating", 0.0), ("preparing_data", seconds["preparing_data"]), ("capturing", seconds["capturing"]),
             ("training", seconds["training"]), ("evaluating", seconds["evaluating"]),
             ("exporting", seconds["exporting"]), ("done", 0.0)]
    with session_scope(sim.sessions) as s:
        for seq, (phase, secs) in enumerate(order, start=100):
            s.add(JobEvent(job_id=job_id, seq=seq, time=t, kind="phase", phase=phase, message=phase))
            t += timedelta(seconds=secs)
    sim.set(job_id, status="succeeded", finished_at=t, resolved_spec={"optim": {"max_steps": steps}})


def _dry(client: TestClient, headers: dict[str, str], **over: Any) -> dict[str, Any]:
    r = client.post("/v1/jobs?dry_run=true", json={"preset": "tiny", **over}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def test_no_history_states_the_calibrated_range(client: TestClient, alice: dict) -> None:
    est = _dry(client, alice)
    assert est["basis"] == "model" and est["history_jobs"] == 0
    assert "no history on queue" in est["accuracy"] and "0.6x-1.6x" in est["accuracy"]
    assert set(est["phase_seconds"]) == set(PHASES)
    assert abs(sum(est["phase_seconds"].values()) - est["wall_clock_seconds"]) < 0.5
    lo, hi = est["wall_clock_range_seconds"]
    assert lo < est["wall_clock_seconds"] < hi
    f = est["funnel"]
    assert set(f) == set(FUNNEL_KEYS) == set(Funnel.model_fields) and f["estimated"] is True
    assert sum(f["dropped_by_reason"].values()) == f["read"] - f["kept"]


def test_estimate_follows_measured_jobs(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    first = _dry(client, alice)
    model = first["phase_seconds"]
    # three earlier tiny jobs whose phases each took 3x (training: 5x) what the model says
    for factor in (0.9, 1.0, 1.1):
        job = submit(client, alice)
        secs = {p: model[p] * 3 * factor for p in PHASES}
        secs["training"] = model["training"] * 5 * factor
        _finish(sim, job["id"], secs, steps=first["optimizer_steps"])
    est = _dry(client, alice)
    assert est["basis"] == "history" and est["history_jobs"] == 3
    assert est["accuracy"].startswith("from 3 earlier jobs on queue ")
    assert abs(est["phase_seconds"]["training"] / model["training"] - 5) < 0.05
    assert abs(est["phase_seconds"]["preparing_data"] / model["preparing_data"] - 3) < 0.05
    # another device class learns nothing from them
    gpu = _dry(client, alice, overrides={"resources": {"gpus": 1, "device": "cuda"}})
    assert gpu["basis"] == "model"


def test_offline_capture_is_estimated_once_whatever_the_epochs() -> None:
    # the demo trains 4 epochs over features captured once: capture time must not scale with the epochs
    from api.estimate import estimate
    from peagle.spec import parse_spec, preset

    def phases(epochs: int) -> dict[str, float]:
        data = preset("demo").model_dump(mode="json")
        data["optim"].update(epochs=epochs, max_steps=None)
        data["resources"]["target_engine"] = "vllm"
        return dict(estimate(parse_spec(data), dataset_rows={}, queue="q", queue_position=0)["phase_seconds"])

    one, four = phases(1), phases(4)
    assert one["capturing"] > 0 and four["capturing"] == one["capturing"]
    assert four["training"] > 3 * one["training"]


def test_training_every_position_is_estimated_dearer_and_nothing_else() -> None:
    # `peagle.loss_positions` all trains 1.44x the elements of the same rows: training 1.2x, capture the same
    from api.estimate import ALL_POSITIONS_STEP_COST, estimate
    from peagle.spec import parse_spec, preset

    def phases(positions: str) -> dict[str, float]:
        data = preset("demo").model_dump(mode="json")
        data["peagle"]["loss_positions"] = positions
        data["resources"]["target_engine"] = "vllm"
        return dict(estimate(parse_spec(data), dataset_rows={}, queue="q", queue_position=0)["phase_seconds"])

    answers, every = phases("assistant"), phases("all")
    assert every["capturing"] == answers["capturing"] and every["regenerating"] == answers["regenerating"]
    assert every["training"] > answers["training"] * (1 + (ALL_POSITIONS_STEP_COST - 1) / 2)
