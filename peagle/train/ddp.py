"""Multi-process training under `torchrun`: process group, DDP wrapping, row split, SUM reductions.

One trainer runs on every rank. Every rank reads the same global micro-batch index and processes the
rows `rank::world_size` of it; the loss denominator and all metrics are reduced as sums, so the result
equals one process running the whole micro-batch (tested with two gloo processes on CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DistContext", "init_distributed", "shutdown_distributed", "wrap_ddp"]


@dataclass(frozen=True)
class DistContext:
    """Rank, world size and the device collectives run on. World size 1 = no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, batch_size: int) -> list[int]:
        """Global row numbers of a micro-batch of `batch_size` rows that this rank processes."""
        return list(range(self.rank, batch_size, self.world_size))

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """SUM over ranks (a new tensor on `t`'s device and dtype; `t` itself when not distributed)."""
        if not self.enabled:
            return t
        buf = t.detach().to(self.device, copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return buf.to(t.device)

    def any(self, flag: bool) -> bool:
        """True if `flag` is true on any rank (e.g. a stop request)."""
        if not self.enabled:
            return flag
        return bool(self.all_reduce_sum(torch.tensor([float(flag)])).item() > 0)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed(device_type: str = "cpu") -> DistContext:
    """Join the process group that `torchrun` describes (env RANK/WORLD_SIZE/LOCAL_RANK).

    gloo on CPU, NCCL on CUDA (each rank on `cuda:LOCAL_RANK`). Without torchrun: world size 1.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistContext(rank=rank, world_size=world, local_rank=local, device=device)


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave the process group (if one was joined)."""
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap_ddp(module: nn.Module, ctx: DistContext) -> nn.Module:
    """DDP around the objective (no buffer broadcast, every parameter used in every forward)."""
    if not ctx.enabled:
        return module
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(
        module, device_ids=ids, broadcast_buffers=False, find_unused_parameters=False
    )
