"""AdamW (with an exact row-lazy path for embedding tables), gradient clipping and the LR schedule.

`RowLazyAdamW` is `torch.optim.AdamW` (same update, same state for ordinary parameters) in which the
embedding table `[V, H]` keeps Adam moments only for the rows that ever had a gradient and consumes
the sparse row gradient of the embedding backward directly. A step touches a few hundred to a few
thousand of the V rows, so neither a dense `[V, H]` gradient nor two dense `[V, H]` moments (3 x 113 MB
at V = 49152, H = 576) are ever allocated, and the result equals dense AdamW:

* a row that never had a gradient has zero moments under dense AdamW, so its Adam term is
  `0 / (0 + eps) = 0` and its only change is the decoupled weight decay `p *= 1 - lr * wd`, which is
  applied to the whole table;
* every row that ever had a gradient holds a slot (moments), and every slot is updated at every step
  (with a zero gradient when the row is not in this step's gradient: its moments decay as under dense
  AdamW), with the same kernel and the same step count (bias correction) as the dense parameter.

The schedule is a small callable object (not a lambda) so `LambdaLR.state_dict()` stores it and a
resumed run continues the exact same curve.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.adam import adam

from peagle.spec import OptimSpec

__all__ = [
    "LRSchedule",
    "RowLazyAdamW",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm",
    "ema_beta",
    "grad_rows",
    "total_steps",
    "update_ema",
]


def total_steps(optim: OptimSpec, num_batches: int) -> int:
    """Optimizer steps of a run: the micro-batches of all epochs in groups of `grad_accumulation`.

    The last group of the run may be short. Capped by `optim.max_steps`.
    """
    if num_batches < 1:
        raise ValueError("the training data has no micro-batch (num_batches == 0)")
    steps = math.ceil(optim.epochs * num_batches / optim.grad_accumulation)
    return min(steps, optim.max_steps) if optim.max_steps else steps


def grad_rows(grad: Tensor) -> tuple[Tensor, Tensor]:
    """`(rows [k] int64 ascending, values [k, H])` of a row gradient of a `[V, H]` table.

    A sparse COO gradient (`F.embedding(..., sparse=True)`) is coalesced (duplicate rows summed); a dense
    one yields its rows with any nonzero entry (an all-zero row is the same as no row, see the module
    docstring).
    """
    if grad.is_sparse:
        g = grad if grad.is_coalesced() else grad.coalesce()
        return g.indices()[0], g.values()
    rows = torch.nonzero(grad.ne(0).any(dim=1)).reshape(-1)
    return rows, grad.index_select(0, rows)


def _scalar_dtype(fused: bool) -> torch.dtype:
    # torch.optim's state["step"] dtype: fp32 for the fused kernels, else fp64 only under an fp64 default
    return torch.float64 if not fused and torch.get_default_dtype() == torch.float64 else torch.float32


class RowLazyAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose `row_lazy` parameters (2-D tables) keep moments for touched rows only.

    Exactly dense AdamW on the same gradients (see the module docstring); ordinary parameters take the
    unchanged torch path. A row-lazy parameter accepts a sparse COO row gradient (coalesced or not) or
    a dense one. Its state is `step` (as AdamW), `rows` `[S]` int64 (slot -> table row, in the order of
    the first gradient) and `exp_avg` / `exp_avg_sq` `[S, H]`; a checkpoint of plain AdamW (dense
    moments) is converted on `load_state_dict`.

    Example:
        >>> opt = RowLazyAdamW(model.parameters(), row_lazy=[model.embed.weight], lr=1e-3, fused=True)
    """

    def __init__(self, params: Any, *, row_lazy: Sequence[Tensor] = (), **kwargs: Any) -> None:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if kwargs.get(flag):
                raise ValueError(f"RowLazyAdamW does not support {flag}=True")
        super().__init__(params, **kwargs)
        known = {id(p) for g in self.param_groups for p in g["params"]}
        for p in row_lazy:
            if p.dim() != 2 or id(p) not in known:
                raise ValueError("row_lazy parameters must be 2-D parameters of this optimizer")
        self._row_lazy = {id(p) for p in row_lazy}

    def is_row_lazy(self, p: Tensor) -> bool:
        """Whether `p` takes the row-lazy path."""
        return id(p) in self._row_lazy

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step over every parameter with a gradient (same contract as `torch.optim.AdamW`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.is_row_lazy(p):
                    self._row_lazy_step(p, group)
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("a sparse gradient on a parameter that is not row_lazy")
                state = self.state[p]
                if not state:
                    state["step"] = self._zero_step(p, group)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            self._adam(group, params, grads, exp_avgs, exp_avg_sqs, steps, group["weight_decay"])
        return loss

    @staticmethod
    def _zero_step(p: Tensor, group: dict[str, Any]) -> Tensor:
        if group["fused"]:
            return torch.zeros((), dtype=_scalar_dtype(True), device=p.device)
        return torch.tensor(0.0, dtype=_scalar_dtype(False))

    @staticmethod
    def _adam(
        group: dict[str, Any], params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor], steps: list[Tensor], weight_decay: float,
    ) -> None:
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=group["foreach"], capturable=False, differentiable=False, fused=group["fused"],
            has_complex=False, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=weight_decay, eps=group["eps"], maximize=False,
        )

    def _row_lazy_step(self, p: Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = self._zero_step(p, group)
            state["rows"] = torch.zeros(0, dtype=torch.long, device=p.device)
            state["exp_avg"] = p.new_zeros((0, p.shape[1]))
            state["exp_avg_sq"] = p.new_zeros((0, p.shape[1]))
        assert p.grad is not None, "only parameters with a gradient are stepped"
        idx, values = grad_rows(p.grad)  # [k], [k, H]
        rows = state["rows"]  # [S]
        slot_of = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)  # [V] row -> slot
        slot_of[rows] = torch.arange(rows.numel(), device=p.device)
        slot = slot_of[idx]  # [k]
        new = slot < 0
        if bool(new.any()):  # first gradient of these rows: zero moments, as dense AdamW has them
            added = idx[new]
            slot[new] = torch.arange(rows.numel(), rows.numel() + added.numel(), device=p.device)
            state["rows"] = rows = torch.cat([rows, added])
            pad = p.new_zeros((added.numel(), p.shape[1]))
            state["exp_avg"] = torch.cat([state["exp_avg"], pad])
            state["exp_avg_sq"] = torch.cat([state["exp_avg_sq"], pad])
        grad = p.new_zeros((rows.numel(), p.shape[1])).index_copy_(0, slot, values.to(p.dtype))  # [S, H]
        if group["weight_decay"] != 0:
            # decoupled decay of every row, as AdamW applies it before the Adam term (same expression)
            p.mul_(1 - group["lr"] * group["weight_decay"])
        compact = p.index_select(0, rows)  # [S, H]
        self._adam(group, [compact], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [state["step"]], 0.0)
        p.index_copy_(0, rows, compact)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`Optimizer.load_state_dict`, keeping `rows` int64 (torch casts every state tensor of a float
        parameter to its dtype) and converting dense AdamW moments of a row-lazy parameter."""
        flat = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        states = dict(state_dict["state"])
        rows: dict[int, Tensor] = {}
        for pos, p in enumerate(flat):
            pid = saved_ids[pos] if pos < len(saved_ids) else None
            if self.is_row_lazy(p) and pid in states and "rows" in states[pid]:
                entry = dict(states[pid])
                rows[pos] = entry.pop("rows")
                states[pid] = entry
        super().load_state_dict({**state_dict, "state": states})
        for pos, p in enumerate(flat):
            if not self.is_row_lazy(p) or not self.state[p]:
                continue
            state = self.state[p]
            if pos in rows:
                state["rows"] = rows[pos].to(device=p.device, dtype=torch.long)
            elif state["exp_avg"].shape == p.shape:  # plain AdamW state: keep the rows with moments
                touched = state["exp_avg"].ne(0).any(dim=1) | state["exp_avg_sq"].ne(0).any(dim=1)
                keep = torch.nonzero(touched).reshape(-1)
                state["rows"] = keep
                state["exp_avg"] = state["exp_avg"].index_select(0, keep)
                state["exp_avg_sq"] = state["exp_avg_sq"].index_select(0, keep)


def build_optimizer(model: nn.Module, optim: OptimSpec) -> RowLazyAdamW:
    """AdamW over the trainable parameters; weight decay on matrices only (not norms, not `mask_hidden`).

    Embedding tables (`nn.Embedding` weights) take the row-lazy path, so a sparse embedding gradient
    (`peagle.train.step`) is consumed as it is. With `optim.layer_lr_scale` != 1 the decoder layers
    (parameters named `layers.*`) get their own groups at `lr * layer_lr_scale`; at 1 the groups are the
    two of every earlier run, so their optimizer checkpoints still load.
    """
    scale = optim.layer_lr_scale
    plain: dict[bool, list[Tensor]] = {True: [], False: []}  # decays -> parameters
    layers: dict[bool, list[Tensor]] = {True: [], False: []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            own_rate = scale != 1.0 and name.startswith("layers.")
            (layers if own_rate else plain)[p.dim() == 2 and name != "mask_hidden"].append(p)
    param_groups: list[dict[str, Any]] = [
        {"params": plain[decays], "weight_decay": optim.weight_decay if decays else 0.0} for decays in (True, False)]
    param_groups += [{"params": layers[decays], "weight_decay": optim.weight_decay if decays else 0.0,
                      "lr": optim.lr * scale} for decays in (True, False) if layers[decays]]
    tables = [m.weight for m in model.modules() if isinstance(m, nn.Embedding) and m.weight.requires_grad]
    # The fused kernel (CPU and CUDA) is several times faster than the per-tensor loop and allocates no
    # temporaries (the foreach path allocates several parameter-sized lists per step)
    return RowLazyAdamW(param_groups, row_lazy=tables, lr=optim.lr, betas=tuple(optim.betas), eps=1e-8, fused=True)


def clip_grad_norm(params: Iterable[Tensor], max_norm: float | None) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` (L2, foreach) that also takes sparse row gradients.

    A sparse gradient is coalesced first (`p.grad` replaced; duplicate rows summed) and counts with its
    rows, so the norm is that of the dense gradient. `max_norm=None` only measures.

    Returns:
        The total norm before clipping (fp32 scalar; 0 when no parameter has a gradient).
    """
    dense, sparse = [], []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            if not p.grad.is_coalesced():
                p.grad = p.grad.coalesce()
            sparse.append(p.grad)
        else:
            dense.append(p.grad)
    if not dense and not sparse:
        return torch.zeros(())
    norms = list(torch._foreach_norm(dense, 2)) if dense else []
    norms += [torch.linalg.vector_norm(g.values(), 2) for g in sparse]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2)
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if dense:
            torch._foreach_mul_(dense, coef)
        for g in sparse:
            g.values().mul_(coef)  # the values of a coalesced tensor are a view of it
    return total


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


def ema_beta(decay: float, step: int) -> float:
    """The average's beta after optimizer step `step` (1-based): `min(decay, (1 + step) / (10 + step))`, so
    the first steps do not drag the average towards the initial weights."""
    return min(decay, (1.0 + step) / (10.0 + step))


@torch.no_grad()
def update_ema(average: dict[str, Tensor], params: dict[str, Tensor], beta: float) -> None:
    """`average[n] = beta * average[n] + (1 - beta) * params[n]`, in place, for every name of `average`."""
    for name, avg in average.items():
        avg.lerp_(params[name].detach().to(avg.dtype), 1.0 - beta)
