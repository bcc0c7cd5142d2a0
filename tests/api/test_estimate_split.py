"""The dry-run model of a job split over engine workers (issue 37): more replicas shorten a training phase
bound by the engines' capture, never below the trainer's own pace."""

from __future__ import annotations

from peagle.spec import parse_spec, preset
from service.estimate import model_seconds


def _spec(replicas: int | None, steps: int = 400):
    spec = preset("demo").model_dump(mode="json")
    spec["optim"]["max_steps"] = steps
    spec["resources"].update(target_engine="vllm", capture="online")
    if replicas is not None:
        spec["resources"]["engine"] = {"replicas": replicas}
    return parse_spec(spec)


def _training(spec) -> float:
    return model_seconds(spec, read=500, steps=spec.optim.max_steps, packed_rows=200)["training"]


def test_replicas_shorten_a_capture_bound_training_phase():
    one, two, many = (_training(_spec(n)) for n in (1, 2, 64))
    alone = _training(_spec(None))
    assert one > two > many  # capture-bound with few engines
    assert many >= alone  # never faster than the trainer itself (plus one engine start)
