"""The target-engine fields of the spec: allowed vLLM flags only, GPU splits that add up, what auto becomes."""

from __future__ import annotations

import pytest

from peagle.engine.placement import split_devices
from peagle.spec import parse_spec, preset
from tests.unit.spec.spec_problems import BASE, problems


def test_extra_args_take_only_allowed_flags_with_checked_values():
    assert problems(resources={"vllm": {"extra_args": ["--max-num-seqs", "64", "--enforce-eager",
                                                       "--kv-cache-dtype=fp8"]}}) == {}
    got = problems(resources={"vllm": {"extra_args": [
        "--kv-transfer-config", '{"kv_connector_module_path": "evil"}',  # loads code of the job's choosing
        "--chat-template", "/etc/passwd",  # reads a host file
        "--max-num-seqs", "64; rm -rf /",
        "--enforce-eager=yes",
        "--seed",
    ]}})
    assert "not an allowed vllm serve flag" in got["resources.vllm.extra_args.0"]
    assert "not an allowed vllm serve flag" in got["resources.vllm.extra_args.2"]
    assert "takes an integer" in got["resources.vllm.extra_args.5"]
    assert "is a switch" in got["resources.vllm.extra_args.6"]
    assert got["resources.vllm.extra_args.7"] == "--seed needs a value"


def test_gpu_split_must_add_up():
    assert problems(resources={"gpus": 4, "capture_gpus": 2, "train_gpus": 2,
                               "vllm": {"tensor_parallel_size": 2}}) == {}
    got = problems(resources={"gpus": 4, "capture_gpus": 2, "train_gpus": 3, "vllm": {"tensor_parallel_size": 2}})
    assert "must equal resources.gpus (4)" in got["resources.train_gpus"]
    got = problems(resources={"gpus": 4, "capture_gpus": 2, "vllm": {"tensor_parallel_size": 4}})
    assert "must equal resources.capture_gpus (2)" in got["resources.vllm.tensor_parallel_size"]
    got = problems(resources={"gpus": 0, "capture_gpus": 1})
    assert "CPU job" in got["resources.capture_gpus"]
    got = problems(resources={"gpus": 0, "vllm": {"data_parallel_size": 2}})
    assert "must be 1 on a CPU job" in got["resources.vllm.data_parallel_size"]


def test_engines_that_cannot_work_are_refused_with_the_field():
    got = problems(resources={"target_engine": "vllm"}, eval={"engine": "reference"})
    assert "trainer process" in got["eval.engine"]
    got = problems(target={"model": "builtin:tiny-llama"}, resources={"target_engine": "vllm"})
    assert "head_dim 16" in got["resources.target_engine"]
    got = problems(resources={"target_engine": "hf"}, data={"sources": [{"path": "x"}],
                                                            "regenerate": {"engine": "vllm"}})
    assert "needs resources.target_engine" in got["data.regenerate.engine"]


def test_auto_resolves_by_what_is_installed_and_what_is_asked():
    demo = preset("demo")
    on = demo.resolve(cuda_available=False, vllm_available=True)
    assert (on.resources.target_engine, on.data.regenerate.engine, on.data.regenerate.enabled, on.eval.engine) == (
        "vllm", "vllm", True, "vllm")
    assert on.resources.vllm.max_model_len == demo.data.max_length + demo.data.regenerate.max_new_tokens
    off = demo.resolve(cuda_available=False, vllm_available=False)
    assert (off.resources.target_engine, off.data.regenerate.enabled, off.eval.engine) == ("hf", False, "reference")
    unknown = demo.resolve(cuda_available=False)  # the fact not given: auto stays auto
    assert unknown.resources.target_engine == "auto" and unknown.data.regenerate.enabled == "auto"
    ref = parse_spec({**BASE, "eval": {"engine": "reference"}}).resolve(cuda_available=False, vllm_available=True)
    assert ref.resources.target_engine == "hf"  # the reference decoder keeps the target in-process
    tiny = preset("tiny").resolve(cuda_available=False, vllm_available=True)
    assert tiny.resources.target_engine == "hf"
    capture_only = parse_spec(BASE).resolve(cuda_available=False, vllm_available=True)
    assert capture_only.resources.vllm.max_model_len == 2048 + 1  # one generated token after a document


def test_gpu_placement_defaults():
    spec = parse_spec({**BASE, "resources": {"gpus": 4, "vllm": {"tensor_parallel_size": 2}}})
    r = spec.resolve(cuda_available=True, vllm_available=True).resources
    assert (r.capture_gpus, r.train_gpus, r.vllm.gpu_memory_utilization) == (2, 2, 0.9)
    one = parse_spec({**BASE, "resources": {"gpus": 1}}).resolve(cuda_available=True, vllm_available=True).resources
    assert (one.capture_gpus, one.train_gpus, one.vllm.gpu_memory_utilization) == (0, 1, 0.45)  # shared
    assert split_devices(["3", "5", "6", "7"], 2, 2) == (["6", "7"], ["3", "5"])
    assert split_devices(["0"], 0, 1) == (["0"], ["0"])
    with pytest.raises(ValueError, match="at least one GPU"):
        split_devices(["0", "1"], 2, 0)
    with pytest.raises(ValueError, match="> the 2"):
        split_devices(["0", "1"], 2, 1)
