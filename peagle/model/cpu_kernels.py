"""fp32 CPU kernels built on oneDNN products, with the same values as `F.linear` / `@` / SDPA.

PyTorch runs fp32 `mm` / `linear` on CPU through MKL's sgemm, and its CPU flash attention calls MKL for
its blocks. On AMD CPUs MKL takes a slower code path (measured on the 2-core AMD EPYC (Zen 5) bench
machine, torch 2.13: 90-110 GFLOP/s per core for the draft's shapes, e.g. [1460, 576] x [576, 1536])
while oneDNN's matmul, also shipped in every CPU build of PyTorch (`torch.ops.mkldnn._linear_pointwise`,
the kernel Inductor uses for frozen fp32 linears), reaches 210-240 GFLOP/s per core on the same shapes.
Both are plain fp32 products with fp32 accumulation (no TF32 / bf16 down-conversion): they differ only
in summation order.

* `linear(x, weight)`: `F.linear` without bias, differentiable; forward and both backward products go
  through oneDNN on CPU fp32 (`_Linear`), anything else (CUDA, autocast, fp64, bf16) is `F.linear`;
* `KernelLinear`: an `nn.Linear` whose forward is `linear` (the draft's projections, called as modules);
* `mm_nt(a, b)`: `a @ b.T` for code that computes its own gradients (`peagle.cod.loss`), same dispatch;
* `grouped_attention(q, k, v, groups)`: attention cut into query groups that each see a subset of the
  keys (`peagle.model.attention.QueryGroups`), fwd + bwd in oneDNN products; like flash attention it keeps only
  q, k, v and the output for backward and recomputes each group's probabilities there.

On Intel CPUs it is the other way round: on the 2-core Xeon (avx512_fp16) bench machine the whole train
step took 0.505 s with ATen (MKL sgemm, SDPA) and 0.659 s with these kernels. So the route is chosen per
CPU vendor (`ONEDNN = None`, the default): oneDNN on AMD, ATen elsewhere. The choice is fixed for the
machine (no timing involved), so a resumed run takes the same kernels as the run it continues.
`PEAGLE_CPU_GEMM=onednn|aten` overrides it; `ONEDNN = True / False` forces it (tests, benches). With ATen
every call is `F.linear` / `@`, and `uses_onednn` is False so callers keep their SDPA path.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ONEDNN",
    "KernelLinear",
    "auto_onednn",
    "choose_onednn",
    "cpu_vendor",
    "grouped_attention",
    "linear",
    "mm_nt",
    "uses_onednn",
]

ONEDNN: bool | None = None
"""Route fp32 CPU products through oneDNN (when this PyTorch build has it); None = by CPU (`auto_onednn`)."""


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The `vendor_id` of /proc/cpuinfo (or of the given text): "AuthenticAMD", "GenuineIntel", "" if unknown."""
    if cpuinfo is None:
        try:
            with Path("/proc/cpuinfo").open(encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read(65536)
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


def choose_onednn(setting: str | None, vendor: str) -> bool:
    """`PEAGLE_CPU_GEMM` (onednn | aten | auto / unset) and the CPU vendor -> whether to use oneDNN.

    Raises:
        ValueError: an unknown setting (names the variable and the choices).
    """
    value = (setting or "auto").strip().lower()
    if value == "onednn":
        return True
    if value in ("aten", "mkl"):
        return False
    if value != "auto":
        raise ValueError(f"PEAGLE_CPU_GEMM={setting!r}: use onednn, aten or auto")
    return vendor == "AuthenticAMD"  # MKL's fast paths are Intel's own; oneDNN is ~2x it on AMD


@functools.cache
def auto_onednn() -> bool:
    """The per-machine default of `ONEDNN` (read once per process)."""
    return choose_onednn(os.environ.get("PEAGLE_CPU_GEMM"), cpu_vendor())

_KERNEL = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def uses_onednn(*tensors: Tensor) -> bool:
    """Whether products of these tensors go through oneDNN: CPU, fp32, no autocast, `ONEDNN` on."""
    return (
        (ONEDNN if ONEDNN is not None else auto_onednn())
        and _KERNEL is not None
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not torch.is_autocast_enabled("cpu")
    )


def _plain(t: Tensor) -> Tensor:
    """`t` if it is a row- or column-major matrix (oneDNN takes both without a copy), else a copy."""
    rows, cols = t.shape
    s0, s1 = t.stride()
    if (s1 == 1 and s0 >= max(cols, 1)) or (s0 == 1 and s1 >= max(rows, 1)):
        return t
    return t.contiguous()


def _nt(a: Tensor, b: Tensor) -> Tensor:
    """`a [M, K] @ b [N, K].T -> [M, N]` through oneDNN (transposed operands are taken as they are)."""
    if a.numel() == 0 or b.numel() == 0:  # oneDNN has no empty inner products
        return a @ b.t()
    return _KERNEL(_plain(a), _plain(b), None, "none", [], "")  # type: ignore[misc]


def mm_nt(a: Tensor, b: Tensor) -> Tensor:
    """`a [M, K] @ b [N, K].T -> [M, N]`, not differentiable through oneDNN (use inside autograd Functions)."""
    if uses_onednn(a, b):
        return _nt(a, b)
    return a @ b.t()


class _Linear(torch.autograd.Function):
    """`x [M, in] @ weight [out, in].T` with the three products (forward, grad x, grad weight) in oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return _nt(x, weight)  # [M, out]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = _nt(grad, weight.t()) if ctx.needs_input_grad[0] else None  # [M, in]
        grad_w = _nt(grad.t(), x.t()) if ctx.needs_input_grad[1] else None  # [out, in]
        return grad_x, grad_w


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """`F.linear(x, weight)` (no bias): x `[*, in]`, weight `[out, in]` -> `[*, out]`."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight)
    lead = x.shape[:-1]
    return _Linear.apply(x.reshape(-1, x.shape[-1]), weight).view(*lead, weight.shape[0])


class KernelLinear(nn.Linear):
    """`nn.Linear` (same parameters, names and init) whose product is `linear` (oneDNN on CPU fp32).

    The draft's projections are these modules and are called as modules, so forward hooks, DDP and
    module wrappers see them; only the kernel behind the call differs from `nn.Linear`.
    """

    def forward(self, x: Tensor) -> Tensor:
        """x `[*, in]` -> `[*, out]`."""
        y = linear(x, self.weight)
        return y if self.bias is None else y + self.bias


Groups = Sequence[tuple[Tensor, Tensor, Tensor]]


def _probs(qh: Tensor, kh: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax probabilities `[rep, n, k]` of the queries `qh [rep * n, hd]` of one KV head over `kh [k, hd]`."""
    rep_n, k = qh.shape[0], kh.shape[0]
    s = _nt(qh, kh).view(-1, mask.shape[0], k).mul_(scale)  # [rep, n, k]
    s = s.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else s.add_(mask)
    return torch.softmax(s, dim=-1).view(rep_n // mask.shape[0], mask.shape[0], k)


class _GroupedAttention(torch.autograd.Function):
    """Masked GQA attention by query groups: for each group and KV head, `S = Q K^T` over the
    group's keys, `P = softmax(S * scale + mask)`, `O = P V`. Backward recomputes P (flash-style) and
    uses `dS = P * (dP - rowsum(dO * O))`; every product is laid out so that oneDNN reads its operands
    in place (the transposed ones are [hd, *], small)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, groups: Groups) -> Tensor:
        nh, _, hd = q.shape[1:]
        nkv = k.shape[1]
        rep, scale = nh // nkv, hd**-0.5
        # head-major copies once (the projections come in token-major layout): the per-group gathers
        # below would otherwise each copy the whole tensor
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(q)  # [1, nh, N, hd]
        for q_idx, k_idx, mask in groups:
            n = q_idx.numel()
            qg = q[0].index_select(1, q_idx).view(nkv, rep * n, hd)  # heads j*rep..j*rep+rep-1 share KV head j
            kg, vg = k[0].index_select(1, k_idx), v[0].index_select(1, k_idx)  # [nkv, k_g, hd]
            og = torch.empty_like(qg)  # [nkv, rep * n, hd]
            for j in range(nkv):
                p = _probs(qg[j], kg[j], mask, scale)  # [rep, n, k_g]
                og[j] = _nt(p.view(rep * n, -1), vg[j].t())  # [rep * n, hd]
            out[0].index_copy_(1, q_idx, og.view(nh, n, hd))
        ctx.save_for_backward(q, k, v, out)
        ctx.groups = groups
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out = ctx.saved_tensors
        nh, _, hd = q.shape[1:]
        nkv = k.shape[1]
        rep, scale = nh // nkv, hd**-0.5
        grad_out = grad_out.contiguous()
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q_idx, k_idx, mask in ctx.groups:
            n = q_idx.numel()
            qg = q[0].index_select(1, q_idx).view(nkv, rep * n, hd)
            kg, vg = k[0].index_select(1, k_idx), v[0].index_select(1, k_idx)  # [nkv, k_g, hd]
            dog = grad_out[0].index_select(1, q_idx)  # [nh, n, hd]
            delta = (dog * out[0].index_select(1, q_idx)).sum(-1, keepdim=True).view(nkv, rep, n, 1)
            dog = dog.view(nkv, rep * n, hd)
            dqg, dkg, dvg = torch.empty_like(qg), torch.empty_like(kg), torch.empty_like(vg)
            for j in range(nkv):
                p = _probs(qg[j], kg[j], mask, scale)  # [rep, n, k_g]
                dp = _nt(dog[j], vg[j]).view_as(p)  # [rep, n, k_g]
                dvg[j] = _nt(dog[j].t(), p.view(rep * n, -1).t()).t()  # [k_g, hd]
                ds = dp.sub_(delta[j]).mul_(p).mul_(scale).view(rep * n, -1)  # [rep * n, k_g]
                dqg[j] = _nt(ds, kg[j].t())  # [rep * n, hd]
                dkg[j] = _nt(qg[j].t(), ds.t()).t()  # [k_g, hd]
            grad_q[0].index_copy_(1, q_idx, dqg.view(nh, n, hd))
            grad_k[0].index_add_(1, k_idx, dkg)
            grad_v[0].index_add_(1, k_idx, dvg)
        return grad_q, grad_k, grad_v, None


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, groups: Groups) -> Tensor:
    """SDPA (scale `hd^-0.5`, GQA) of `q [1, nh, N, hd]` over `k, v [1, nkv, N, hd]` by query groups.

    Args:
        q, k, v: RoPE'd queries and keys / values, batch 1, CPU fp32 (`uses_onednn(q, k, v)`).
        groups: `(query_index [n_g], key_index [k_g], mask [n_g, k_g])` per group; the query indices
            partition `[0, N)`; `mask` is bool (True = visible) or additive float. Every query must see
            at least one key of its group.

    Returns:
        `[1, nh, N, hd]`, equal to one SDPA call with the full mask (up to summation order).
    """
    return _GroupedAttention.apply(q, k, v, groups)
