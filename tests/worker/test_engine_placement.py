"""Issue 17 placement: the supervisor gives the trainer and the vLLM engine their own GPUs of the job, runs
torchrun over the trainer's share only, and points regeneration at the owner's own cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle.spec import parse_spec
from worker.trainer import build_command, trainer_environment

GPU_JOB = {"target": {"model": "org/model"}, "resources": {"gpus": 4, "capture_gpus": 1, "train_gpus": 3,
                                                           "target_engine": "vllm"}}


@pytest.fixture
def with_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("peagle.engine.locate.vllm_available", lambda: True)


def test_gpus_split_between_engine_and_trainer(with_vllm: None, tmp_path: Path) -> None:
    env = trainer_environment(spec=GPU_JOB, visible="2,3,4,5,6", regen_cache=tmp_path / "owner-7")
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3,4", "PEAGLE_ENGINE_DEVICES": "5",
                   "PEAGLE_REGEN_CACHE": str(tmp_path / "owner-7")}
    shared = trainer_environment(spec={**GPU_JOB, "resources": {"gpus": 1, "target_engine": "vllm"}}, visible=None,
                                 regen_cache=None)
    assert shared == {"CUDA_VISIBLE_DEVICES": "0", "PEAGLE_ENGINE_DEVICES": "0"}  # one GPU: shared
    hf = trainer_environment(spec={**GPU_JOB, "resources": {"gpus": 2, "target_engine": "hf"}}, visible="0,1",
                             regen_cache=None)
    assert hf == {}  # no engine: the trainer keeps the worker's GPUs as before


def test_torchrun_runs_over_the_trainer_share(with_vllm: None, tmp_path: Path) -> None:
    from service.settings import get_settings

    settings = get_settings(home=tmp_path)
    argv = build_command(settings=settings, spec=parse_spec(GPU_JOB), spec_path=tmp_path / "spec.json",
                         run_dir=tmp_path / "run")
    assert "--nproc-per-node=3" in argv
    one = build_command(settings=settings, spec=parse_spec({**GPU_JOB, "resources": {"gpus": 2, "capture_gpus": 1,
                                                                                    "target_engine": "vllm"}}),
                        spec_path=tmp_path / "spec.json", run_dir=tmp_path / "run")
    assert "torch.distributed.run" not in one  # one trainer GPU: a plain process
