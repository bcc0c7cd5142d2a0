"""KL loss and COD metrics, kept as sums and counts (peagle.md decision 5, section 1.11).

Everything here is additive: a micro-batch's (or a rank's, or a segment's) `loss_sum` and `CodMetrics`
simply add up, and the division happens once at the end (`loss_sum / loss_denominator`,
`CodMetrics.finalize`). So a row split into segments, a batch split into rows, or a step split across
ranks gives the same numbers as one big forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LOSS_EPS", "CodMetrics", "cod_loss_sums", "kl_per_position", "tau_sim"]

LOSS_EPS = 1e-5
"""Lower clamp of the count denominator (an all-unsupervised micro-batch gives loss 0, not NaN)."""


class _FusedKL(torch.autograd.Function):
    """KL(p || q) per row with a one-tensor backward: d KL / d draft_logits = softmax(draft) - p.

    Autograd's own graph for `p * (log p - log_softmax(d))` keeps several `[*, Vd]` fp32 tensors alive
    for backward; this keeps exactly one (`q - p`) and skips the generic softmax backward.
    The target is treated as a constant (it never requires grad in training).
    """

    @staticmethod
    def forward(ctx, draft_logits: Tensor, target_logits: Tensor, dtype: torch.dtype) -> Tensor:  # type: ignore[override]
        log_q = F.log_softmax(draft_logits.to(dtype), dim=-1)  # [*, Vd]
        log_p = F.log_softmax(target_logits.to(dtype), dim=-1)  # [*, Vd]
        p = log_p.exp()  # [*, Vd]
        terms = p * (log_p - log_q)  # [*, Vd]
        kl = torch.where(p > 0, terms, torch.zeros_like(terms)).sum(-1)  # [*]
        del terms, log_p
        grad = log_q.exp_().sub_(p)  # [*, Vd]: q - p, in place over log_q
        ctx.save_for_backward(grad)
        ctx.in_dtype = draft_logits.dtype
        return kl

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.unsqueeze(-1)).to(ctx.in_dtype), None, None


def kl_per_position(draft_logits: Tensor, target_logits: Tensor) -> Tensor:
    """KL(target || draft) over the last axis, in fp32 (fp64 inputs stay fp64).

    `sum_v p_v (log p_v - log q_v)` with `p = softmax(target)`, `log q = log_softmax(draft)`;
    terms with p_v = 0 contribute 0. When only the draft logits require grad (training), a fused
    autograd function is used whose backward is `(softmax(draft) - p) * grad` (same values, less memory).

    Args:
        draft_logits: `[*, Vd]` draft logits (any float dtype).
        target_logits: `[*, Vd]` target logits restricted to the draft vocab.

    Returns:
        `[*]` fp32 (fp64 for fp64 inputs), >= 0, exactly 0 where the logits are equal.
    """
    dtype = torch.promote_types(torch.promote_types(draft_logits.dtype, target_logits.dtype), torch.float32)
    if draft_logits.requires_grad and not target_logits.requires_grad and torch.is_grad_enabled():
        return _FusedKL.apply(draft_logits, target_logits, dtype)
    log_q = F.log_softmax(draft_logits.to(dtype), dim=-1)  # [*, Vd]
    log_p = F.log_softmax(target_logits.to(dtype), dim=-1)  # [*, Vd]
    p = log_p.exp()  # [*, Vd]
    terms = p * (log_p - log_q)  # [*, Vd]; NaN where p = 0 and log_p = -inf
    return torch.where(p > 0, terms, torch.zeros_like(terms)).sum(-1)  # [*]


def tau_sim(acc: Tensor) -> Tensor:
    """Simulated acceptance length term `sum_k prod_{j<=k} acc_j` over depths 0..K-1.

    Example: acc = [0.5, 0.4, 0.2] -> 0.5 + 0.5*0.4 + 0.5*0.4*0.2 = 0.74.
    """
    return torch.cumprod(acc.double(), dim=0).sum().to(acc.dtype)


@dataclass
class CodMetrics:
    """Additive COD metric sums of any set of elements (detached, CPU or device tensors).

    Attributes:
        loss_sum: scalar, `sum_e w_e * KL_e` (detached).
        acc_sum: `[K]` weighted count of correct argmax predictions per depth.
        acc_total: `[K]` supervision weight per depth (`acc_total.sum()` = the loss denominator).
    """

    loss_sum: Tensor
    acc_sum: Tensor
    acc_total: Tensor

    @classmethod
    def zeros(cls, num_depths: int, device: torch.device | str = "cpu") -> CodMetrics:
        """Empty sums for K = `num_depths`."""
        z = torch.zeros(num_depths, dtype=torch.float64, device=device)
        return cls(torch.zeros((), dtype=torch.float64, device=device), z, z.clone())

    def __add__(self, other: CodMetrics) -> CodMetrics:
        return CodMetrics(
            self.loss_sum + other.loss_sum, self.acc_sum + other.acc_sum, self.acc_total + other.acc_total
        )

    def stacked(self) -> Tensor:
        """`[1 + 2K]` float64 vector (loss_sum, acc_sum, acc_total) for one SUM all-reduce."""
        return torch.cat([self.loss_sum.reshape(1), self.acc_sum, self.acc_total])

    @classmethod
    def from_stacked(cls, vec: Tensor) -> CodMetrics:
        """Inverse of `stacked`."""
        k = (vec.numel() - 1) // 2
        return cls(vec[0], vec[1 : 1 + k], vec[1 + k :])

    def finalize(self) -> dict[str, float]:
        """Divide once: `loss`, `acc_0..acc_{K-1}`, `full_acc`, `tau_sim` (floats).

        A depth with no supervised element has accuracy 0 (it would accept nothing).
        """
        total = float(self.acc_total.sum())
        acc = self.acc_sum / self.acc_total.clamp_min(LOSS_EPS)  # [K]
        out = {"loss": float(self.loss_sum) / max(total, LOSS_EPS)}
        out.update({f"acc_{d}": float(a) for d, a in enumerate(acc)})
        out["full_acc"] = float(self.acc_sum.sum()) / max(total, LOSS_EPS)
        out["tau_sim"] = float(tau_sim(acc))
        return out


def cod_loss_sums(
    draft_logits: Tensor,
    target_logits: Tensor,
    weight: Tensor,
    depth: Tensor,
    num_depths: int,
) -> tuple[Tensor, CodMetrics]:
    """Weighted KL sum (with grad) and metric sums of a set of COD elements.

    Pass only the charged elements (e.g. `sel = row.weight > 0`): the lm_head and KL are computed
    for supervised elements only. Divide the returned sum by the micro-batch's ONE denominator
    (`peagle.flat.loss_denominator`), never by a per-row or per-segment count.

    Worked example: two depth-0 elements with weights [1, 1] and KL [0.2, 0.4], one depth-1 element
    with KL 1.0, argmax hits [yes, no, yes], K=2 -> loss_sum 1.6, acc_sum [1, 1], acc_total [2, 1];
    finalize: loss 1.6/3, acc_0 0.5, acc_1 1.0, full_acc 2/3, tau_sim 0.5 + 0.5*1.0 = 1.0.

    Args:
        draft_logits: `[M, Vd]`.
        target_logits: `[M, Vd]` target logits restricted to the draft vocab.
        weight: `[M]` supervision weights (0/1).
        depth: `[M]` int64 depths in `[0, num_depths)`.
        num_depths: K.

    Returns:
        `(loss_sum, metrics)`: fp32 (or fp64) scalar `sum w * KL` carrying the graph, and detached `CodMetrics`.
    """
    kl = kl_per_position(draft_logits, target_logits)  # [M]
    w = weight.to(kl.dtype)  # [M]
    loss_sum = (w * kl).sum()
    with torch.no_grad():
        hit = (draft_logits.argmax(-1) == target_logits.argmax(-1)).double() * w.double()  # [M]
        dep = depth.long().to(w.device)
        acc_sum = torch.zeros(num_depths, dtype=torch.float64, device=w.device).index_add_(0, dep, hit)
        acc_total = torch.zeros(num_depths, dtype=torch.float64, device=w.device).index_add_(
            0, dep, w.double()
        )
        metrics = CodMetrics(loss_sum.detach().double(), acc_sum, acc_total)
    return loss_sum, metrics
