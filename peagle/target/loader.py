"""The target through transformers: the whole model in this process (`resources.target_engine` hf).

    model, tok, path = load_target(spec, device)      # eval mode, no grad, on `device`
    folder = locate_target(spec)                      # what every loader of the target reads

`locate_target` is the one place a `target.model` becomes a folder: a builtin's, a local folder (absolute),
or a hub id's snapshot in the hub cache (fetched at `target.revision`). A hub id (`name` or `org/name`) is
never read as a folder of the working directory: transformers and vLLM would prefer such a folder to the
hub, so they are only ever given the snapshot's absolute path.

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
from peagle.spec.hardware import DeviceFacts, read_cpu_flags

__all__ = ["HUB_FILES", "TORCH_DTYPES", "device_facts", "load_target", "locate_target", "resolve_dtype"]

#: What a hub target's snapshot holds: config, tokenizer and safetensors weights (`pytorch_model*.bin`
#: only where a repository has no safetensors).
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")

#: `target.dtype` (resolved: never `auto`) -> the torch dtype.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_facts(device: torch.device) -> DeviceFacts:
    """What this machine runs natively (`peagle.spec.hardware`): the CPU's flags, bf16 on the CUDA device."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return DeviceFacts(cpu_flags=read_cpu_flags(), cuda_bf16=cuda_bf16)


def resolve_dtype(spec: TrainSpec, device: torch.device) -> torch.dtype:
    """`target.dtype` as `TrainSpec.resolve` decides it on `device` of this machine (auto = bf16 where native)."""
    resolved = spec.resolve(cuda_available=device.type == "cuda", device_facts=device_facts(device))
    return TORCH_DTYPES[resolved.target.dtype]


def locate_target(spec: TrainSpec) -> Path:
    """The local folder of the spec's target (module docstring); a hub id is fetched into the hub cache.

    Raises:
        TargetLoadError: unknown builtin, no such folder, or the hub snapshot cannot be had (one line).
    """
    from peagle.builtin import resolve_target

    try:
        where = resolve_target(spec.target.model)
        return where if isinstance(where, Path) else _hub_snapshot(where, spec.target.revision)
    except (ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target.model: {first}") from None


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """The hub cache's snapshot folder of `repo_id` at `revision` (downloaded when missing)."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
    if not any(folder.glob("*.safetensors")):
        folder = Path(snapshot_download(repo_id=repo_id, revision=revision,
                                        allow_patterns=[*HUB_FILES, "pytorch_model*.bin"]))
    return folder


def load_target(spec: TrainSpec, device: torch.device) -> tuple[Any, Any, Path]:
    """Load (model, tokenizer, folder) of the spec's target (`locate_target`), eval mode on `device`.

    Raises:
        TargetLoadError: unknown builtin, missing folder or hub snapshot, or transformers cannot load it
            (one line).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = locate_target(spec)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(spec, device))
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target.model {spec.target.model!r} cannot be loaded: {first}") from None
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' decorated `to`
    model.requires_grad_(False)
    return model, tok, path
