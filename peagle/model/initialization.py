"""Initialisation of a `PEagleDraft` from its target: embeddings and lm_head rows (always), decoder layers,
`fc` and final norm (spec `draft.layer_init`).

* `init_from_target`: the target's token embeddings and the draft-vocab rows of its lm_head, plus the
  `d2t` / `t2d` vocab maps (the weights a fresh draft holds as NaN until this runs);
* `init_layers_from_target`: draft layer i starts as the target's layer N - L + i (norms copied as the
  scale they apply, read off the norm's output by `_norm_scale`);
* `feature_mean` / `init_mask_hidden`: `mask_hidden` starts as the mean of the captured target features
  (spec `draft.mask_hidden_init`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from peagle.errors import TargetLoadError

if TYPE_CHECKING:
    from peagle.model.draft import PEagleDraft

__all__ = ["feature_mean", "init_from_target", "init_layers_from_target", "init_mask_hidden"]


@torch.no_grad()
def init_from_target(draft: PEagleDraft, target_model: Any, t2d: Tensor | None) -> None:
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


def _decoder(target_model: Any) -> Any:
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
def init_layers_from_target(draft: PEagleDraft, target_model: Any) -> list[str]:
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
            return _norm_scale(module) if module is not None else None
        w = getattr(module, "weight", None)
        return w if isinstance(w, Tensor) else None

    offset = len(src_layers) - len(draft.layers)  # draft layer i <- target layer offset + i
    layers: list[Any] = list(draft.layers) if offset >= 0 else []  # PEagleFirstLayer, then PEagleLayer
    for i, layer in enumerate(layers):
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


@torch.no_grad()
def feature_mean(batches: Iterable[tuple[Tensor, Tensor]]) -> Tensor:
    """The mean target feature over the real (non-padding) positions of some batches.

    Args:
        batches: `(aux, document_ids)` pairs: aux [B, N, 3H] (any float dtype), document_ids [B, N] int
            (-1 = padding).

    Returns:
        [3H] float32: the per-channel mean over every position with `document_ids >= 0`.

    Raises:
        ValueError: no batch, or no real position in any of them.
    """
    total: Tensor | None = None
    count = 0
    for aux, doc in batches:
        real = aux[doc >= 0].float()  # [R, 3H]
        part = real.sum(0).cpu()
        total = part if total is None else total + part
        count += int(real.shape[0])
    if total is None or count == 0:
        raise ValueError("feature_mean needs at least one real (non-padding) position")
    return total / count


@torch.no_grad()
def init_mask_hidden(draft: PEagleDraft, mean: Tensor) -> None:
    """Start `mask_hidden` [1, 1, 3H] as `mean` [3H] (spec `draft.mask_hidden_init: feature_mean`).

    A masked (depth >= 1) slot then enters the draft as an average target state instead of an N(0, 1)
    vector. On SmolLM2-135M the last aux state (the input of layer N - 3) has RMS about 50 and a few
    channels near 370 on every token (the target's "massive activations"); the layers that
    `init_layers_from_target` copies expect them, and AdamW moves `mask_hidden` by about `lr` a step,
    so an N(0, 1) start never reaches that scale in a run. Measured there, starting at the mean lowered
    served AL by about 1%, so it is not the default (docs/decisions.md decision 25).

    Raises:
        ValueError: `mean` is not [3H] for this draft, or not finite.
    """
    want = draft.mask_hidden.shape[-1]
    if tuple(mean.shape) != (want,):
        raise ValueError(f"mask_hidden needs a [{want}] mean feature, got {tuple(mean.shape)}")
    if not bool(torch.isfinite(mean).all()):
        raise ValueError("the mean target feature is not finite")
    draft.mask_hidden.copy_(mean.reshape(1, 1, want).to(draft.mask_hidden))
