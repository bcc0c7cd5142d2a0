"""Multi-process training under `torchrun`: process group, DDP wrapping, row split, SUM reductions.

One trainer runs on every rank. Every rank reads the same global micro-batch index and processes the
rows `rank::world_size` of it; the loss denominator and all metrics are reduced as sums, so the result
equals one process running the whole micro-batch (tested with two gloo processes on CPU).

Parameters with a sparse row gradient (the embedding table, `peagle.train.step`) are left out of DDP's
buckets (its reducer expects dense gradients, and NCCL has no sparse all-reduce); after the last
backward of an optimizer step `all_reduce_row_grads` averages them over the ranks as DDP would: the
union of the rows of all ranks is all-reduced as one compact `[rows, H]` tensor.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["DistContext", "all_reduce_row_grads", "init_distributed", "shutdown_distributed", "wrap_ddp"]


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


def wrap_ddp(module: nn.Module, ctx: DistContext, *, row_params: Sequence[str] = ()) -> nn.Module:
    """DDP around the objective (no buffer broadcast, every parameter used in every forward).

    Args:
        module: the objective.
        ctx: the DDP context; world size 1 returns `module` itself.
        row_params: names (in `module`) of the parameters DDP leaves alone: their sparse gradients are
            averaged by `all_reduce_row_grads`; their values are broadcast from rank 0 here, as DDP does
            for its own parameters.
    """
    if not ctx.enabled:
        return module
    if row_params:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(row_params))
        named = dict(module.named_parameters())
        with torch.no_grad():
            for name in row_params:
                dist.broadcast(named[name].data, src=0)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(
        module, device_ids=ids, broadcast_buffers=False, find_unused_parameters=False
    )


def all_reduce_row_grads(params: Sequence[Tensor], ctx: DistContext) -> None:
    """Average the sparse row gradients of `params` (`[V, H]` tables) over the ranks, in place of `.grad`.

    Every rank calls this once per optimizer step, with the same parameters, whether or not it has a
    gradient (a missing one counts as no rows). Each `.grad` becomes a coalesced sparse tensor over the
    union of the ranks' rows holding SUM(grad) / world_size (DDP's average). World size 1: no-op.
    """
    if not ctx.enabled:
        return
    for p in params:
        g = p.grad
        if g is None:
            rows = torch.zeros(0, dtype=torch.long, device=p.device)
            values = p.new_zeros((0, p.shape[1]))
        else:
            if not g.is_sparse:
                raise ValueError("all_reduce_row_grads expects sparse row gradients")
            g = g.coalesce()
            rows, values = g.indices()[0], g.values()
        count = torch.tensor([rows.numel()], dtype=torch.long, device=ctx.device)
        counts = [torch.zeros_like(count) for _ in range(ctx.world_size)]
        dist.all_gather(counts, count)
        width = int(max(int(c) for c in counts))
        padded = torch.full((width,), -1, dtype=torch.long, device=ctx.device)
        padded[: rows.numel()] = rows.to(ctx.device)
        gathered = [torch.empty_like(padded) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, padded)
        union = torch.unique(torch.cat(gathered))  # sorted
        union = union[union >= 0]  # [U]
        compact = values.new_zeros((union.numel(), p.shape[1])).to(ctx.device)  # [U, H]
        compact.index_copy_(0, torch.searchsorted(union, rows.to(ctx.device)), values.to(ctx.device))
        compact.div_(ctx.world_size)  # DDP divides before its SUM all-reduce
        dist.all_reduce(compact, op=dist.ReduceOp.SUM)
        p.grad = torch.sparse_coo_tensor(
            union[None].to(p.device), compact.to(p.device), tuple(p.shape), is_coalesced=True,
            check_invariants=True,
        )
