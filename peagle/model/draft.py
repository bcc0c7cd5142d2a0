"""The P-EAGLE draft network: a Llama-style EAGLE-3 draft with parallel-drafting extras.

Reads top to bottom like `transformers.models.llama.modeling_llama`:
`DraftConfig` -> `select_attention` -> `QueryGroups` / `group_queries` -> `attend` (SDPA with a dense
mask, cut into query groups that each see only their visible keys, or flex attention with a `BlockMask`)
-> `KVCarry` (context keys / values carried between the forwards of a partitioned row) -> `PEagleAttention`
-> `PEagleFirstLayer` (fused, 2H attention input) -> `PEagleLayer` (plain pre-norm block) -> `PEagleDraft`
-> `init_from_target` (embeddings, lm_head rows) -> `init_layers_from_target` (spec `draft.layer_init`).

Architecture (peagle.md section 1.5, decision 6):
- `embed_tokens` [V, H] (initialised from the target, trainable unless frozen by the spec);
- `fc` [H, 3H] projects the 3 captured target hidden states (or `mask_hidden` at masked slots) to H;
- `layers.0` attends over `[input_layernorm(emb) ; hidden_norm(hid)]` (2H) with the un-normalised
  `hid` as residual (`norm_before_residual=false`); `layers.1..L-1` are plain Llama blocks;
- `norm` (final RMSNorm) and `lm_head` [Vd, H] over the draft vocab (rows of the target's lm_head);
- `mask_hidden` [1, 1, 3H] ~ N(0, 1): the learned shared hidden state of masked (depth >= 1) slots;
- buffers `d2t` int64 [Vd] (offsets: target id = i + d2t[i]) and `t2d` bool [V], only when Vd < V.

Parameter and buffer names are exactly the exported (speculators / vLLM) keys, so the export is a plain
`save_file(draft.state_dict())` (plus a bf16 cast). The rotary `inv_freq` buffers are not persistent.
The layers call their weights through `peagle.model.cpu_kernels.linear` (oneDNN for CPU fp32, `F.linear` otherwise)
rather than the `nn.Linear` modules, which stay as the holders of those names.

Weights that must come from the target (`embed_tokens`, `lm_head`) start as NaN so a draft that was
never initialised with `init_from_target` (or a checkpoint) is detected at the first forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from peagle.errors import TargetLoadError
from peagle.model.cpu_kernels import grouped_attention, linear, uses_onednn

__all__ = [
    "AttentionBackend",
    "DraftConfig",
    "KVCarry",
    "LayerKV",
    "PEagleAttention",
    "PEagleDraft",
    "PEagleFirstLayer",
    "PEagleLayer",
    "PEagleMLP",
    "QueryGroups",
    "attend",
    "expected_state_keys",
    "group_queries",
    "init_from_target",
    "init_layers_from_target",
    "select_attention",
]

AttentionBackend = Literal["sdpa", "flex"]


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class DraftConfig:
    """Shape of the draft. Build it with `DraftConfig.from_target` (copies the target's dimensions)."""

    hidden_size: int  # H, equals the target's hidden size
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int  # L: fused first layer + L-1 plain layers
    vocab_size: int  # V (target vocab; embed_tokens rows)
    draft_vocab_size: int  # Vd (lm_head rows); == V means no vocab compression
    rms_norm_eps: float = 1e-5
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e4})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    mask_token_id: int = 0  # token id fed at masked (depth >= 1) slots
    aux_layer_ids: list[int] = field(default_factory=list)  # vLLM "input of layer" convention
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"draft.mask_token_id must be in [0, {self.vocab_size}), got {self.mask_token_id}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft.draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}"
            )
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers must be >= 1, got {self.num_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        num_layers: int,
        draft_vocab_size: int | None,
        mask_token_id: int,
        aux_layer_ids: list[int],
    ) -> DraftConfig:
        """Copy H, heads, head_dim, intermediate size, eps and RoPE from an HF (Llama-like) target config."""
        h = int(target_config.hidden_size)
        heads = int(target_config.num_attention_heads)
        rope = getattr(target_config, "rope_parameters", None)
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(target_config, "rope_theta", 1e4))}
        rope = {k: v for k, v in dict(rope).items() if k != "partial_rotary_factor"}
        inter = getattr(target_config, "intermediate_size", None) or 3 * h
        return cls(
            hidden_size=h,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(target_config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(target_config, "head_dim", None) or h // heads),
            intermediate_size=int(inter),
            num_layers=num_layers,
            vocab_size=int(target_config.vocab_size),
            draft_vocab_size=int(draft_vocab_size or target_config.vocab_size),
            rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-5)),
            rope_parameters=rope,
            max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 4096)),
            hidden_act=str(getattr(target_config, "hidden_act", "silu")),
            mask_token_id=mask_token_id,
            aux_layer_ids=list(aux_layer_ids),
        )

    def llama_config(self) -> LlamaConfig:
        """The draft decoder as an HF `LlamaConfig` (the export's `transformer_layer_config`)."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=dict(self.rope_parameters),
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            initializer_range=self.initializer_range,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (saved in checkpoints; `DraftConfig(**d)` rebuilds it)."""
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# Attention kernels
# --------------------------------------------------------------------------------------------------


def select_attention(device: torch.device | str, requested: str = "auto") -> AttentionBackend:
    """Pick the attention backend: compiled flex on CUDA, dense-mask SDPA elsewhere (no flex backward on CPU).

    Args:
        device: where the draft runs.
        requested: `auto`, `sdpa` or `flex` (`resources.attention` of the spec).
    """
    dev = torch.device(device)
    if requested == "auto":
        return "flex" if dev.type == "cuda" else "sdpa"
    if requested not in ("sdpa", "flex"):
        raise ValueError(f"resources.attention must be auto, sdpa or flex, got {requested!r}")
    return requested  # type: ignore[return-value]


def _flex_kernel(cache: dict[str, Any], q: Tensor) -> Any:
    """Compiled flex attention on CUDA with head_dim >= 16 (Inductor's limit), eager flex otherwise."""
    if q.device.type != "cuda" or q.shape[-1] < 16:
        return flex_attention
    if "flex" not in cache:
        cache["flex"] = torch.compile(flex_attention, dynamic=True)
    return cache["flex"]


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


AttnMask = Tensor | BlockMask | QueryGroups

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


def attend(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: AttnMask, cache: dict[str, Any] | None = None, prefix: int = 0
) -> Tensor:
    """Masked attention with GQA.

    Args:
        q: [B, nh, N, hd] queries (RoPE applied).
        k, v: [B, nkv, N, hd] keys / values.
        attn_mask: dense bool [N, N] or [B, N, N] (True = visible; SDPA), the same as an additive float
            mask in the query dtype (0 / -inf, `peagle.cod.mask.additive_mask`: built once, shared by all
            layers), `QueryGroups` of such a mask (B = 1; one SDPA call per group, or on CPU fp32 one
            `peagle.model.cpu_kernels.grouped_attention` call for all groups), or a flex `BlockMask`.
            Rows without any visible key (padding queries) must be given one by the mask builder.
        cache: holds the compiled flex kernel (one per draft).
        prefix: P > 0 when the first P queries see only the first P keys (the depth-0 block of a COD
            row); the dense path then runs two SDPA calls, [P, P] and [N-P, N], instead of [N, N].
            Checked on the mask (falls back to one call otherwise); the result is the same.

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
    mask = attn_mask if attn_mask.dim() == 4 else attn_mask.view(-1, 1, *attn_mask.shape[-2:])  # [B|1, 1, N, N]
    n = q.shape[2]
    if 0 < prefix < n and not _any_visible(mask[..., :prefix, prefix:]):
        top = F.scaled_dot_product_attention(
            q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix], attn_mask=mask[..., :prefix, :prefix],
            enable_gqa=True,
        )  # [B, nh, P, hd]
        rest = F.scaled_dot_product_attention(q[:, :, prefix:], k, v, attn_mask=mask[..., prefix:, :], enable_gqa=True)
        return torch.cat([top, rest], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _any_visible(mask: Tensor) -> bool:
    """Whether a dense (bool or additive float) mask block lets any query see any key."""
    return bool(mask.any()) if mask.dtype == torch.bool else bool((mask != float("-inf")).any())


class _InjectGrad(torch.autograd.Function):
    """Identity on `x [B, nkv, n, hd]` whose backward adds `g [B, nkv, m, hd]` (m <= n) to the gradient
    of the first m rows: gradient that later forwards sent to these keys / values (`KVCarry.inject`)."""

    @staticmethod
    def forward(ctx, x: Tensor, g: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(g)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (g,) = ctx.saved_tensors
        out = grad.clone()
        out[:, :, : g.shape[2]] += g.to(out.dtype)
        return out, None


@dataclass(eq=False)
class KVCarry:
    """Keys / values carried between the forwards of one sequence-partitioned row (decision 9).

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


class PEagleAttention(nn.Module):
    """Llama attention with an explicit mask; `input_size` is 2H for the fused first layer, H otherwise."""

    def __init__(self, cfg: DraftConfig, input_size: int) -> None:
        super().__init__()
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(input_size, nh * hd, bias=False)
        self.k_proj = nn.Linear(input_size, nkv * hd, bias=False)
        self.v_proj = nn.Linear(input_size, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)
        self.kernel_cache: dict[str, Any] = {}

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: AttnMask, prefix: int = 0, kv: LayerKV | None = None
    ) -> Tensor:
        """x [B, N, Din], cos/sin [B, N, hd] -> [B, N, H] (`prefix`: see `attend`; `kv`: see `KVCarry`)."""
        q, k, v = (linear(x, p.weight) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self._attend(q, k, v, cos, sin, attn_mask, prefix, kv)

    def forward_rows(
        self, x: Tensor, real: Tensor, shape: tuple[int, int], cos: Tensor, sin: Tensor, attn_mask: AttnMask,
        prefix: int = 0, kv: LayerKV | None = None,
    ) -> Tensor:
        """`forward` of a [B, N] input given as its distinct rows: `x` [R+1, Din] holds the rows at the
        flat indices `real` [R] (into B*N), then ONE row that every other slot equals. Each distinct row is
        projected once (RoPE still uses every slot's own position) -> [B, N, H]."""
        b, n = shape

        def project(proj: nn.Linear) -> Tensor:
            y = linear(x, proj.weight)  # [R+1, d]
            return y[-1:].expand(b * n, y.shape[-1]).index_copy(0, real, y[:-1]).view(b, n, -1)  # [B, N, d]

        return self._attend(project(self.q_proj), project(self.k_proj), project(self.v_proj), cos, sin, attn_mask,
                            prefix, kv)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, attn_mask: AttnMask, prefix: int,
        kv: LayerKV | None = None,
    ) -> Tensor:
        """Projections q [B, N, nh*hd], k/v [B, N, nkv*hd] -> RoPE, masked attention, o_proj -> [B, N, H]."""
        b, n, _ = q.shape
        q = q.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, N, hd]
        k = k.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, N, hd]
        v = v.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if kv is not None:
            k, v = kv.apply(k, v)  # [B, nkv, Nc + N, hd] with carried context keys
        out = attend(q, k, v, attn_mask, self.kernel_cache, prefix)  # [B, nh, N, hd]
        return linear(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim), self.o_proj.weight)


# --------------------------------------------------------------------------------------------------
# Decoder layers
# --------------------------------------------------------------------------------------------------


class PEagleMLP(LlamaMLP):
    """`LlamaMLP` (same weights and names) with its products through `peagle.model.cpu_kernels.linear`."""

    def forward(self, x: Tensor) -> Tensor:
        """x [B, N, H] -> [B, N, H]: down(act(gate(x)) * up(x))."""
        gate = self.act_fn(linear(x, self.gate_proj.weight))  # [B, N, I]
        return linear(gate * linear(x, self.up_proj.weight), self.down_proj.weight)


class PEagleFirstLayer(nn.Module):
    """Fused first layer: attention over [input_layernorm(emb) ; hidden_norm(hid)] (2H), residual = hid."""

    def __init__(self, cfg: DraftConfig, llama: LlamaConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = PEagleAttention(cfg, 2 * h)
        self.mlp = PEagleMLP(llama)
        self.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(
        self, emb: Tensor, hid: Tensor, cos: Tensor, sin: Tensor, attn_mask: AttnMask, prefix: int = 0,
        shared: tuple[Tensor, Tensor] | None = None, kv: LayerKV | None = None,
    ) -> Tensor:
        """emb, hid [B, N, H] -> [B, N, H].

        `shared = (real [R], rep [1])`: flat indices (into B*N) of the slots with their own (emb, hid) and
        of one slot that every other slot equals (the masked slots: mask token, `mask_hidden`). Their
        attention input, norms and q/k/v projections are then computed once (same values and gradients).
        """
        if shared is None:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hid)], dim=-1)  # [B, N, 2H]
            attn = self.self_attn(x, cos, sin, attn_mask, prefix, kv)
        else:
            real, rep = shared
            b, n, h = hid.shape
            idx = torch.cat([real, rep])  # [R+1]
            rows = [norm(t.reshape(b * n, h).index_select(0, idx)) for norm, t in
                    ((self.input_layernorm, emb), (self.hidden_norm, hid))]
            attn = self.self_attn.forward_rows(torch.cat(rows, dim=-1), real, (b, n), cos, sin, attn_mask, prefix, kv)
        x = hid + attn  # un-normalised residual
        return x + self.mlp(self.post_attention_layernorm(x))


class PEagleLayer(nn.Module):
    """Plain pre-norm Llama block (layers 1..L-1)."""

    def __init__(self, cfg: DraftConfig, llama: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = PEagleAttention(cfg, cfg.hidden_size)
        self.mlp = PEagleMLP(llama)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: AttnMask, prefix: int = 0, kv: LayerKV | None = None
    ) -> Tensor:
        """x [B, N, H] -> [B, N, H]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, prefix, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------------
# The draft
# --------------------------------------------------------------------------------------------------


class PEagleDraft(nn.Module):
    """P-EAGLE draft. `forward` returns pre-norm hidden states; `compute_logits` applies norm + lm_head.

    Example:
        >>> draft = PEagleDraft(cfg); init_from_target(draft, target, t2d)
        >>> hidden = draft(input_ids, aux, is_masked, position_ids, mask)   # [1, N, H]
        >>> logits = draft.compute_logits(hidden[0, supervised])            # [n, Vd]
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        h, v, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
        llama = cfg.llama_config()
        self.embed_tokens = nn.Embedding(v, h)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layers = nn.ModuleList(
            [PEagleFirstLayer(cfg, llama)] + [PEagleLayer(cfg, llama) for _ in range(cfg.num_layers - 1)]
        )
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * h))
        if vd < v:
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))
        else:
            self.d2t = None
            self.t2d = None
        self.rotary_emb = LlamaRotaryEmbedding(llama)  # inv_freq is a non-persistent buffer
        self.gradient_checkpointing = False
        # True: the embedding backward yields a sparse gradient (only the rows looked up) that autograd
        # adds into a dense `embed_tokens.weight.grad` the caller allocated (the trainer does; see
        # `peagle.train.step`), instead of building a dense [V, H] gradient per backward
        self.sparse_embedding_grad = False
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name == "mask_hidden" or name.endswith("norm.weight"):
                continue  # N(0,1) from the constructor / ones from LlamaRMSNorm
            p.normal_(0.0, std)
        self.embed_tokens.weight.fill_(math.nan)  # loaded by init_from_target or a checkpoint
        self.lm_head.weight.fill_(math.nan)

    def forward(
        self,
        input_ids: Tensor,
        aux: Tensor,
        is_masked: Tensor,
        position_ids: Tensor,
        attn_mask: AttnMask,
        kv: KVCarry | None = None,
    ) -> Tensor:
        """Run the draft over one flat COD sequence (or any sequence with an explicit mask).

        Args:
            input_ids: [B, N] int64 tokens; ignored (replaced by `mask_token_id`) where `is_masked`.
            aux: [B, N, 3H] captured target hidden states (concatenated aux layers); ignored where
                `is_masked` (`mask_hidden` is used there, through a `where` so it is always in the graph).
            is_masked: [B, N] bool, True at masked (depth >= 1) slots.
            position_ids: [B, N] int64 RoPE positions (anchor + depth).
            attn_mask: dense bool [N, N] / [B, N, N] (True = visible; SDPA path), the same as an additive
                float mask in the query dtype (faster: one mask for all layers), `QueryGroups` of such a
                mask (built here from a dense mask when B = 1), or a flex `BlockMask`. With `kv.past`
                the keys are the Nc carried context keys followed by the N own ones: `[N, Nc + N]`.
            kv: keys / values carried between the forwards of a partitioned row (`KVCarry`).

        Returns:
            [B, N, H] hidden states BEFORE the final norm (`compute_logits` applies norm + lm_head).
        """
        b, n = input_ids.shape
        h = self.config.hidden_size
        ids = torch.where(is_masked, self.config.mask_token_id, input_ids)
        emb = F.embedding(ids, self.embed_tokens.weight, sparse=self.sparse_embedding_grad)  # [B, N, H]
        # fc only over the real (unmasked) slots; every masked slot gets fc(mask_hidden), which stays in
        # the graph even when there is no masked slot (zero gradient, never a missing one).
        mask_proj = linear(self.mask_hidden, self.fc.weight).reshape(1, h)  # [1, H]
        real = torch.nonzero(~is_masked.reshape(-1)).reshape(-1)  # [R]
        feats = aux.reshape(b * n, -1).index_select(0, real).to(self.mask_hidden.dtype)  # [R, 3H]
        proj = linear(feats, self.fc.weight)  # [R, H]
        hid = mask_proj.to(proj.dtype).expand(b * n, h).index_copy(0, real, proj).view(b, n, h)  # [B, N, H]
        cos, sin = self.rotary_emb(hid, position_ids)  # [B, N, hd] each
        prefix = 0
        if isinstance(attn_mask, Tensor) and b == 1:  # dense mask: block-sparse SDPA by query groups
            attn_mask = group_queries(attn_mask, position_ids) or attn_mask
        if isinstance(attn_mask, Tensor) and (kv is None or kv.past is None):
            # leading real slots (the depth-0 block of a COD row) let `attend` split the dense attention
            prefix = int((is_masked.long().cumsum(-1) == 0).sum(-1).min())
        # every masked slot has the same first-layer input (mask token, mask_hidden): project it once
        masked = torch.nonzero(is_masked.reshape(-1)).reshape(-1)  # [B*N - R]
        shared = (real, masked[:1]) if masked.numel() else None
        x = hid
        for i, layer in enumerate(self.layers):
            lkv = kv.layer(i) if kv is not None else None
            args = (emb, hid, cos, sin, attn_mask, prefix, shared, lkv) if i == 0 else (x, cos, sin, attn_mask, prefix, lkv)
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[*, H] pre-norm hidden -> [*, Vd] draft-vocab logits (`lm_head(norm(hidden))`)."""
        return self.lm_head(self.norm(hidden))  # a module call: evaluation hooks `lm_head`

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocab ids [*] to target ids [*] (`i + d2t[i]`; identity when Vd == V)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def set_trainable(self, *, freeze_embeddings: bool = False, freeze_lm_head: bool = False) -> None:
        """Freeze `embed_tokens` / `lm_head` as the spec says (`draft.freeze_*`); everything else trains."""
        self.embed_tokens.weight.requires_grad_(not freeze_embeddings)
        self.lm_head.weight.requires_grad_(not freeze_lm_head)


def expected_state_keys(num_layers: int, *, compressed_vocab: bool) -> list[str]:
    """The exported tensor names of a draft with `num_layers` layers (sorted), as vLLM loads them."""
    keys = ["embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "mask_hidden"]
    for i in range(num_layers):
        p = f"layers.{i}."
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if i == 0:
            keys.append(p + "hidden_norm.weight")
    if compressed_vocab:
        keys += ["d2t", "t2d"]
    return sorted(keys)


@torch.no_grad()
def init_from_target(draft: PEagleDraft, target_model: nn.Module, t2d: Tensor | None) -> None:
    """Copy the target's token embeddings and the draft-vocab rows of its lm_head; set d2t / t2d.

    Args:
        draft: the draft to initialise (in place).
        target_model: an HF causal LM (`get_input_embeddings`, `get_output_embeddings`).
        t2d: bool [V], True at the Vd draft-vocab target ids (sorted ascending by construction);
            None when Vd == V.
    """
    cfg = draft.config
    emb = target_model.get_input_embeddings().weight  # [V, H]
    head = target_model.get_output_embeddings().weight  # [V, H]
    if tuple(emb.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise TargetLoadError(
            f"target embedding is {tuple(emb.shape)}, the draft expects ({cfg.vocab_size}, {cfg.hidden_size})"
        )
    draft.embed_tokens.weight.copy_(emb.to(draft.embed_tokens.weight.dtype))
    if t2d is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise TargetLoadError("draft.draft_vocab_size < vocab size needs a t2d mapping")
        draft.lm_head.weight.copy_(head.to(draft.lm_head.weight.dtype))
        return
    t2d = t2d.to(torch.bool).cpu()
    ids = torch.nonzero(t2d).flatten()  # [Vd] target ids, ascending
    if t2d.numel() != cfg.vocab_size or ids.numel() != cfg.draft_vocab_size:
        raise TargetLoadError(
            f"t2d must be bool [{cfg.vocab_size}] with {cfg.draft_vocab_size} True entries, "
            f"got [{t2d.numel()}] with {ids.numel()}"
        )
    draft.lm_head.weight.copy_(head[ids.to(head.device)].to(draft.lm_head.weight.dtype))
    if draft.t2d is not None and draft.d2t is not None:
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(ids - torch.arange(ids.numel()))


def _decoder(target_model: nn.Module) -> nn.Module | None:
    """The module holding the target's `layers` and final `norm` (HF: `model.model`), or None."""
    for cand in (getattr(target_model, "model", None), target_model):
        if cand is not None and isinstance(getattr(cand, "layers", None), nn.ModuleList):
            return cand
    return None


@torch.no_grad()
def _norm_scale(norm: nn.Module) -> Tensor | None:
    """The per-channel scale an RMS norm applies (`norm(x) = scale * x / rms(x)`), read off its output, so
    a Gemma-style `(1 + w)` norm gives `1 + w`; None when the module is not such a norm (LayerNorm, ...)."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 1:
        return None
    g = torch.Generator().manual_seed(0)
    scales = []
    for _ in range(2):
        x = torch.randn(1, w.numel(), generator=g).to(device=w.device, dtype=w.dtype)
        unit = x.float() / x.float().pow(2).mean(-1, keepdim=True).sqrt()
        scales.append(norm(x).float()[0] / unit[0])
    if not torch.allclose(scales[0], scales[1], rtol=2e-2, atol=2e-2):
        return None
    measured = (scales[0] + scales[1]) / 2
    for exact in (w.float(), 1.0 + w.float()):  # the usual forms, copied exactly (no rounding noise)
        if torch.allclose(measured, exact, rtol=2e-2, atol=2e-2):
            return exact
    return measured


@torch.no_grad()
def init_layers_from_target(draft: PEagleDraft, target_model: nn.Module) -> list[str]:
    """Start the draft's decoder layers, `fc` and final `norm` from the target (spec `draft.layer_init`).

    Draft layer i (of L) starts as the target's layer N - L + i: attention, MLP and norm weights are
    copied where the shapes match; the fused first layer's q/k/v `[*, 2H]` get the target's `[*, H]`
    weights in both halves (embedding and hidden) and its `hidden_norm` the target's `input_layernorm`.
    `fc` `[H, 3H]` starts as `[0, 0, I]` (it passes on the last aux layer, the target's own
    hidden state 3 layers from the top) and `norm` as the target's final norm, so the draft starts as a
    target-shaped top of the stack reading the target's own features. On the demo (SmolLM2-135M, 240
    steps) this raised AL from 1.225 to 1.266 (held-out tau_sim 0.299 -> 0.326) against random layers.
    Norms are copied as the scale they apply (a Gemma-style `(1 + w)` norm gives `1 + w`; a LayerNorm is
    skipped). Weights whose shapes do not match (MoE experts, biases, q/k norms) keep their random init.

    Returns:
        The names of the draft tensors that were copied.
    """
    base = _decoder(target_model)
    if base is None:
        return []
    cfg = draft.config
    h = cfg.hidden_size
    src_layers = list(base.layers)
    copied: list[str] = []

    def put(name: str, dst: Tensor, src: Tensor | None) -> None:
        if src is not None and tuple(src.shape) == tuple(dst.shape):
            dst.copy_(src.to(dst.dtype))
            copied.append(name)

    def weight(module: nn.Module | None, path: str) -> Tensor | None:
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                return None
        if "norm" in path.rsplit(".", 1)[-1]:
            return _norm_scale(module)
        w = getattr(module, "weight", None)
        return w if isinstance(w, Tensor) else None

    offset = len(src_layers) - len(draft.layers)  # draft layer i <- target layer offset + i
    for i, layer in enumerate(draft.layers if offset >= 0 else []):
        src = src_layers[offset + i]
        prefix = f"layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            dst = getattr(layer.self_attn, proj).weight
            w = weight(src, f"self_attn.{proj}")
            if i == 0 and w is not None and dst.shape[1] == 2 * h and tuple(w.shape) == (dst.shape[0], h):
                dst[:, :h].copy_(w.to(dst.dtype))
                dst[:, h:].copy_(w.to(dst.dtype))
                copied.append(f"{prefix}self_attn.{proj}.weight")
            else:
                put(f"{prefix}self_attn.{proj}.weight", dst, w)
        put(f"{prefix}self_attn.o_proj.weight", layer.self_attn.o_proj.weight, weight(src, "self_attn.o_proj"))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            put(f"{prefix}mlp.{proj}.weight", getattr(layer.mlp, proj).weight, weight(src, f"mlp.{proj}"))
        put(f"{prefix}input_layernorm.weight", layer.input_layernorm.weight, weight(src, "input_layernorm"))
        put(f"{prefix}post_attention_layernorm.weight", layer.post_attention_layernorm.weight,
            weight(src, "post_attention_layernorm"))
        if i == 0:
            put(f"{prefix}hidden_norm.weight", layer.hidden_norm.weight, weight(src, "input_layernorm"))
    put("norm.weight", draft.norm.weight, weight(base, "norm"))
    draft.fc.weight.zero_()  # [H, 3H]
    draft.fc.weight[:, 2 * h :].copy_(torch.eye(h, dtype=draft.fc.weight.dtype))
    copied.append("fc.weight")
    return copied
