"""`resources.engine` / `resources.trainer` (a job across machines): the fields and their cross-field checks."""

from __future__ import annotations

from peagle.spec import parse_spec
from tests.unit.spec.spec_problems import BASE, problems


def test_a_job_without_engine_is_unchanged():
    spec = parse_spec(BASE)
    assert spec.resources.engine is None and spec.resources.trainer is None


def test_engine_and_trainer_fields():
    spec = parse_spec({**BASE, "resources": {"engine": {"replicas": 2, "queue": "engine-cpu"},
                                             "trainer": {"queue": "cpu"}}})
    assert spec.resources.engine is not None and spec.resources.engine.replicas == 2
    assert spec.resources.engine.gpus == 0 and spec.resources.trainer is not None
    got = problems(resources={"engine": {"replicas": 0, "queue": "bad queue"}})
    assert "resources.engine.replicas" in got and "resources.engine.queue" in got
    assert "needs resources.engine" in problems(resources={"trainer": {"queue": "cpu"}})["resources.trainer"]


def test_split_cross_field_rules_name_the_field():
    got = problems(resources={"target_engine": "hf", "engine": {}})
    assert "vLLM" in got["resources.engine"]
    got = problems(resources={"capture": "offline", "engine": {}})
    assert "must be 'online'" in got["resources.capture"]
    got = problems(resources={"device": "cpu", "engine": {"gpus": 1}, "trainer": {"gpus": 1}})
    assert "device is 'cpu'" in got["resources.engine.gpus"] and "device is 'cpu'" in got["resources.trainer.gpus"]
    got = problems(resources={"gpus": 4, "device": "cuda", "engine": {"gpus": 2},
                              "vllm": {"tensor_parallel_size": 4}})
    assert "resources.engine.gpus (2)" in got["resources.vllm.tensor_parallel_size"]
    got = problems(resources={"engine": {}}, eval={"engine": "reference"})
    assert "engine workers" in got["eval.engine"]
