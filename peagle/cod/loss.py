"""KL loss and COD metrics, kept as sums and counts (docs/decisions.md decision 5, docs/algorithm.md 1.11).

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

from peagle.model.cpu_kernels import mm_nt
from peagle.spec import metrics as metric_keys

__all__ = ["LOSS_EPS", "CodMetrics", "centred_logit_gap", "cod_loss_sums", "head_loss_sums", "kl_per_position",
           "target_log_probs", "tau_sim"]

LOSS_EPS = 1e-5
"""Lower clamp of the count denominator (an all-unsupervised micro-batch gives loss 0, not NaN)."""

HEAD_CHUNK_BYTES = 8 << 20
"""Bytes of one `[c, Vd]` fp32 row chunk of the fused lm_head + KL (`head_loss_sums`): a few such
buffers stay in cache, and no `[M, Vd]` tensor is ever allocated."""


def target_log_probs(target_logits: Tensor, dtype: torch.dtype, temperature: float = 1.0) -> Tensor:
    """log p of the distribution the draft is fitted to, from the target's logits (`peagle.target_temperature`).

    `log_softmax(z / T)`; T = 1 is the target's own distribution (the KL of speculators and NeMo), T < 1
    sharpens it toward the greedy token that verification accepts, and T = 0 is that token alone (log p = 0
    there, -inf elsewhere: the KL becomes the cross-entropy on the target's argmax, first index on a tie).

    Args:
        target_logits: `[*, Vd]`.
        dtype: the computation dtype (fp32 or fp64).
        temperature: T >= 0.

    Returns:
        `[*, Vd]` log-probabilities in `dtype`.

    Example: z = [2, 0, 0] -> T = 1: log softmax [-0.24, -2.24, -2.24]; T = 0: [0, -inf, -inf].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    z = target_logits.to(dtype)
    if temperature == 0:
        return torch.full_like(z, float("-inf")).scatter_(-1, z.argmax(-1, keepdim=True), 0.0)
    return F.log_softmax(z if temperature == 1 else z / temperature, dim=-1)


class _FusedKL(torch.autograd.Function):
    """KL(p || q) per row with a one-tensor backward: d KL / d draft_logits = softmax(draft) - p.

    Autograd's own graph for `p * (log p - log_softmax(d))` keeps several `[*, Vd]` fp32 tensors alive
    for backward; this keeps exactly one (`q - p`) and skips the generic softmax backward.
    The target is treated as a constant (it never requires grad in training).
    """

    @staticmethod
    def forward(ctx, draft_logits: Tensor, target_logits: Tensor, dtype: torch.dtype, temperature: float,
                logit_mse: float) -> Tensor:
        log_q = F.log_softmax(draft_logits.to(dtype), dim=-1)  # [*, Vd]
        log_p = target_log_probs(target_logits, dtype, temperature)  # [*, Vd]
        p = log_p.exp()  # [*, Vd]
        terms = p * (log_p - log_q)  # [*, Vd]
        kl = torch.where(p > 0, terms, torch.zeros_like(terms)).sum(-1)  # [*]
        del terms, log_p
        grad = log_q.exp_().sub_(p)  # [*, Vd]: q - p, in place over log_q
        if logit_mse > 0:
            term, term_grad = logit_matching(draft_logits, target_logits, dtype, logit_mse)  # [*], [*, Vd]
            kl = kl + term
            grad.add_(term_grad)
        ctx.save_for_backward(grad)
        ctx.in_dtype = draft_logits.dtype
        return kl

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None, None, None]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.unsqueeze(-1)).to(ctx.in_dtype), None, None, None, None


def kl_per_position(draft_logits: Tensor, target_logits: Tensor, temperature: float = 1.0,
                    logit_mse: float = 0.0) -> Tensor:
    """KL(target || draft) over the last axis, in fp32 (fp64 inputs stay fp64).

    `sum_v p_v (log p_v - log q_v)` with `p = softmax(target / temperature)` (`target_log_probs`; 0 = the
    target's argmax alone), `log q = log_softmax(draft)`;
    terms with p_v = 0 contribute 0. When only the draft logits require grad (training), a fused
    autograd function is used whose backward is `(softmax(draft) - p) * grad` (same values, less memory).

    Args:
        draft_logits: `[*, Vd]` draft logits (any float dtype).
        target_logits: `[*, Vd]` target logits restricted to the draft vocab.
        temperature: of the target distribution (`target_log_probs`).
        logit_mse: lambda >= 0 of the logit-matching term added to each position's KL,
            `lambda * mean_v d_v^2` with `d = centred_logit_gap(draft, target)` (`peagle.logit_mse`; 0 = none).

    Returns:
        `[*]` fp32 (fp64 for fp64 inputs), >= 0, exactly 0 where the logits are equal (at temperature 1).
    """
    if logit_mse < 0:
        raise ValueError(f"logit_mse must be >= 0, got {logit_mse}")
    dtype = torch.promote_types(torch.promote_types(draft_logits.dtype, target_logits.dtype), torch.float32)
    if draft_logits.requires_grad and not target_logits.requires_grad and torch.is_grad_enabled():
        return _FusedKL.apply(draft_logits, target_logits, dtype, temperature, logit_mse)
    log_q = F.log_softmax(draft_logits.to(dtype), dim=-1)  # [*, Vd]
    log_p = target_log_probs(target_logits, dtype, temperature)  # [*, Vd]
    p = log_p.exp()  # [*, Vd]
    terms = p * (log_p - log_q)  # [*, Vd]; NaN where p = 0 and log_p = -inf
    kl = torch.where(p > 0, terms, torch.zeros_like(terms)).sum(-1)  # [*]
    if logit_mse > 0:
        kl = kl + logit_matching(draft_logits, target_logits, dtype, logit_mse)[0]
    return kl


def _head_chunk_rows(vocab: int) -> int:
    return max(16, min(1024, HEAD_CHUNK_BYTES // (4 * max(vocab, 1))))


def _target_rows(z: Tensor, dtype: torch.dtype, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Target side of the KL for `[u, Vd]` logits: p `[u, Vd]`, `sum_v p log p` `[u]`, argmax `[u]`."""
    log_p = target_log_probs(z, dtype, temperature)  # [u, Vd]
    p = log_p.exp()  # [u, Vd]
    # p = 0 terms contribute 0: clamping log p to the finite minimum turns 0 * (-inf) into 0 * finite
    neg_entropy = (p * log_p.clamp_min_(torch.finfo(dtype).min)).sum(-1)  # [u]
    return p, neg_entropy, z.argmax(-1)


def centred_logit_gap(draft_logits: Tensor, target_logits: Tensor, dtype: torch.dtype) -> Tensor:
    """`d = (s - z) - mean_v(s - z)`: the gap between draft and target logits with each row's mean removed.

    A row's mean does not change its softmax, so it is the one part of the logits that no distribution
    fixes; `mean_v d_v^2` is the logit-matching term of `peagle.logit_mse` (Hinton et al.'s high-temperature
    limit of the KL), and its gradient w.r.t. `s` is `2 d / Vd`.

    Args:
        draft_logits, target_logits: `[*, Vd]`.
        dtype: the computation dtype (fp32 or fp64).

    Returns:
        `[*, Vd]` in `dtype`. Example: s = [1, 2, 3], z = [0, 0, 0] -> [-1, 0, 1].
    """
    gap = draft_logits.to(dtype) - target_logits.to(dtype)  # [*, Vd]
    return gap - gap.mean(-1, keepdim=True)


def logit_matching(
    draft_logits: Tensor, target_logits: Tensor, dtype: torch.dtype, logit_mse: float
) -> tuple[Tensor, Tensor]:
    """The logit-matching term of `peagle.logit_mse` and its gradient w.r.t. the draft logits, in one place.

    Args:
        draft_logits, target_logits: `[*, Vd]`.
        dtype: the computation dtype (fp32 or fp64).
        logit_mse: lambda > 0.

    Returns:
        `(lambda * mean_v d_v^2 [*], 2 lambda d / Vd [*, Vd])` with `d = centred_logit_gap(...)`, in `dtype`.
    """
    gap = centred_logit_gap(draft_logits, target_logits, dtype)  # [*, Vd]
    return logit_mse * gap.pow(2).mean(-1), gap.mul_(2.0 * logit_mse / gap.shape[-1])


class _FusedHeadKL(torch.autograd.Function):
    """`sum_r w_r KL(softmax(z_r) || softmax(x_r W^T))` over row chunks, gradients computed in forward
    (plus `lambda * mean_v d_v^2` per row with `peagle.logit_mse`: `centred_logit_gap`).

    The loss is linear in its single scalar output, so d loss / d x and d loss / d W are computed chunk by
    chunk during forward (`q - p` never exceeds one `[c, Vd]` chunk) and only scaled in backward.
    Elements are visited in target-row order, so the target side (softmax, `sum p log p`, argmax) is
    computed once per distinct target row of a chunk (a COD row's elements share a target row about 3
    times at K = 8) and gathered for its elements: `KL_r = sum p log p - sum p log q`.
    """

    @staticmethod
    def forward(
        ctx, x: Tensor, head: Tensor, target: Tensor, index: Tensor | None, weight: Tensor, temperature: float,
        logit_mse: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        m = x.shape[0]
        step = _head_chunk_rows(head.shape[0])
        grad_x = torch.empty_like(x) if want_x else None  # [M, H]
        acc = torch.promote_types(head.dtype, torch.float32)  # fp32 accumulation of bf16 chunk products
        grad_w = torch.zeros(head.shape, dtype=acc, device=head.device) if want_w else None  # [Vd, H]
        cdt = x.dtype if not torch.is_autocast_enabled(x.device.type) else torch.get_autocast_dtype(x.device.type)
        logit_dtype = cdt if cdt != x.dtype else torch.promote_types(x.dtype, head.dtype)
        dtype = torch.promote_types(torch.promote_types(logit_dtype, target.dtype), torch.float32)  # KL dtype
        order = None if index is None else torch.argsort(index, stable=True)  # [M] elements by target row
        kls, hits = [], []
        for start in range(0, m, step):
            stop = min(start + step, m)
            if order is None:
                rows = x[start:stop]  # [c, H]
                z = target[start:stop]  # [c, Vd]
                p, neg_entropy, z_arg = _target_rows(z, dtype, temperature)
                inv = None
            else:
                assert index is not None  # order exists only with an index
                elems = order[start:stop]  # [c]
                rows = x.index_select(0, elems)  # [c, H]
                uniq, inv = torch.unique_consecutive(index.index_select(0, elems), return_inverse=True)  # [u], [c]
                z = target.index_select(0, uniq)  # [u, Vd]
                p, neg_entropy, z_arg = _target_rows(z, dtype, temperature)
            logits = mm_nt(rows, head)  # [c, Vd] (bf16 under autocast)
            log_q = F.log_softmax(logits.to(dtype), dim=-1)  # [c, Vd]
            if inv is not None:
                p, neg_entropy, z_arg = p.index_select(0, inv), neg_entropy[inv], z_arg[inv]  # [c, Vd], [c], [c]
            kl = neg_entropy - torch.linalg.vecdot(p, log_q)  # [c]
            term_grad = None
            if logit_mse > 0:
                term, term_grad = logit_matching(logits, z if inv is None else z.index_select(0, inv), dtype,
                                                 logit_mse)  # [c], [c, Vd]
                kl = kl + term
            kls.append(kl)
            hits.append(logits.argmax(-1) == z_arg)  # [c]
            if want_x or want_w:
                w = weight[start:stop] if order is None else weight.index_select(0, elems)  # [c]
                w = w.to(acc)[:, None]  # [c, 1], applied to the [c, H] side (not the [c, Vd] one)
                g = log_q.exp_().sub_(p)  # [c, Vd] d KL / d logits, over log_q
                if term_grad is not None:
                    g.add_(term_grad)
                g = g.to(cdt)
                del p, term_grad
                if grad_x is not None:
                    gx = (mm_nt(g, head.to(cdt).t()) * w).to(x.dtype)  # [c, H]
                    if order is None:
                        grad_x[start:stop] = gx
                    else:
                        grad_x.index_copy_(0, elems, gx)
                if grad_w is not None:
                    grad_w.add_(mm_nt(g.t(), (rows * w).to(cdt).t()))  # [Vd, H]
        kl_all = torch.cat(kls) if kls else x.new_zeros(0, dtype=torch.float32)  # [M], visiting order
        hit_all = torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool, device=x.device)
        if order is not None:  # back to element order
            kl_all = torch.empty_like(kl_all).index_copy_(0, order, kl_all)
            hit_all = torch.empty_like(hit_all).index_copy_(0, order, hit_all)
        loss_sum = (weight.to(kl_all.dtype) * kl_all).sum()
        ctx.mark_non_differentiable(hit_all)
        ctx.save_for_backward(
            grad_x if grad_x is not None else x.new_empty(0),
            grad_w.to(head.dtype) if grad_w is not None else head.new_empty(0),
        )
        ctx.has = (want_x, want_w)
        return loss_sum, hit_all

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_hit: Tensor | None) -> tuple[Tensor | None, ...]:
        grad_x, grad_w = ctx.saved_tensors
        want_x, want_w = ctx.has
        return (
            grad_x * grad_loss.to(grad_x.dtype) if want_x else None,
            grad_w * grad_loss.to(grad_w.dtype) if want_w else None,
            None,
            None,
            None,
            None,
            None,
        )


def head_loss_sums(
    x: Tensor,
    head: Tensor,
    target: Tensor,
    target_index: Tensor | None,
    weight: Tensor,
    depth: Tensor,
    num_depths: int,
    temperature: float = 1.0,
    logit_mse: float = 0.0,
) -> tuple[Tensor, CodMetrics]:
    """`cod_loss_sums(x @ head.T, target[target_index], ...)` fused with the lm_head, in row chunks.

    Same values as `cod_loss_sums` on the materialised logits, but no `[M, Vd]` tensor is allocated:
    rows go through the lm_head, both log-softmaxes and the KL a chunk at a time (`HEAD_CHUNK_BYTES`),
    and when grad is needed the gradients w.r.t. `x` and `head` are accumulated in the same pass (the
    loss is a sum, so backward only scales them). Under autocast the matmuls run in the autocast dtype
    and the softmax / KL in fp32, as in the unfused path.

    Args:
        x: `[M, H]` normalised final hidden states of the charged elements.
        head: `[Vd, H]` lm_head weight.
        target: `[M, Vd]` target logits, or `[T, Vd]` rows picked by `target_index`.
        target_index: `[M]` int64 row of `target` of each element, or None (`target` is `[M, Vd]`).
        weight: `[M]` supervision weights.
        depth: `[M]` int64 depths in `[0, num_depths)`.
        num_depths: K.
        temperature: of the target distribution the KL fits (`target_log_probs`; 0 = its argmax).
        logit_mse: lambda of the logit-matching term (`kl_per_position`; 0 = none).

    Returns:
        `(loss_sum, metrics)` as `cod_loss_sums`.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if logit_mse < 0:
        raise ValueError(f"logit_mse must be >= 0, got {logit_mse}")
    want = torch.is_grad_enabled() and (x.requires_grad or head.requires_grad)
    if want:
        loss_sum, hit = _FusedHeadKL.apply(x, head, target, target_index, weight, temperature, logit_mse)
    else:
        with torch.no_grad():
            loss_sum, hit = _FusedHeadKL.forward(
                _NoCtx(), x, head, target, target_index, weight, temperature, logit_mse
            )
    with torch.no_grad():
        w = weight.double()
        dep = depth.long().to(w.device)
        acc_sum = torch.zeros(num_depths, dtype=torch.float64, device=w.device).index_add_(0, dep, hit.double() * w)
        acc_total = torch.zeros(num_depths, dtype=torch.float64, device=w.device).index_add_(0, dep, w)
        metrics = CodMetrics(loss_sum.detach().double(), acc_sum, acc_total)
    return loss_sum, metrics


class _NoCtx:
    """Stand-in autograd context for a forward-only call of `_FusedHeadKL.forward`."""

    needs_input_grad = (False, False, False, False, False, False, False)

    def mark_non_differentiable(self, *args: Tensor) -> None:
        pass

    def save_for_backward(self, *args: Tensor) -> None:
        pass


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
        out = {metric_keys.LOSS: float(self.loss_sum) / max(total, LOSS_EPS)}
        out.update({metric_keys.acc_key(d): float(a) for d, a in enumerate(acc)})
        out[metric_keys.FULL_ACC] = float(self.acc_sum.sum()) / max(total, LOSS_EPS)
        out[metric_keys.TAU_SIM] = float(tau_sim(acc))
        return out


def cod_loss_sums(
    draft_logits: Tensor,
    target_logits: Tensor,
    weight: Tensor,
    depth: Tensor,
    num_depths: int,
    temperature: float = 1.0,
    logit_mse: float = 0.0,
) -> tuple[Tensor, CodMetrics]:
    """Weighted KL sum (with grad) and metric sums of a set of COD elements.

    Pass only the charged elements (e.g. `sel = row.weight > 0`): the lm_head and KL are computed
    for supervised elements only. Divide the returned sum by the micro-batch's ONE denominator
    (`peagle.cod.rows.loss_denominator`), never by a per-row or per-segment count.

    Worked example: two depth-0 elements with weights [1, 1] and KL [0.2, 0.4], one depth-1 element
    with KL 1.0, argmax hits [yes, no, yes], K=2 -> loss_sum 1.6, acc_sum [1, 1], acc_total [2, 1];
    finalize: loss 1.6/3, acc_0 0.5, acc_1 1.0, full_acc 2/3, tau_sim 0.5 + 0.5*1.0 = 1.0.

    Args:
        draft_logits: `[M, Vd]`.
        target_logits: `[M, Vd]` target logits restricted to the draft vocab.
        weight: `[M]` supervision weights (0/1).
        depth: `[M]` int64 depths in `[0, num_depths)`.
        num_depths: K.
        temperature: of the target distribution (`target_log_probs`; 0 = its argmax).
        logit_mse: lambda of the logit-matching term (`kl_per_position`; 0 = none).

    Returns:
        `(loss_sum, metrics)`: fp32 (or fp64) scalar `sum w * KL` carrying the graph, and detached `CodMetrics`.
    """
    kl = kl_per_position(draft_logits, target_logits, temperature, logit_mse)  # [M]
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
