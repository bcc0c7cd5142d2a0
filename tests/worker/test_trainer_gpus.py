"""Issue 37: a split job's trainer runs on `resources.trainer.gpus` GPUs of its worker (torchrun over that
many, `CUDA_VISIBLE_DEVICES` its first ones); without `resources.trainer.gpus` nothing changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from peagle.spec import parse_spec
from worker.trainer import build_command, trainer_environment


def _split(trainer_gpus: int | None) -> dict[str, Any]:
    resources: dict[str, Any] = {"device": "cuda", "gpus": 4, "target_engine": "vllm", "capture": "online",
                                 "engine": {"gpus": 1, "replicas": 2}}
    if trainer_gpus is not None:
        resources["trainer"] = {"gpus": trainer_gpus}
    return {"target": {"model": "org/model"}, "resources": resources}


@pytest.fixture
def with_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("peagle.engine.locate.vllm_available", lambda: True)


def test_split_trainer_runs_on_its_own_gpu_count(with_vllm: None, tmp_path: Path) -> None:
    from service.settings import get_settings

    settings = get_settings(home=tmp_path)

    def nproc(spec: dict[str, Any]) -> list[str]:
        argv = build_command(settings=settings, spec=parse_spec(spec), spec_path=tmp_path / "s.json",
                             run_dir=tmp_path / "run")
        return [a for a in argv if a.startswith("--nproc-per-node")]

    assert nproc(_split(2)) == ["--nproc-per-node=2"]
    assert nproc(_split(1)) == []  # one GPU: no torchrun
    assert nproc(_split(None)) == ["--nproc-per-node=3"]  # as before: job_devices' split of resources.gpus
    env = trainer_environment(spec=_split(2), visible="3,5,6,7", regen_cache=None)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert trainer_environment(spec=_split(2), visible=None, regen_cache=None)["CUDA_VISIBLE_DEVICES"] == "0,1"
    before = trainer_environment(spec=_split(None), visible="3,5,6,7", regen_cache=None)
    assert before == {"CUDA_VISIBLE_DEVICES": "3,5,6", "PEAGLE_ENGINE_DEVICES": "7"}  # as before
