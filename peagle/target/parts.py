"""The frozen pieces of the target a draft-only trainer needs, without loading the target.

When the target runs in an inference engine (`resources.target_engine: vllm`), the trainer holds only:

* the token embeddings and the lm_head (the draft's `embed_tokens` and its Vd `lm_head` rows start from
  them, and the target's draft-vocab logits are `lm_head[t2d](norm(h_N))`, `peagle.target.sources`);
* the final norm (the engine hands over the last layer's output *before* it, vLLM's layer id N);
* the last `draft.num_layers` decoder layers when `draft.layer_init` is `target`.

    parts = load_target_parts(folder, dtype=torch.bfloat16, layers=[29])
    parts.get_input_embeddings().weight      # real [V, H]
    parts.model.layers[3].mlp.up_proj.weight # on the meta device: never read from disk

`parts` is the transformers model of the target's own class, built on the meta device from its config
(so norms keep their exact semantics, e.g. Gemma's `1 + w`), with only those tensors read from its
safetensors files (one file or an index of shards; a hub id downloads just the files that hold them).
`peagle.model.initialization` and `peagle.target.vllm_capture` use it exactly as they would the full model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peagle.errors import TargetLoadError

__all__ = ["final_norm", "load_target_parts", "part_names"]


def _decoder(model: Any) -> Any:
    for cand in (getattr(model, "model", None), model):
        if cand is not None and isinstance(getattr(cand, "layers", None), nn.ModuleList):
            return cand
    raise TargetLoadError(f"{type(model).__name__}: cannot find the decoder layers (model.layers)")


def final_norm(model: Any) -> nn.Module:
    """The target's final norm (the module between the last layer's output and the lm_head)."""
    norm = getattr(_decoder(model), "norm", None)
    if not isinstance(norm, nn.Module):
        raise TargetLoadError(f"{type(model).__name__}: cannot find the final norm (model.norm)")
    return norm


def part_names(model: Any, layers: Iterable[int]) -> list[str]:
    """State-dict names of the parts: embeddings, lm_head (unless tied), final norm, the given layers."""
    modules = {id(model.get_input_embeddings()), id(model.get_output_embeddings()), id(final_norm(model))}
    dec_layers = _decoder(model).layers
    for i in layers:
        modules.add(id(dec_layers[i]))
    names: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        if id(module) in modules:
            names += [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=True)]
    return sorted(set(names))


def _weight_files(path: str, revision: str | None, wanted: Sequence[str]) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for the names in `wanted` (missing names absent)."""
    folder = Path(path)
    local = folder.is_dir()

    def fetch(name: str) -> Path | None:
        if local:
            f = folder / name
            return f if f.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(path, name, revision=revision))
        except EntryNotFoundError:
            return None

    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files: dict[str, Path] = {}
        for name in wanted:
            if name in weight_map:
                f = fetch(weight_map[name])
                if f is not None:
                    files[name] = f
        return files
    single = fetch("model.safetensors")
    if single is None:
        raise TargetLoadError(f"target {path!r}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as fh:
        keys = set(fh.keys())
    return {n: single for n in wanted if n in keys}


@torch.no_grad()
def load_target_parts(
    path: str | Path, *, dtype: torch.dtype, revision: str | None = None, layers: Sequence[int] = ()
) -> Any:
    """The target's model object with only its embeddings, lm_head, final norm and `layers` loaded (module
    docstring); everything else stays on the meta device. CPU tensors, eval mode, no grad.

    Args:
        path: a local HF folder or a hub id.
        dtype: the target's dtype (what the engine runs it in).
        revision: hub revision.
        layers: decoder layer indices to load (negative counts from the end).

    Raises:
        TargetLoadError: config or weights cannot be read, or a needed tensor is missing.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path), revision=revision)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target {str(path)!r} cannot be loaded: {first}") from None
    n = len(_decoder(model).layers)
    wanted_layers = sorted({i % n for i in layers})
    names = part_names(model, wanted_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False)) or getattr(
        getattr(config, "get_text_config", lambda: config)(), "tie_word_embeddings", False
    )
    head = model.get_output_embeddings()
    head_name = next(f"{pre}.weight" if pre else "weight" for pre, m in model.named_modules(remove_duplicate=False)
                     if m is head)
    files = _weight_files(str(path), revision, names)
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, keys in by_file.items():
        with safe_open(str(f), framework="pt") as fh:
            for k in keys:
                t = fh.get_tensor(k)
                state[k] = t.to(dtype) if t.is_floating_point() else t
    missing = [k for k in names if k not in state and not (tied and k == head_name)]
    if missing:
        raise TargetLoadError(f"target {str(path)!r}: weights missing from its files: {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied or (head_name is not None and head_name not in state):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for module in (final_norm(model), *(_decoder(model).layers[i] for i in wanted_layers)):
        for bname, buf in list(module.named_buffers(recurse=True)):
            if buf.is_meta:  # non-persistent buffers (none in norms/layers of Llama-likes) stay unusable
                raise TargetLoadError(f"target part buffer {bname} is not in the checkpoint")
    model.eval().requires_grad_(False)
    return model
