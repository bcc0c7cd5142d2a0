"""Which of a job's GPUs the engine gets and which the trainer gets (torch-free; the supervisor uses it).

    >>> split_devices(["0", "1", "2", "3"], capture_gpus=1, train_gpus=3)
    (['3'], ['0', '1', '2'])
    >>> split_devices(["4", "5"], capture_gpus=0, train_gpus=2)    # shared: the engine runs beside the trainer
    (['4', '5'], ['4', '5'])

`job_devices` is the one place a job's split is computed (the worker's supervisor before it starts the
trainer, `peagle.target.runtime` inside it when the supervisor did not say): the job's resources and the
visible devices in, (engine devices, trainer devices) out.

The trainer takes the first `train_gpus` of the job's devices (torchrun ranks 0..n-1 on them), the engine
the next `capture_gpus` (vLLM runs tensor_parallel_size x data_parallel_size workers over them). With
`capture_gpus` 0 the engine shares every GPU of the job with the trainer (its memory share is
`resources.vllm.gpu_memory_utilization`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["job_devices", "split_devices"]


def split_devices(devices: Sequence[str], capture_gpus: int, train_gpus: int) -> tuple[list[str], list[str]]:
    """(engine devices, trainer devices) of a job holding `devices` (module docstring).

    Raises:
        ValueError: the split needs more devices than the job holds, or leaves the trainer none.
    """
    devs = [str(d) for d in devices]
    if train_gpus < 1:
        raise ValueError("the trainer needs at least one GPU")
    if capture_gpus + train_gpus > len(devs):
        raise ValueError(f"{capture_gpus} engine + {train_gpus} trainer GPUs > the {len(devs)} the job holds")
    trainer = devs[:train_gpus]
    if capture_gpus == 0:
        return list(trainer), trainer
    return devs[train_gpus : train_gpus + capture_gpus], trainer


def job_devices(resources: Any, *, visible: str | None, gpu_count: int | None = None) -> tuple[list[str], list[str]]:
    """(engine devices, trainer devices) of a job with `resources` (a resolved spec's `resources`:
    `gpus`, `capture_gpus`, `train_gpus`): its first `gpus` visible devices, split by `split_devices`.

    Args:
        resources: `TrainSpec.resolve(...).resources`.
        visible: the `CUDA_VISIBLE_DEVICES` the job runs under; None or empty = devices `0..gpu_count-1`.
        gpu_count: how many devices there are when `visible` says nothing (None = `resources.gpus`).

    Raises:
        ValueError: as `split_devices`.
    """
    count = resources.gpus if gpu_count is None else gpu_count
    names = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(count)]
    return split_devices(names[: resources.gpus], resources.capture_gpus or 0, resources.train_gpus or resources.gpus)
