"""Derived spec values, resolved in one place: every `"auto"` and every value the data decides.

    resolved = spec.resolve(cuda_available=torch.cuda.is_available(), target_num_layers=30)

The spec stays torch-free, so the facts a value depends on are passed in: whether CUDA is there (the API
passes `resources.gpus > 0`, the trainer asks torch), the target's depth, and what the data preparation
decided (mask token, draft vocabulary size, optimizer steps). A value whose fact is not given stays as the
user wrote it. The pipeline saves the result as `resolved_spec.json` with the run's provenance.

| field                          | "auto" resolves to                                          |
|--------------------------------|-------------------------------------------------------------|
| resources.device               | cuda when available, else cpu                               |
| resources.precision            | bf16 autocast on cuda, fp32 on cpu                          |
| resources.attention            | flex on cuda, sdpa (dense-mask) on cpu                      |
| target.dtype                   | bfloat16 on cuda, float32 on cpu                            |
| eval.num_speculative_tokens    | peagle.num_depths (None = auto)                             |
| draft.aux_layer_ids            | [2, N//2, N-3] for an N-layer target ([1, N//2, N-1] if N<7)|
| draft.mask_token_id            | what `peagle.data.vocab` picked                             |
| draft.draft_vocab_size, optim.max_steps | what the data gave                                 |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peagle.spec.schema import TrainSpec

__all__ = ["aux_layer_ids", "resolve_spec"]


def aux_layer_ids(requested: list[int] | str, num_layers: int) -> list[int]:
    """Aux layer ids in the vLLM "input of layer i" convention for an N-layer target.

    Raises:
        ValueError: an id outside [0, N), or not 3 distinct ids.
    """
    n = int(num_layers)
    if requested == "auto":
        ids = [2, n // 2, n - 3]
        if len(set(ids)) != 3 and n >= 4:  # too shallow for distinct defaults (the 4-layer tiny target)
            ids = [1, n // 2, n - 1]
    else:
        ids = [int(i) for i in requested]
    if len(ids) != 3 or len(set(ids)) != 3:
        raise ValueError(f"draft.aux_layer_ids must be 3 distinct layer ids for a {n}-layer target, got {ids}")
    bad = [i for i in ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"draft.aux_layer_ids {bad} outside [0, {n}) for a {n}-layer target (got {ids})")
    return ids


def resolve_spec(
    spec: TrainSpec,
    *,
    cuda_available: bool,
    target_num_layers: int | None = None,
    mask_token_id: int | None = None,
    draft_vocab_size: int | None = None,
    max_steps: int | None = None,
) -> TrainSpec:
    """A copy of `spec` with its derived values filled in (see the module table); `spec` is unchanged."""
    out = spec.model_copy(deep=True)
    r = out.resources
    if r.device == "auto":
        r.device = "cuda" if cuda_available else "cpu"
    on_cuda = r.device == "cuda"
    if r.precision == "auto":
        r.precision = "bf16" if on_cuda else "fp32"
    if r.attention == "auto":
        r.attention = "flex" if on_cuda else "sdpa"
    if out.target.dtype == "auto":
        out.target.dtype = "bfloat16" if on_cuda else "float32"
    if out.eval.num_speculative_tokens is None:
        out.eval.num_speculative_tokens = out.peagle.num_depths
    if target_num_layers is not None:
        out.draft.aux_layer_ids = aux_layer_ids(out.draft.aux_layer_ids, target_num_layers)
    if mask_token_id is not None:
        out.draft.mask_token_id = int(mask_token_id)
    if draft_vocab_size is not None:
        out.draft.draft_vocab_size = int(draft_vocab_size)
    if max_steps is not None:
        out.optim.max_steps = int(max_steps)
    return out
