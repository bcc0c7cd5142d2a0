"""The job spec's `resources` section: devices, the vLLM engine's flags, queues, split jobs' engine and trainer.

Part of the one job spec (`peagle.spec.schema.TrainSpec`, which re-exports these names); torch-free.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from peagle.spec.base import Strict

__all__ = ["ENGINE_QUEUE_PREFIX", "RESERVED_QUEUES", "VLLM_EXTRA_FLAGS", "EngineResources", "ResourceSpec",
           "TrainerResources", "VllmSpec", "queue_problem"]


#: Flags a job may pass to `vllm serve` in `resources.vllm.extra_args` (each with the kind of value it takes:
#: `None` = a switch). Anything else is refused: a flag such as `--kv-transfer-config` or `--chat-template`
#: would load code or read files of the worker's choosing, `--port`/`--host` would break the engine's
#: supervision.
VLLM_EXTRA_FLAGS: dict[str, str | None] = {
    "--max-num-seqs": "int",
    "--max-num-batched-tokens": "int",
    "--block-size": "int",
    "--swap-space": "float",
    "--cpu-offload-gb": "float",
    "--kv-cache-dtype": "word",
    "--quantization": "word",
    "--seed": "int",
    "--pipeline-parallel-size": "int",
    "--enable-expert-parallel": None,
    "--enable-chunked-prefill": None,
    "--no-enable-chunked-prefill": None,
    "--enforce-eager": None,
    "--disable-custom-all-reduce": None,
}


class VllmSpec(Strict):
    """How the vLLM target engine runs (passed through to `vllm serve`)."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="`--tensor-parallel-size`.")
    data_parallel_size: int = Field(default=1, ge=1, le=64, description="`--data-parallel-size`.")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0,
        description="`--gpu-memory-utilization`; None = 0.9 on GPUs the engine has alone, 0.45 on a GPU it "
        "shares with the trainer.",
    )
    max_model_len: int | None = Field(
        default=None, ge=16, le=1_048_576,
        description="`--max-model-len`; None = data.max_length + data.regenerate.max_new_tokens (+ 1 without regeneration).",
    )
    extra_args: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(
        default_factory=list, max_length=32,
        description="More `vllm serve` flags, only from an allowed list (`peagle.spec.schema.VLLM_EXTRA_FLAGS`: "
        "scheduling, cache, quantization); e.g. `[\"--max-num-seqs\", \"64\"]`.",
    )


_QUEUE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: The engine queue beside a job queue `q` is `engine-<q>` (`service.queue.engine_queue`): engine workers
#: consume those, trainer workers the others.
ENGINE_QUEUE_PREFIX = "engine-"
#: Names the broker keeps for itself: Celery's default queue and event queues, kombu's bookkeeping keys on
#: Redis; and suffixes of a worker's own queues (worker-direct `<node>.dq2`, the control `.pidbox`).
RESERVED_QUEUES = frozenset({"celery", "celeryev", "unacked", "unacked_index", "unacked_mutex"})
_RESERVED_QUEUE_PREFIXES = ("celery.", "celeryev.")
_RESERVED_QUEUE_SUFFIXES = (".dq", ".dq2", ".pidbox")


def queue_problem(name: str, *, engine: bool = False) -> str | None:
    """Why `name` cannot be a job's queue (`engine`: the queue of its engine chunks), or None.

    A job queue is never an engine queue (`engine-...`: its task would wait among engine chunks, for engine
    workers), an engine queue always is one, and neither is a name the broker keeps (`RESERVED_QUEUES`).

        >>> queue_problem("engine-cpu") is not None, queue_problem("engine-cpu", engine=True)
        (True, None)
    """
    if (name in RESERVED_QUEUES or name.startswith(_RESERVED_QUEUE_PREFIXES)
            or name.endswith(_RESERVED_QUEUE_SUFFIXES)):
        return (f"{name!r} is a name the broker keeps for itself (Celery's default and event queues, kombu's "
                "bookkeeping, a worker's own queues): choose another")
    is_engine = name.startswith(ENGINE_QUEUE_PREFIX) and len(name) > len(ENGINE_QUEUE_PREFIX)
    if engine and not is_engine:
        return (f"must be an engine queue ('{ENGINE_QUEUE_PREFIX}<queue>', what engine workers consume), "
                f"got {name!r}")
    if not engine and name.startswith(ENGINE_QUEUE_PREFIX):
        return (f"{name!r} is an engine queue ('{ENGINE_QUEUE_PREFIX}<queue>' holds split jobs' engine chunks for "
                "engine workers): name a queue of trainer workers")
    return None


def _checked_queue(value: str | None, *, engine: bool) -> str | None:
    why = queue_problem(value, engine=engine) if value is not None else None
    if why is not None:
        raise PydanticCustomError("queue_name", why)
    return value


class EngineResources(Strict):
    """The target's engine as Celery tasks on engine workers (a job across machines, docs/service.md)."""

    gpus: int = Field(
        default=0, ge=0, le=64,
        description="GPUs per engine replica, its tensor parallel size (0 = a CPU engine; > 0 needs resources.device "
        "'cuda').",
    )
    replicas: int = Field(default=1, ge=1, le=64, description="The most engine chunk tasks of this job at once.")
    queue: str | None = Field(
        default=None, pattern=_QUEUE_NAME,
        description="Celery queue of the engine chunks, an engine queue (`engine-...`); None = `engine-<the job's "
        "queue>`.",
    )

    @field_validator("queue")
    @classmethod
    def _engine_queue(cls, value: str | None) -> str | None:
        return _checked_queue(value, engine=True)


class TrainerResources(Strict):
    """The trainer of a job whose engine runs on engine workers (`resources.engine`)."""

    gpus: int | None = Field(
        default=None, ge=0, le=64, description="GPUs of the trainer on its machine (torchrun); None = resources.gpus."
    )
    queue: str | None = Field(default=None, pattern=_QUEUE_NAME, description="Celery queue (not an engine queue, "
                              "`engine-...`); None = the job's queue.")

    @field_validator("queue")
    @classmethod
    def _job_queue(cls, value: str | None) -> str | None:
        return _checked_queue(value, engine=False)


class ResourceSpec(Strict):
    """Hardware and placement."""

    gpus: int = Field(default=0, ge=0, le=64, description="GPUs for this job (0 = CPU; >1 runs torchrun/DDP).")
    target_engine: Literal["auto", "hf", "vllm"] = Field(
        default="auto",
        description="Where the target runs for regeneration and feature capture: vllm (an inference engine "
        "beside a draft-only trainer: any target size, its own tensor/data parallelism) or hf (transformers, "
        "in the trainer process); auto = vllm where vLLM is installed (its venv or this environment) and "
        "eval.engine is not reference, else hf.",
    )
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="The vLLM engine (target_engine vllm).")
    capture_gpus: int | None = Field(
        default=None, ge=0, le=64,
        description="GPUs of `gpus` for the vLLM engine; None = tensor_parallel_size x data_parallel_size when "
        "gpus leaves the trainer at least one, else shared with the trainer.",
    )
    train_gpus: int | None = Field(
        default=None, ge=0, le=64, description="GPUs of `gpus` for the trainer (torchrun); None = the rest."
    )
    capture: Literal["online", "offline"] = Field(
        default="online",
        description="Target features computed as training goes (online: in the loop with hf; with vllm the "
        "engine runs ahead of the trainer and consumed shards are deleted) or all cached to disk first.",
    )
    feature_disk_gb: float = Field(
        default=20.0, gt=0.0, le=100_000.0,
        description="Disk the engine may fill with feature shards ahead of the trainer (online capture with "
        "vllm); the engine waits when it is reached.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto = cuda if available.")
    attention: Literal["auto", "sdpa", "flex"] = Field(
        default="auto", description="auto = compiled flex attention on CUDA, dense-mask SDPA on CPU."
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto", description="auto = bf16 autocast on CUDA (fp32 master weights), fp32 on CPU."
    )
    max_restarts: int = Field(default=2, ge=0, le=100, description="Automatic resumes after a crash.")
    engine: EngineResources | None = Field(
        default=None,
        description="Run regeneration and capture as chunk tasks on engine workers (any number of machines sharing "
        "the artifact volume), streamed to the trainer; None = the whole job in one worker.",
    )
    trainer: TrainerResources | None = Field(
        default=None, description="Where the trainer of a `resources.engine` job runs (needs resources.engine)."
    )
