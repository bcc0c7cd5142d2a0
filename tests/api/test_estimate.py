"""The dry-run estimate: per-phase rates from comparable earlier jobs, the hardware class, its stated
accuracy, the funnel."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.checkpoint_schemas import Funnel
from peagle.spec import parse_spec, preset
from peagle.spec.funnel import FUNNEL_KEYS
from peagle.spec.hardware import cpu_facts, hardware_class
from service.db.models import JobEvent, utcnow
from service.db.session import session_scope
from service.estimate import Comparable, Measured, estimate
from tests.api.conftest import Sim

PHASES = ("preparing_data", "regenerating", "capturing", "training", "evaluating", "exporting")
HERE = hardware_class(device="cpu", cpu_flags=cpu_facts().cpu_flags)
AVX2 = frozenset({"avx", "avx2", "fma"})
BF16 = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def _finish(sim: Sim, job_id: str, seconds: dict[str, float], steps: int, resolved: dict[str, Any],
            hardware: str = HERE) -> None:
    """Play a succeeded single-attempt job whose trainer announced its phases `seconds` apart, with the
    resolved spec and the worker's hardware class the supervisor records."""
    t = utcnow() - timedelta(hours=1)
    order = [("validating", 0.0), ("preparing_data", seconds["preparing_data"]), ("capturing", seconds["capturing"]),
             ("training", seconds["training"]), ("evaluating", seconds["evaluating"]),
             ("exporting", seconds["exporting"]), ("done", 0.0)]
    with session_scope(sim.sessions) as s:
        for seq, (phase, secs) in enumerate(order, start=100):
            s.add(JobEvent(job_id=job_id, seq=seq, time=t, kind="phase", phase=phase, message=phase))
            t += timedelta(seconds=secs)
    resolved = {**resolved, "optim": {**resolved["optim"], "max_steps": steps}}
    sim.set(job_id, status="succeeded", finished_at=t, resolved_spec=resolved,
            provenance={"worker": {"hardware_class": hardware}, "trainer": None})


def _resolved(name: str, est: dict[str, Any], **over: Any) -> dict[str, Any]:
    """`name`'s preset resolved as the dry run `est` resolved it (engine, dtype), as a job row stores it."""
    spec = preset(name).resolve(cuda_available=False, vllm_available=est["target_engine"] == "vllm",
                                device_facts=cpu_facts())
    data = spec.model_dump(mode="json")
    for key, value in over.items():
        data[key] = {**data[key], **value}
    return data


def _dry(client: TestClient, headers: dict[str, str], **over: Any) -> dict[str, Any]:
    body = {"preset": "tiny", **over}
    r = client.post("/v1/jobs?dry_run=true", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def test_no_history_states_the_calibrated_range(client: TestClient, alice: dict) -> None:
    est = _dry(client, alice)
    assert est["basis"] == "model" and est["history_jobs"] == 0
    assert "no comparable history on queue" in est["accuracy"] and "0.6x-1.6x" in est["accuracy"]
    assert f"calibrated model for {HERE}" in est["accuracy"]  # the hardware class it used
    # the job's start in a worker (its trainer process) is a phase of the estimate, not of the pipeline
    assert set(est["phase_seconds"]) == {*PHASES, "starting"} and est["phase_seconds"]["starting"] > 0
    assert abs(sum(est["phase_seconds"].values()) - est["wall_clock_seconds"]) < 0.5
    lo, hi = est["wall_clock_range_seconds"]
    assert lo < est["wall_clock_seconds"] < hi
    f = est["funnel"]
    assert set(f) == set(FUNNEL_KEYS) == set(Funnel.model_fields) and f["estimated"] is True
    assert sum(f["dropped_by_reason"].values()) == f["read"] - f["kept"]


def test_estimate_follows_comparable_jobs_only(client: TestClient, alice: dict, sim: Sim, submit: Any) -> None:
    first = _dry(client, alice)
    model = first["phase_seconds"]
    resolved = _resolved("tiny", first)
    # three earlier tiny jobs whose phases each took 3x (training: 5x) what the model says
    ids = []
    for factor in (0.9, 1.0, 1.1):
        job = submit(client, alice)
        secs = {p: model[p] * 3 * factor for p in PHASES}
        secs["training"] = model["training"] * 5 * factor
        _finish(sim, job["id"], secs, steps=first["optimizer_steps"], resolved=resolved)
        ids.append(job["id"])
    # and jobs that are not comparable: another dtype, another hardware class (100x slower each)
    for other, hw in ((_resolved("tiny", first, target={"dtype": "bfloat16"}), HERE),
                      (resolved, "cpu-avx2" if HERE != "cpu-avx2" else "cpu")):
        job = submit(client, alice)
        _finish(sim, job["id"], {p: model[p] * 100 for p in PHASES}, steps=first["optimizer_steps"],
                resolved=other, hardware=hw)
    est = _dry(client, alice)
    assert est["basis"] == "history" and est["history_jobs"] == 3
    assert est["accuracy"].startswith("from 3 comparable earlier jobs (")
    assert all(i in est["accuracy"] for i in ids) and HERE in est["accuracy"]
    assert abs(est["phase_seconds"]["training"] / model["training"] - 5) < 0.05
    assert abs(est["phase_seconds"]["preparing_data"] / model["preparing_data"] - 3) < 0.05
    assert est["phase_seconds"]["starting"] == model["starting"]  # no phase event measures it: the model's
    # another device class learns nothing from them
    gpu = _dry(client, alice, overrides={"resources": {"gpus": 1, "device": "cuda"}})
    assert gpu["basis"] == "model"
    # nor does another model: the tiny jobs never inform the demo's estimate (issue 39: 10 h "±20%")
    demo = _dry(client, alice, preset="demo")
    assert demo["basis"] == "model" and demo["history_jobs"] == 0
    assert "5 earlier jobs there differ" in demo["accuracy"]


def test_a_comparable_job_of_another_size_scales_by_its_rate() -> None:
    # an earlier demo-like job over 640 conversations informs a 1920-conversation one: training, capture and
    # regeneration scale with their own work (tokens), not with the earlier job's seconds
    def spec(n: int) -> Any:
        data = preset("demo").model_dump(mode="json")
        data["data"]["sources"][0]["max_samples"] = n
        data["optim"]["max_steps"] = None
        data["resources"]["target_engine"] = "vllm"
        return parse_spec(data)

    small = spec(640).resolve(cuda_available=False, vllm_available=True, device_facts=cpu_facts())
    seen = estimate(small, dataset_rows={}, queue="q", queue_position=0, vllm_available=True)
    key = Comparable.of(small.model_dump(mode="json"), HERE)
    slow = {p: 2 * s for p, s in seen["phase_seconds"].items()}  # a machine twice as slow as modelled
    past = Measured(job_id="job_small", spec=small, key=key, phase_seconds=slow, steps=seen["optimizer_steps"],
                    regen_tokens=round(seen["funnel"]["read"] * 1.5 * 256 * 0.6))
    big_model = estimate(spec(1920), dataset_rows={}, queue="q", queue_position=0, vllm_available=True)
    big = estimate(spec(1920), dataset_rows={}, queue="q", queue_position=0, vllm_available=True, history=[past])
    assert big["basis"] == "history" and "job_small" in big["accuracy"]
    for phase in ("regenerating", "capturing", "training"):
        # measured twice as slow as modelled: so is the bigger job (the engine starts do not grow with it)
        ratio = big["phase_seconds"][phase] / big_model["phase_seconds"][phase]
        assert 1.8 < ratio < 2.2, (phase, ratio)
    assert big["phase_seconds"]["training"] > 2.5 * slow["training"]  # scaled up with the steps, not copied
    # every answer cached: the earlier job's regeneration measured no rate, the model stands for it
    cached = Measured(job_id="job_cached", spec=small, key=key, phase_seconds=slow, steps=seen["optimizer_steps"],
                      regen_tokens=0)
    est = estimate(spec(1920), dataset_rows={}, queue="q", queue_position=0, vllm_available=True, history=[cached])
    assert est["phase_seconds"]["regenerating"] == big_model["phase_seconds"]["regenerating"]
    assert "regenerating" in est["accuracy"].split(": calibrated model")[0].split(";")[-1]


def test_the_cpu_class_and_dtype_choose_the_constants() -> None:
    # the same demo on an AVX2-only CPU: fp32 (auto), the avx2 constants, and the answer names the class
    data = preset("demo").model_dump(mode="json")
    data["resources"]["target_engine"] = "vllm"
    demo = parse_spec(data)
    fast = estimate(demo, dataset_rows={}, queue="q", queue_position=0, vllm_available=True, cpu_flags=BF16)
    slow = estimate(demo, dataset_rows={}, queue="q", queue_position=0, vllm_available=True, cpu_flags=AVX2)
    assert fast["target_dtype"] == "bfloat16" and slow["target_dtype"] == "float32"
    assert "calibrated model for cpu-bf16 with the target in bfloat16" in fast["accuracy"]
    assert "calibrated model for cpu-avx2 with the target in float32" in slow["accuracy"]
    for phase in ("regenerating", "capturing", "evaluating"):  # the target's work: fp32 on AVX2
        assert slow["phase_seconds"][phase] > 2 * fast["phase_seconds"][phase], phase
    assert slow["phase_seconds"]["training"] > 1.15 * fast["phase_seconds"]["training"]  # the draft's: AVX2
    # bf16 forced on the AVX2 CPU (emulated) is slower still than its fp32
    data["target"]["dtype"] = "bfloat16"
    forced = estimate(parse_spec(data), dataset_rows={}, queue="q", queue_position=0, vllm_available=True,
                      cpu_flags=AVX2)
    assert forced["phase_seconds"]["regenerating"] > 3 * slow["phase_seconds"]["regenerating"]


def test_hardware_classes() -> None:
    assert hardware_class(device="cpu", cpu_flags=BF16) == "cpu-bf16"
    assert hardware_class(device="cpu", cpu_flags=frozenset({"avx2", "avx512f"})) == "cpu-avx512"
    assert hardware_class(device="cpu", cpu_flags=AVX2) == "cpu-avx2"
    assert hardware_class(device="cpu", cpu_flags=frozenset({"sse4_2"})) == "cpu"
    assert hardware_class(device="cuda", gpus=2) == "cuda-2gpu" and hardware_class(device="cuda") == "cuda-1gpu"
    # the worker records this machine's class on each job, and history reads it back from there
    from api.history import job_hardware
    from worker.provenance import worker_provenance

    prov = {"worker": worker_provenance(argv=[], attempt=0), "trainer": None}
    assert job_hardware({"resources": {"device": "cpu"}}, prov) == HERE
    assert job_hardware({"resources": {"device": "cuda", "gpus": 2}}, prov) == "cuda-2gpu"
    assert job_hardware({"resources": {"device": "cpu"}}, {"worker": {}}) is None  # not recorded: not comparable


def test_readme_demo_figures_are_what_the_dry_run_computes() -> None:
    # the README's quickstart states the demo's funnel and steps: they must be the dry run's own numbers
    est = estimate(preset("demo"), dataset_rows={}, queue="q", queue_position=0, vllm_available=True)
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    text = " ".join(text.split())  # the figures may wrap across lines
    found = {k: int(m.group(1).replace(",", "")) for k, m in (
        ("read", re.search(r"([\d,]+) ShareGPT conversations read", text)),
        ("trained", re.search(r"\(([\d,]+) trained on\)", text)),
        ("steps", re.search(r"\(([\d,]+) steps\)", text)),
    ) if m is not None}
    assert found == {"read": est["funnel"]["read"], "trained": est["funnel"]["train_conversations"],
                     "steps": est["optimizer_steps"]}, json.dumps(found)


def test_offline_capture_is_estimated_once_whatever_the_epochs() -> None:
    # the demo trains 4 epochs over features captured once: capture time must not scale with the epochs
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
    from service.estimate import ALL_POSITIONS_STEP_COST

    def phases(positions: str) -> dict[str, float]:
        data = preset("demo").model_dump(mode="json")
        data["peagle"]["loss_positions"] = positions
        data["resources"]["target_engine"] = "vllm"
        return dict(estimate(parse_spec(data), dataset_rows={}, queue="q", queue_position=0)["phase_seconds"])

    answers, every = phases("assistant"), phases("all")
    assert every["capturing"] == answers["capturing"] and every["regenerating"] == answers["regenerating"]
    assert every["training"] > answers["training"] * (1 + (ALL_POSITIONS_STEP_COST - 1) / 2)
