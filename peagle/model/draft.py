"""The P-EAGLE draft network: a Llama-style EAGLE-3 draft with parallel-drafting extras.

Reads top to bottom like `transformers.models.llama.modeling_llama`:
`DraftConfig` -> `PEagleAttention` -> `PEagleMLP` -> `PEagleFirstLayer` (fused, 2H attention input) ->
`PEagleLayer` (plain pre-norm block) -> `PEagleDraft`. The attention backends, prepared masks and the
keys / values carried between the forwards of a partitioned row live in `peagle.model.attention`;
starting the draft from its target (`init_from_target`, `init_layers_from_target`) in
`peagle.model.initialization`.

Architecture (docs/algorithm.md 1.5, docs/decisions.md decision 6):
- `embed_tokens` [V, H] (initialised from the target, trainable unless frozen by the spec);
- `fc` [H, 3H] projects the 3 captured target hidden states (or `mask_hidden` at masked slots) to H;
- `layers.0` attends over `[input_layernorm(emb) ; hidden_norm(hid)]` (2H) with the un-normalised
  `hid` as residual (`norm_before_residual=false`); `layers.1..L-1` are plain Llama blocks;
- `norm` (final RMSNorm) and `lm_head` [Vd, H] over the draft vocab (rows of the target's lm_head);
- `mask_hidden` [1, 1, 3H] ~ N(0, 1): the learned shared hidden state of masked (depth >= 1) slots;
- buffers `d2t` int64 [Vd] (offsets: target id = i + d2t[i]) and `t2d` bool [V], only when Vd < V.

Parameter and buffer names are exactly the exported (speculators / vLLM) keys, so the export is a plain
`save_file(draft.state_dict())` (plus a bf16 cast). The rotary `inv_freq` buffers are not persistent.
Every projection is called as its module; `fc` and the layers' projections are
`peagle.model.cpu_kernels.KernelLinear` (an `nn.Linear` whose product is oneDNN for CPU fp32, `F.linear`
otherwise), so hooks and wrappers apply and the names stay `nn.Linear`'s.

Weights that must come from the target (`embed_tokens`, `lm_head`) start as NaN so a draft that was
never initialised with `init_from_target` (or a checkpoint) is detected at the first forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from peagle.model.attention import AttnMask, DenseMask, KernelMask, KVCarry, LayerKV, attend
from peagle.model.cpu_kernels import KernelLinear

__all__ = [
    "DraftConfig",
    "PEagleAttention",
    "PEagleDraft",
    "PEagleFirstLayer",
    "PEagleLayer",
    "PEagleMLP",
    "expected_state_keys",
]


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
# Attention and MLP
# --------------------------------------------------------------------------------------------------


class PEagleAttention(nn.Module):
    """Llama attention with an explicit mask; `input_size` is 2H for the fused first layer, H otherwise."""

    def __init__(self, cfg: DraftConfig, input_size: int) -> None:
        super().__init__()
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = KernelLinear(input_size, nh * hd, bias=False)
        self.k_proj = KernelLinear(input_size, nkv * hd, bias=False)
        self.v_proj = KernelLinear(input_size, nkv * hd, bias=False)
        self.o_proj = KernelLinear(nh * hd, cfg.hidden_size, bias=False)
        self.kernel_cache: dict[str, Any] = {}

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: KernelMask, prefix: int = 0, kv: LayerKV | None = None
    ) -> Tensor:
        """x [B, N, Din], cos/sin [B, N, hd] -> [B, N, H] (`prefix`: see `attend`; `kv`: see `KVCarry`)."""
        return self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, attn_mask, prefix, kv)

    def forward_rows(
        self, x: Tensor, real: Tensor, shape: tuple[int, int], cos: Tensor, sin: Tensor, attn_mask: KernelMask,
        prefix: int = 0, kv: LayerKV | None = None,
    ) -> Tensor:
        """`forward` of a [B, N] input given as its distinct rows: `x` [R+1, Din] holds the rows at the
        flat indices `real` [R] (into B*N), then ONE row that every other slot equals. Each distinct row is
        projected once (RoPE still uses every slot's own position) -> [B, N, H]."""
        b, n = shape

        def project(proj: nn.Module) -> Tensor:
            y = proj(x)  # [R+1, d]
            return y[-1:].expand(b * n, y.shape[-1]).index_copy(0, real, y[:-1]).view(b, n, -1)  # [B, N, d]

        return self._attend(project(self.q_proj), project(self.k_proj), project(self.v_proj), cos, sin, attn_mask,
                            prefix, kv)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, attn_mask: KernelMask, prefix: int,
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
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class PEagleMLP(nn.Module):
    """`LlamaMLP` (same weights, names and init) with `KernelLinear` projections."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = KernelLinear(h, inter, bias=False)
        self.up_proj = KernelLinear(h, inter, bias=False)
        self.down_proj = KernelLinear(inter, h, bias=False)
        self.act_fn = ACT2FN[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        """x [B, N, H] -> [B, N, H]: down(act(gate(x)) * up(x))."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------------------------------
# Decoder layers
# --------------------------------------------------------------------------------------------------


class PEagleFirstLayer(nn.Module):
    """Fused first layer: attention over [input_layernorm(emb) ; hidden_norm(hid)] (2H), residual = hid."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = PEagleAttention(cfg, 2 * h)
        self.mlp = PEagleMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(
        self, emb: Tensor, hid: Tensor, cos: Tensor, sin: Tensor, attn_mask: KernelMask, prefix: int = 0,
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

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.self_attn = PEagleAttention(cfg, cfg.hidden_size)
        self.mlp = PEagleMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: KernelMask, prefix: int = 0, kv: LayerKV | None = None
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
        >>> mask = DenseMask.split(mask_for(row), row.is_masked[None])     # or group_queries / block_mask_for
        >>> hidden = draft(input_ids, aux, is_masked, position_ids, mask)   # [1, N, H]
        >>> logits = draft.compute_logits(hidden[0, supervised])            # [n, Vd]
    """

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        h, v, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
        self.embed_tokens = nn.Embedding(v, h)
        self.fc = KernelLinear(3 * h, h, bias=False)
        self.layers = nn.ModuleList([PEagleFirstLayer(cfg)] + [PEagleLayer(cfg) for _ in range(cfg.num_layers - 1)])
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * h))
        if vd < v:
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))
        else:
            self.d2t = None
            self.t2d = None
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())  # inv_freq is a non-persistent buffer
        self.gradient_checkpointing = False
        self._init_weights()

    @property
    def sparse_embedding_grad(self) -> bool:
        """True: the embedding backward yields a sparse gradient (only the rows looked up) that autograd
        adds into a dense `embed_tokens.weight.grad` the caller allocated (the trainer does; see
        `peagle.train.step`), instead of building a dense [V, H] gradient per backward."""
        return self.embed_tokens.sparse

    @sparse_embedding_grad.setter
    def sparse_embedding_grad(self, value: bool) -> None:
        self.embed_tokens.sparse = value

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
            attn_mask: the mask, prepared by the caller for the backend it chose (`peagle.model.attention`)
                and used as given: a dense bool [N, N] / [B, N, N] (True = visible) or additive float mask
                in the query dtype (one SDPA call), a `DenseMask` (its depth-0 prefix as a separate call),
                `QueryGroups` of such a mask (B = 1), or a flex `BlockMask`. With `kv.past` the keys are
                the Nc carried context keys followed by the N own ones: `[N, Nc + N]`.
            kv: keys / values carried between the forwards of a partitioned row (`KVCarry`).

        Returns:
            [B, N, H] hidden states BEFORE the final norm (`compute_logits` applies norm + lm_head).
        """
        b, n = input_ids.shape
        h = self.config.hidden_size
        mask, prefix = (attn_mask.mask, attn_mask.prefix) if isinstance(attn_mask, DenseMask) else (attn_mask, 0)
        emb = self.embed_tokens(torch.where(is_masked, self.config.mask_token_id, input_ids))  # [B, N, H]
        # fc only over the real (unmasked) slots; every masked slot gets fc(mask_hidden), which stays in
        # the graph even when there is no masked slot (zero gradient, never a missing one).
        mask_proj = self.fc(self.mask_hidden).reshape(1, h)  # [1, H]
        real = torch.nonzero(~is_masked.reshape(-1)).reshape(-1)  # [R]
        feats = aux.reshape(b * n, -1).index_select(0, real).to(self.mask_hidden.dtype)  # [R, 3H]
        proj = self.fc(feats)  # [R, H]
        hid = mask_proj.to(proj.dtype).expand(b * n, h).index_copy(0, real, proj).view(b, n, h)  # [B, N, H]
        cos, sin = self.rotary_emb(hid, position_ids)  # [B, N, hd] each
        # every masked slot has the same first-layer input (mask token, mask_hidden): project it once
        masked = torch.nonzero(is_masked.reshape(-1)).reshape(-1)  # [B*N - R]
        shared = (real, masked[:1]) if masked.numel() else None
        x = hid
        for i, layer in enumerate(self.layers):
            lkv = kv.layer(i) if kv is not None else None
            args = (emb, hid, cos, sin, mask, prefix, shared, lkv) if i == 0 else (x, cos, sin, mask, prefix, lkv)
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
