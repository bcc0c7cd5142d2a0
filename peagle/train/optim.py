"""AdamW and the learning-rate schedule (constant / linear / cosine with warmup and a floor).

The schedule is a small callable object (not a lambda) so `LambdaLR.state_dict()` stores it and a
resumed run continues the exact same curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from peagle.spec import OptimSpec

__all__ = ["LRSchedule", "build_optimizer", "build_scheduler", "total_steps", "zero_grads"]


def total_steps(optim: OptimSpec, num_batches: int) -> int:
    """Optimizer steps of a run: the micro-batches of all epochs in groups of `grad_accumulation`.

    The last group of the run may be short. Capped by `optim.max_steps`.
    """
    if num_batches < 1:
        raise ValueError("the training data has no micro-batch (num_batches == 0)")
    steps = math.ceil(optim.epochs * num_batches / optim.grad_accumulation)
    return min(steps, optim.max_steps) if optim.max_steps else steps


def build_optimizer(model: nn.Module, optim: OptimSpec) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (not norms, not `mask_hidden`)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() == 2 and name != "mask_hidden" else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel (CPU and CUDA) is several times faster than the per-tensor loop; the step is
    # dominated by the [V, H] embedding's moments, which AdamW must update every step.
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=1e-8, fused=True)


def zero_grads(optimizer: torch.optim.Optimizer, keep: list[torch.Tensor]) -> None:
    """`optimizer.zero_grad(set_to_none=True)`, except that the parameters in `keep` keep their `.grad`
    buffer, zeroed in place (the sparsely accumulated embedding gradient: re-allocating and faulting in
    a fresh [V, H] buffer every step costs more than zeroing it; values and AdamW semantics are the same,
    since those parameters get a gradient at every step anyway)."""
    kept = [(p, p.grad) for p in keep if p.grad is not None and not p.grad.is_sparse]
    optimizer.zero_grad(set_to_none=True)
    for p, grad in kept:
        p.grad = grad.zero_()


@dataclass
class LRSchedule:
    """LR multiplier at optimizer step `s`: linear warmup, then constant / linear / cosine to `min_ratio`."""

    kind: str
    warmup: int
    total: int
    min_ratio: float

    def __call__(self, s: int) -> float:
        if self.warmup > 0 and s < self.warmup:
            return (s + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total - self.warmup)
        t = min(1.0, max(0.0, (s - self.warmup) / span))
        if self.kind == "linear":
            shape = 1.0 - t
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * t))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimSpec, steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of `optim` over `steps` optimizer steps (warmup = ceil(warmup_ratio * steps))."""
    sched = LRSchedule(
        kind=optim.schedule,
        warmup=math.ceil(optim.warmup_ratio * steps),
        total=steps,
        min_ratio=optim.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, sched)
