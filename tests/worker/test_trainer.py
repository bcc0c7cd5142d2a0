"""The trainer's command line and what its exit codes mean (`worker.trainer`)."""

from __future__ import annotations

from pathlib import Path

from peagle.errors import EXIT_CODES
from peagle.spec import preset
from service.settings import Settings
from worker.trainer import ExitFailure, build_command, classify_exit


def _exit(returncode: int, stderr_tail: list[str], last_error: dict[str, str] | None = None) -> ExitFailure:
    return classify_exit(returncode=returncode, stderr_tail=stderr_tail, last_error=last_error)


def test_classify_exit_codes_and_oom_signatures() -> None:
    f = _exit(4, [], {"code": "data_invalid", "message": "f.json: line 3: bad"})
    assert (f.code, f.message, f.retryable) == ("data_invalid", "f.json: line 3: bad", False)
    oom = _exit(1, ["Traceback", "torch.OutOfMemoryError: CUDA out of memory. Tried"])
    assert oom.code == "cuda_oom" and "CUDA out of memory" in oom.message
    assert _exit(1, ["RuntimeError: DefaultCPUAllocator: can't allocate memory"]).code == "host_oom"
    target = _exit(5, ["error: cannot load target"])
    assert (target.code, target.message) == ("target_load_failed", "error: cannot load target")
    assert _exit(3, []).code == "spec_invalid" and _exit(6, []).code == "cuda_oom"
    boom = _exit(1, ["ValueError: boom"])
    assert (boom.code, boom.message) == ("training_failed", "ValueError: boom")


def test_only_an_engine_failure_restarts_the_attempt() -> None:
    engine = _exit(EXIT_CODES["engine_failed"], ["error: engine died"])
    assert (engine.code, engine.retryable, engine.restart) == ("engine_failed", True, True)
    resource = _exit(EXIT_CODES["resource_unavailable"], ["error: mask too large"])
    assert (resource.code, resource.retryable, resource.restart) == ("resource_unavailable", True, False)
    assert not any(_exit(EXIT_CODES[c], []).restart for c in ("data_invalid", "spec_invalid", "cuda_oom"))


def test_build_command_uses_torchrun_for_several_gpus(tmp_path: Path) -> None:
    spec = preset("tiny").model_dump(mode="json")
    one = build_command(settings=Settings(), spec=spec, spec_path=tmp_path / "s.json", run_dir=tmp_path)
    assert one[1:4] == ["-m", "peagle", "train"] and one[-2:] == ["--resume", "auto"]
    spec["resources"].update(gpus=4, device="cuda")  # a valid spec: the supervisor parses it into a TrainSpec
    multi = build_command(settings=Settings(), spec=spec, spec_path=tmp_path / "s.json", run_dir=tmp_path)
    assert multi[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=4" in multi
    assert multi[multi.index("--module") + 1] == "peagle"
