"""The trainer child process of a job attempt: its command line, its environment, its start, and what its exit
code means. `worker.supervisor` runs it; nothing here touches the database.

    argv = build_command(settings=settings, spec=spec, spec_path=RUN / "job_spec.json", run_dir=RUN)
    env = trainer_env(job_id=job_id, attempt=attempt, placement=trainer_environment(spec=spec, ...))
    proc = start_trainer(argv=argv, env=env)          # own process group, dies with the worker
    failure = classify_exit(returncode=rc, stderr_tail=tail, last_error=collector.last_error)

The trainer's environment is an allow-list (`peagle.engine.environment.child_env`): it never sees the
worker's secrets and endpoints (`PEAGLE_SECRET_KEY`, `PEAGLE_DATABASE_URL`, the broker and Redis URLs);
what it reads of the service is passed by name (`trainer_env`).
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle.engine.environment import child_env
from peagle.engine.placement import job_devices
from peagle.engine.procs import spawn
from peagle.errors import EXIT_CODES
from peagle.spec import TrainSpec, parse_spec
from service.settings import Settings

__all__ = ["RESTART_CODES", "RETRYABLE_CODES", "ExitFailure", "build_command", "classify_exit", "start_trainer", "trainer_env",
           "trainer_environment"]

log = logging.getLogger(__name__)

CODE_BY_EXIT = {v: k for k, v in EXIT_CODES.items()}
CUDA_OOM = ("CUDA out of memory", "OutOfMemoryError: CUDA", "torch.OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")
HOST_OOM = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "DefaultCPUAllocator: can't allocate")

#: Failures a new submission may get past (the job's `error_retryable`).
RETRYABLE_CODES = frozenset({"resource_unavailable", "engine_failed"})
#: Failures the worker retries itself, as a crash (a new attempt, within the job's `max_restarts`): the
#: target engine (vLLM) died or could not start. The new attempt resumes from what was done: the prepared
#: data (by spec hash), the owner's regeneration cache and the last complete checkpoint.
RESTART_CODES = frozenset({"engine_failed"})


@dataclass(frozen=True)
class ExitFailure:
    """What a failed trainer exit means: the job's error code, the message its owner reads, whether a new
    submission may succeed (`retryable`), and whether the worker starts a new attempt itself (`restart`,
    within the job's `max_restarts`)."""

    code: str
    message: str
    retryable: bool
    restart: bool


def _resolved(spec: TrainSpec | dict[str, Any]) -> TrainSpec:
    """The spec with its target engine resolved as the trainer will (vLLM installed on this worker?)."""
    from peagle.engine.locate import vllm_available

    parsed = parse_spec(spec)
    return parsed.resolve(cuda_available=parsed.resources.gpus > 0, vllm_available=vllm_available())


def _placed_gpus(resources: Any) -> int | None:
    """`resources.trainer.gpus` of a split job (its trainer's GPUs on this machine), else None."""
    trainer = resources.trainer if resources.engine is not None else None
    return None if trainer is None or trainer.gpus is None else int(trainer.gpus)


def _trainer_gpus(spec: TrainSpec) -> int:
    """GPUs the trainer itself gets: `resources.trainer.gpus` of a split job when set, else the job's, less
    those a vLLM target engine takes (`job_devices`)."""
    r = spec.resources
    placed = _placed_gpus(r)
    if placed is not None:
        return placed
    return len(job_devices(r, visible=None)[1]) if r.target_engine == "vllm" and r.gpus > 0 else r.gpus


def build_command(*, settings: Settings, spec: TrainSpec | dict[str, Any], spec_path: Path, run_dir: Path
                  ) -> list[str]:
    """The trainer command line: `peagle train` (under `torchrun` when the trainer gets > 1 GPU: the job's
    GPUs, less those the vLLM target engine takes, `resources.train_gpus`); `settings.trainer_command`
    replaces `python -m peagle` when set."""
    gpus = _trainer_gpus(_resolved(spec))
    tail = ["train", str(spec_path), "--out", str(run_dir), "--progress-jsonl", "-", "--resume", "auto"]
    if settings.trainer_command:
        return [*shlex.split(settings.trainer_command), *tail]
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                "--module", "peagle", *tail]
    return [sys.executable, "-m", "peagle", *tail]


def trainer_environment(*, spec: TrainSpec | dict[str, Any], visible: str | None, regen_cache: Path | None
                        ) -> dict[str, str]:
    """What the trainer's environment adds for its target engine: its GPUs (`CUDA_VISIBLE_DEVICES`) and the
    engine's (`PEAGLE_ENGINE_DEVICES`), split by `peagle.engine.placement.job_devices`, and the owner's
    own regeneration cache (`PEAGLE_REGEN_CACHE`: a tenant never reads another's cached answers).

    Args:
        spec: the job spec.
        visible: this worker's `CUDA_VISIBLE_DEVICES` (None = every GPU torch would see, numbered from 0).
        regen_cache: the owner's regeneration cache folder.
    """
    env: dict[str, str] = {}
    if regen_cache is not None:
        env["PEAGLE_REGEN_CACHE"] = str(regen_cache)
    r = _resolved(spec).resources
    placed = _placed_gpus(r)
    if placed is not None:  # a split job's trainer: its first `resources.trainer.gpus` devices, no engine here
        if placed > 0:
            names = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(placed)]
            env["CUDA_VISIBLE_DEVICES"] = env["PEAGLE_ENGINE_DEVICES"] = ",".join(names[:placed])
        return env
    if r.gpus == 0 or r.target_engine != "vllm":
        return env
    engine, trainer = job_devices(r, visible=visible)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(trainer)
    env["PEAGLE_ENGINE_DEVICES"] = ",".join(engine)
    return env


def trainer_env(*, job_id: str, attempt: int, placement: dict[str, str], base: dict[str, str] | None = None
                ) -> dict[str, str]:
    """The trainer's whole environment: the allowed variables of the worker's (`child_env`: no secret, no
    service endpoint), the job and attempt, unbuffered output, and `placement` (`trainer_environment`).

    No Hugging Face progress bars: stderr lines become job logs, and a bar there is noise ("0%| | 0/272").
    Not TQDM_DISABLE: vLLM's serve check divides by a disabled bar's elapsed time.

    Args:
        job_id: `PEAGLE_JOB_ID`.
        attempt: `PEAGLE_ATTEMPT`.
        placement: GPUs and the regeneration cache (`trainer_environment`).
        base: the environment to filter; None = the worker's.
    """
    extra = {"PYTHONUNBUFFERED": "1", "PEAGLE_JOB_ID": job_id, "PEAGLE_ATTEMPT": str(attempt),
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", **placement}
    return child_env(extra=extra, base=base)


def start_trainer(*, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start the trainer in a process group of its own with a parent-death signal (`peagle.engine.procs`),
    stdout and stderr piped as text lines.

    Raises:
        OSError: the program cannot be started.
    """
    proc: subprocess.Popen[str] = spawn(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        bufsize=1, errors="replace")
    log.info("trainer started: pid %s, %s", proc.pid, shlex.join(argv))  # the worker log only (operators)
    return proc


def classify_exit(*, returncode: int, stderr_tail: list[str], last_error: dict[str, Any] | None) -> ExitFailure:
    """What a failed trainer exit (returncode not 0 and not 75) means.

    The exit code names the failure (`EXIT_CODES`); a generic exit 1 is refined by OOM signatures in
    stderr; the message is the trainer's last error event, else the last stderr line.
    """
    text = "\n".join(stderr_tail)
    code = CODE_BY_EXIT.get(returncode, "training_failed")
    if code in ("error", "usage", "training_failed"):
        if any(sig in text for sig in CUDA_OOM):
            code = "cuda_oom"
        elif any(sig in text for sig in HOST_OOM):
            code = "host_oom"
        else:
            code = "training_failed"
    message = (last_error or {}).get("message") or ""
    if not message:
        lines = [ln.strip() for ln in stderr_tail if ln.strip()]
        message = lines[-1] if lines else f"trainer exited with code {returncode}"
    if code == "cuda_oom" and "out of memory" not in message.lower():
        message = f"CUDA out of memory: {message}"
    if code == "host_oom" and "memory" not in message.lower():
        message = f"host out of memory: {message}"
    return ExitFailure(code=code, message=message, retryable=code in RETRYABLE_CODES, restart=code in RESTART_CODES)
