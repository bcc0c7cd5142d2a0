"""Attention machinery of the P-EAGLE draft: backends, prepared masks, kernels, carried keys / values.

The backend is picked ONCE per run (`select_attention`), and the mask of every forward is built once, by
the caller, in the form that backend runs (`peagle.train.step` does both); the draft's `forward` only
hands that mask to `attend`:

* `AttentionBackend.SDPA` (CPU, or asked for): a dense bool (True = visible) or additive float mask,
  either cut into `QueryGroups` (`group_queries`: block-sparse SDPA, each group over its visible keys;
  on CPU fp32 one `peagle.model.cpu_kernels.grouped_attention` call), or left whole as a `DenseMask`
  whose depth-0 prefix runs as its own SDPA call (`DenseMask.split`), or a plain `Tensor` (one call);
* `AttentionBackend.FLEX` (CUDA): a flex `BlockMask` (`peagle.cod.rows.block_mask_for`), run by the
  compiled `flex_attention` kernel.

`KVCarry` (with `LayerKV`) carries post-RoPE keys / values between the forwards of one
sequence-partitioned row (docs/decisions.md decision 9).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from peagle.model.cpu_kernels import grouped_attention, uses_onednn

__all__ = [
    "GROUP_MIN_ELEMENTS",
    "GROUP_QUERIES",
    "AttentionBackend",
    "AttnMask",
    "DenseMask",
    "KVCarry",
    "KernelMask",
    "LayerKV",
    "QueryGroups",
    "attend",
    "group_queries",
    "select_attention",
]


class AttentionBackend(enum.StrEnum):
    """How the draft's attention runs, chosen once per run (`select_attention`, `resources.attention`)."""

    SDPA = "sdpa"  # dense mask (whole, `DenseMask` or `QueryGroups`) -> SDPA / oneDNN grouped attention
    FLEX = "flex"  # flex `BlockMask` -> (compiled) flex_attention


def select_attention(device: torch.device | str, requested: str = "auto") -> AttentionBackend:
    """Pick the attention backend: compiled flex on CUDA, dense-mask SDPA elsewhere (no flex backward on CPU).

    Args:
        device: where the draft runs.
        requested: `auto`, `sdpa` or `flex` (`resources.attention` of the spec).
    """
    dev = torch.device(device)
    if requested == "auto":
        return AttentionBackend.FLEX if dev.type == "cuda" else AttentionBackend.SDPA
    if requested not in tuple(AttentionBackend):
        raise ValueError(f"resources.attention must be auto, sdpa or flex, got {requested!r}")
    return AttentionBackend(requested)


FLEX_RECOMPILE_LIMIT = 64  # Dynamo recompiles allowed for the compiled flex kernel (`_flex_kernel`)


def _flex_kernel(cache: dict[str, Any], q: Tensor) -> Any:
    """Compiled flex attention on CUDA with head_dim >= 16 (Inductor's limit), eager flex otherwise."""
    if q.device.type != "cuda" or q.shape[-1] < 16:
        return flex_attention
    if "flex" not in cache:
        # Dynamo keeps one cache for the flex_attention frame: each variant a run calls it in (training units,
        # the no-grad context pass of partitioned steps, evaluation, bf16 autocast or not, with or without
        # carried keys) is a recompile, and past `recompile_limit` (8 by default) Dynamo silently falls
        # back to the unfused kernel that materialises the whole score matrix (seen on an H100, torch 2.11).
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, FLEX_RECOMPILE_LIMIT)
        cache["flex"] = torch.compile(flex_attention, dynamic=True)
    return cache["flex"]


# --------------------------------------------------------------------------------------------------
# Prepared masks (built once per forward by the caller, shared by every layer)
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class QueryGroups:
    """A dense mask cut into query groups, each with only the keys it can see (block-sparse SDPA).

    COD visibility is very sparse: a query sees the depth-0 keys up to its anchor plus <= K-1 keys of
    its own chain. Queries sorted by position and cut into groups of about `GROUP_QUERIES` see only a
    prefix of the depth-0 keys and the chain keys of their positions, so one SDPA call per group over
    its visible keys does about a quarter of the work of the [N, N] call (measured 0.2-0.4 of the
    multiply-adds at T = 512..2048, K = 8), with the same result (every key left out is masked for the
    whole group). Built once per forward (`group_queries`) and shared by every layer.

    Attributes:
        groups: per group `(query_index [n_g], key_index [k_g], mask [n_g, k_g])`, the mask being the
            rows/columns of the full mask (bool or additive float).
        inverse: `[N]` permutation putting the concatenated group outputs back in element order.
    """

    groups: list[tuple[Tensor, Tensor, Tensor]]
    inverse: Tensor


GROUP_QUERIES = 160  # queries per group: big enough for efficient SDPA blocks, small enough to prune keys
GROUP_MIN_ELEMENTS = 512  # below this one SDPA call is as fast


def group_queries(mask: Tensor, position_ids: Tensor, *, group_size: int | None = None) -> QueryGroups | None:
    """Cut a dense `[Nq, Nk]` (or `[1, Nq, Nk]` / `[1, 1, Nq, Nk]`) mask into `QueryGroups`.

    Args:
        mask: bool (True = visible) or additive float (-inf = hidden) mask; Nq < Nk when the keys start
            with carried context keys (`KVCarry.past`).
        position_ids: `[Nq]` (or `[1, Nq]`) positions of the queries; queries are grouped in position order, which
            keeps each group's visible keys few for COD rows (any order is correct, only slower).
        group_size: queries per group (default `GROUP_QUERIES`).

    Returns:
        The groups, or None when Nq and Nk < `GROUP_MIN_ELEMENTS` or grouping would not save a fifth of the work.
    """
    if mask.dim() > 2 and any(int(x) != 1 for x in mask.shape[:-2]):
        return None
    m = mask.reshape(mask.shape[-2], mask.shape[-1])  # [Nq, Nk]
    n, nk = m.shape
    if n < GROUP_MIN_ELEMENTS and nk < GROUP_MIN_ELEMENTS:
        return None
    order = torch.argsort(position_ids.reshape(-1), stable=True)  # [Nq]
    groups, work = [], 0
    for q_idx in torch.split(order, group_size or GROUP_QUERIES):
        rows = m.index_select(0, q_idx)  # [n_g, Nk]
        visible = rows if rows.dtype == torch.bool else rows != float("-inf")
        k_idx = torch.nonzero(visible.any(0)).reshape(-1)  # [k_g]
        if k_idx.numel() == 0:  # a group of rows that see nothing: keep SDPA's behaviour on them
            k_idx = torch.arange(nk, device=m.device)
        groups.append((q_idx, k_idx, rows.index_select(1, k_idx)))
        work += q_idx.numel() * k_idx.numel()
    if work > 0.8 * n * nk:
        return None
    return QueryGroups(groups=groups, inverse=torch.argsort(order))


@dataclass(frozen=True, eq=False)
class DenseMask:
    """A whole dense mask whose first `prefix` queries see only the first `prefix` keys (the depth-0
    block of a COD row): `attend` then runs two SDPA calls, [P, P] and [N-P, N], instead of [N, N]
    (same result). Build it with `DenseMask.split`.

    Attributes:
        mask: dense bool or additive float mask `[N, N]` / `[B, N, N]` / `[B, 1, N, N]`.
        prefix: P (0 = one SDPA call).
    """

    mask: Tensor
    prefix: int = 0

    @classmethod
    def split(cls, mask: Tensor, is_masked: Tensor) -> DenseMask:
        """The mask with its prefix P: the leading real (unmasked) slots of every row of `is_masked`
        `[B, N]`, when the mask lets none of them see a later key (0 otherwise). Not for masks whose keys
        start with carried context keys (`KVCarry.past`): their queries are not the first keys."""
        prefix = int((is_masked.long().cumsum(-1) == 0).sum(-1).min())
        n = mask.shape[-2]
        if not 0 < prefix < n or _any_visible(mask[..., :prefix, prefix:]):
            prefix = 0
        return cls(mask, prefix)


def prepare_dense(mask: Tensor, ref_pos: Tensor, is_masked: Tensor) -> QueryGroups | DenseMask:
    """The form a dense SDPA mask `[N, N]` runs in: query groups when they pay, else one mask with its
    depth-0 prefix. The one policy for every dense caller (the trainer's units, the reference decoder's
    proposer, the benches); `ref_pos` `[N]` and `is_masked` `[N]` or `[1, N]` describe the queries."""
    groups = group_queries(mask, ref_pos)
    if groups is not None:
        return groups
    return DenseMask.split(mask, is_masked if is_masked.dim() == 2 else is_masked[None])


def _any_visible(mask: Tensor) -> bool:
    """Whether a dense (bool or additive float) mask block lets any query see any key."""
    return bool(mask.any()) if mask.dtype == torch.bool else bool((mask != float("-inf")).any())


KernelMask = Tensor | QueryGroups | BlockMask
"""What `attend` runs: a dense mask (one SDPA call, or two with a `prefix`), query groups, a flex BlockMask."""

AttnMask = KernelMask | DenseMask
"""The prepared mask a draft forward takes."""


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def attend(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: KernelMask, cache: dict[str, Any] | None = None, prefix: int = 0
) -> Tensor:
    """Masked attention with GQA, run as the mask's type says.

    Args:
        q: [B, nh, N, hd] queries (RoPE applied).
        k, v: [B, nkv, Nk, hd] keys / values.
        attn_mask: dense bool [N, Nk] or [B, N, Nk] (True = visible; SDPA), the same as an additive float
            mask in the query dtype (0 / -inf, `peagle.cod.mask.additive_mask`: built once, shared by all
            layers), `QueryGroups` of such a mask (B = 1; one SDPA call per group, or on CPU fp32 one
            `peagle.model.cpu_kernels.grouped_attention` call for all groups), or a flex `BlockMask`.
            Rows without any visible key (padding queries) must be given one by the mask builder.
        cache: holds the compiled flex kernel (one per draft layer).
        prefix: P > 0 when the first P queries see only the first P keys (`DenseMask.split` checks it on
            the mask); the dense path then runs two SDPA calls, [P, P] and [N-P, N], instead of [N, N].

    Returns:
        [B, nh, N, hd].
    """
    if isinstance(attn_mask, BlockMask):
        kernel = _flex_kernel(cache if cache is not None else {}, q)
        return kernel(q, k, v, block_mask=attn_mask, enable_gqa=True)
    if isinstance(attn_mask, QueryGroups):
        if q.shape[0] == 1 and uses_onednn(q, k, v):  # one Function for all groups, oneDNN products
            return grouped_attention(q, k, v, attn_mask.groups)  # [1, nh, N, hd]
        outs = [
            F.scaled_dot_product_attention(
                q.index_select(2, q_idx), k.index_select(2, k_idx), v.index_select(2, k_idx), attn_mask=sub,
                enable_gqa=True,
            )  # [B, nh, n_g, hd]
            for q_idx, k_idx, sub in attn_mask.groups
        ]
        return torch.cat(outs, dim=2).index_select(2, attn_mask.inverse)  # [B, nh, N, hd]
    mask = attn_mask if attn_mask.dim() == 4 else attn_mask.view(-1, 1, *attn_mask.shape[-2:])  # [B|1, 1, N, Nk]
    if 0 < prefix < q.shape[2]:
        top = F.scaled_dot_product_attention(
            q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix], attn_mask=mask[..., :prefix, :prefix],
            enable_gqa=True,
        )  # [B, nh, P, hd]
        rest = F.scaled_dot_product_attention(q[:, :, prefix:], k, v, attn_mask=mask[..., prefix:, :], enable_gqa=True)
        return torch.cat([top, rest], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# --------------------------------------------------------------------------------------------------
# Keys / values carried between the forwards of a partitioned row
# --------------------------------------------------------------------------------------------------


class _InjectGrad(torch.autograd.Function):
    """Identity on `x [B, nkv, n, hd]` whose backward adds `g [B, nkv, m, hd]` (m <= n) to the gradient
    of the first m rows: gradient that later forwards sent to these keys / values (`KVCarry.inject`)."""

    @staticmethod
    def forward(ctx, x: Tensor, g: Tensor) -> Tensor:
        ctx.save_for_backward(g)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (g,) = ctx.saved_tensors
        out = grad.clone()
        out[:, :, : g.shape[2]] += g.to(out.dtype)
        return out, None


@dataclass(eq=False)
class KVCarry:
    """Keys / values carried between the forwards of one sequence-partitioned row (docs/decisions.md decision 9).

    Every attention layer `l` uses its entry of each list that is set:

    Attributes:
        capture: each layer appends its post-RoPE `(k, v)` `[B, nkv, N, hd]` (detached): the no-grad
            pass over a row's depth-0 context.
        past: per layer `(k, v)` `[B, nkv, Nc, hd]` of Nc context keys placed BEFORE this forward's own
            keys (the mask is then `[N, Nc + N]`); leaf tensors, so their `.grad` after the backward is
            the gradient the loss sends to the context.
        inject: per layer `(gk, gv)` `[B, nkv, m, hd]`: gradient added to the post-RoPE keys / values
            of this forward's first m elements (what later forwards sent to them through `past`).
    """

    capture: list[tuple[Tensor, Tensor]] | None = None
    past: list[tuple[Tensor, Tensor]] | None = None
    inject: list[tuple[Tensor, Tensor]] | None = None

    def layer(self, i: int) -> LayerKV:
        """The view of layer `i`."""
        return LayerKV(
            capture=self.capture,
            past=self.past[i] if self.past is not None else None,
            inject=self.inject[i] if self.inject is not None else None,
        )


@dataclass(eq=False)
class LayerKV:
    """One layer's share of a `KVCarry`."""

    capture: list[tuple[Tensor, Tensor]] | None
    past: tuple[Tensor, Tensor] | None
    inject: tuple[Tensor, Tensor] | None

    def apply(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Own post-RoPE `k, v [B, nkv, N, hd]` -> the keys / values attention runs over."""
        if self.capture is not None:
            self.capture.append((k.detach(), v.detach()))
        if self.inject is not None:
            k, v = _InjectGrad.apply(k, self.inject[0]), _InjectGrad.apply(v, self.inject[1])
        if self.past is not None:
            k, v = torch.cat([self.past[0], k], dim=2), torch.cat([self.past[1], v], dim=2)  # [B, nkv, Nc+N, hd]
        return k, v
