"""Target capture: the 3 aux hidden states and the draft-vocab logits of any HF causal LM.

Aux ids are in the vLLM "input of layer i" convention (docs/decisions.md decision 2), which is HF ``hidden_states[i]``; the
default is ``[2, N//2, N-3]``. They are captured with forward pre-hooks on the decoder layers (no
``output_hidden_states`` for all layers). The logits are computed from the final (normed) hidden state with
only the Vd selected ``lm_head`` rows (``logits[..., t2d]`` without the full-vocab matmul), so capture costs
less than a plain forward. Packed rows get a block-causal 4D mask and per-document position ids, so
documents never see each other; padding (document -1) attends only to itself (no NaN rows).

Not handled: models whose logits need more than ``lm_head(norm(h))`` (e.g. Gemma's final soft-capping).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from peagle.errors import TargetLoadError
from peagle.spec.resolve import aux_layer_ids as aux_layer_ids_for

__all__ = ["TargetCapture", "block_causal_mask", "document_position_ids", "resolve_aux_layer_ids"]


def resolve_aux_layer_ids(aux_layer_ids: list[int] | str, num_layers: int) -> list[int]:
    """Aux layer ids in the vLLM convention for an N-layer target (`peagle.spec.resolve.aux_layer_ids`).

    Raises:
        TargetLoadError: an id is outside [0, N) or the ids are not 3 distinct values.
    """
    try:
        return aux_layer_ids_for(aux_layer_ids, num_layers)
    except ValueError as exc:
        raise TargetLoadError(str(exc)) from None


def document_position_ids(document_ids: Tensor) -> Tensor:
    """Positions restarting at 0 for every document of a packed row: [B, T] -> [B, T] int64."""
    b, t = document_ids.shape
    idx = torch.arange(t, device=document_ids.device).expand(b, t)  # [B, T]
    start = torch.ones_like(document_ids, dtype=torch.bool)
    start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values  # [B, T]
    return idx - first


def block_causal_mask(document_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive 4D mask [B, 1, T, T]: 0 where query q may see key k (same document, k <= q), else min.

    Padding (document -1) sees only itself, so no attention row is empty.
    """
    t = document_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()  # [T, T]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    real = (document_ids >= 0)[:, :, None]
    eye = torch.eye(t, dtype=torch.bool, device=document_ids.device)
    allowed = (same & real & causal) | eye  # [B, T, T]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=document_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # [B, 1, T, T]


class TargetCapture:
    """Wraps a loaded HF causal LM (eval mode, no grad) for feature capture.

    Args:
        model: e.g. ``LlamaForCausalLM``/``Qwen3ForCausalLM`` (``get_decoder().layers``, ``lm_head``).
        aux_layer_ids: 3 ids in the vLLM convention (see `resolve_aux_layer_ids`).
        selected_ids: [Vd] ascending target ids of the draft vocab (`DraftVocab.selected`); None = all V.
    """

    def __init__(self, model: Any, aux_layer_ids: list[int], selected_ids: Tensor | None = None) -> None:
        self.model = model.eval()
        self.decoder = model.get_decoder()
        layers = getattr(self.decoder, "layers", None)
        if layers is None:
            raise TargetLoadError(
                f"{type(model).__name__}: cannot find decoder layers (get_decoder().layers)"
            )
        self.layers = layers
        self.num_layers = len(layers)
        self.aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, self.num_layers)
        head = model.get_output_embeddings()
        weight = head.weight.detach()  # [V, H]
        self.vocab_size = int(weight.shape[0])
        if selected_ids is None:
            self.head_weight = weight
            self.head_bias = None if getattr(head, "bias", None) is None else head.bias.detach()
        else:
            sel = selected_ids.to(weight.device).long()
            self.head_weight = weight.index_select(0, sel).contiguous()  # [Vd, H]
            bias = getattr(head, "bias", None)
            self.head_bias = None if bias is None else bias.detach().index_select(0, sel)
        self.hidden_size = int(weight.shape[1])

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @property
    def draft_vocab_size(self) -> int:
        return int(self.head_weight.shape[0])

    @torch.no_grad()
    def hidden(self, input_ids: Tensor, document_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Aux states and the final normed hidden state of packed rows.

        Args:
            input_ids: [B, T] int64.
            document_ids: [B, T] int64 (-1 padding).

        Returns:
            aux [B, T, 3H] in the model's dtype (``hidden_states[i]`` for i in aux ids, concatenated in
            that order; kept as computed: an fp32 copy of bf16 states would hold the same values in twice
            the memory, and the draft upcasts them itself) and final [B, T, H] (model dtype; the input of
            lm_head).
        """
        input_ids = input_ids.to(self.device)
        document_ids = document_ids.to(self.device)
        grabbed: dict[int, Tensor] = {}

        def hook_for(i: int) -> Any:
            def hook(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                grabbed[i] = args[0] if args else kwargs["hidden_states"]

            return hook

        handles = [
            self.layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True)
            for i in self.aux_layer_ids
        ]
        if bool((document_ids == 0).all()):  # one document per row, no padding: plain causal (fast SDPA path)
            mask, positions = None, None
        else:
            mask = block_causal_mask(document_ids, self.head_weight.dtype)  # [B, 1, T, T]
            positions = document_position_ids(document_ids)  # [B, T]
        try:
            out = self.decoder(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=False
            )
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([grabbed[i] for i in self.aux_layer_ids], dim=-1)  # [B, T, 3H]
        return aux, out.last_hidden_state  # [B, T, H]

    @torch.no_grad()
    def logits_from_hidden(self, final: Tensor) -> Tensor:
        """Draft-vocab logits [*, Vd] in the head's dtype from final normed hidden states [*, H].

        Not upcast: the loss takes the target side in fp32 a chunk at a time (`peagle.cod.loss`), so bf16
        logits give the same loss as their fp32 copy in half the memory ([T, Vd] per row).
        """
        final = final.to(self.device, self.head_weight.dtype)
        return F.linear(final, self.head_weight, self.head_bias)  # [*, Vd]

    @torch.no_grad()
    def capture(self, input_ids: Tensor, document_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(aux [B, T, 3H], logits [B, T, Vd]) of packed rows, UNSHIFTED, in the target's dtype."""
        aux, final = self.hidden(input_ids, document_ids)
        return aux, self.logits_from_hidden(final)
