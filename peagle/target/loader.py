"""The target through transformers: the whole model in this process (`resources.target_engine` hf).

    model, tok, path = load_target(spec, device)      # eval mode, no grad, on `device`

Both the pipeline (the hf engine's target, the draft's initial weights) and `peagle.target.runtime` load
it from here; with the vllm engine the target runs in the engine and this process holds only its parts
(`peagle.target.parts`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from peagle.errors import TargetLoadError
from peagle.spec import TrainSpec

__all__ = ["TORCH_DTYPES", "load_target", "resolve_dtype"]

#: `target.dtype` (resolved: never `auto`) -> the torch dtype.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(spec: TrainSpec, device: torch.device) -> torch.dtype:
    """`target.dtype` as `TrainSpec.resolve` decides it (auto = bf16 on CUDA, fp32 on CPU)."""
    return TORCH_DTYPES[spec.resolve(cuda_available=device.type == "cuda").target.dtype]


def load_target(spec: TrainSpec, device: torch.device) -> tuple[Any, Any, Path | str]:
    """Load (model, tokenizer, resolved path) of the spec's target, eval mode on `device`.

    Raises:
        TargetLoadError: unknown builtin, missing folder, or transformers cannot load it (one line).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.builtin import resolve_target

    try:
        path = resolve_target(spec.target.model)
    except (ValueError, FileNotFoundError) as exc:
        raise TargetLoadError(f"target.model: {exc}") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), revision=spec.target.revision)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), revision=spec.target.revision, dtype=resolve_dtype(spec, device)
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target.model {spec.target.model!r} cannot be loaded: {first}") from None
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' decorated `to`
    model.requires_grad_(False)
    return model, tok, path
