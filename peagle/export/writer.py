"""vLLM-ready export of a P-EAGLE draft, its validator, and a loader (docs/decisions.md decision 10, docs/export.md).

Two layouts:

- `speculators` (default, docs/export.md 2.1): `config.json` with `speculators_model_type: "peagle"` and
  `speculators_config` (greedy proposal, `speculative_tokens = num_depths`, the verifier), plus
  `model.safetensors`. `vllm serve <dir>` / `LLM(model=<dir>)` loads it with parallel drafting on.
- `eagle3` (docs/export.md 2.2): a plain Llama draft config with `architectures: ["LlamaForCausalLMEagle3"]`,
  `pard_token`, `parallel_drafting: true`; served as
  `vllm serve <target> --speculative-config '{"method": "eagle3", "model": <dir>, "parallel_drafting": true}'`.

Weights in both: the draft's own tensor names (no `model.` prefix: vLLM adds it), floats in bf16,
`d2t` int64 offsets `[Vd]`, `t2d` bool `[V]` (absent when Vd == V), `mask_hidden` `[1, 1, 3H]`, and no
training-only tensors. `validate_export` checks a directory against every rule vLLM enforces plus the
pitfalls of docs/algorithm.md 5.7/5.8, one message per violation; `export_draft` runs it before returning.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from safetensors.torch import save_file

from peagle.errors import CheckpointError
from peagle.export.rules import (
    EAGLE3_ARCHITECTURES,
    SPECULATORS_ARCHITECTURE,
    check_export,
    is_training_only,
    read_export_config,
    validate_export,
    verifier_of,
)
from peagle.fileio import fsync_file, publish_dir

if TYPE_CHECKING:
    from peagle.model.draft import DraftConfig, PEagleDraft

__all__ = [
    "EAGLE3_ARCHITECTURES",
    "SPECULATORS_ARCHITECTURE",
    "build_eagle3_config",
    "build_speculators_config",
    "check_export",
    "draft_config_from_export",
    "export_draft",
    "export_state_dict",
    "layer_config_from_draft",
    "load_exported_draft",
    "num_speculative_tokens_of",
    "read_export_config",
    "validate_export",
    "verifier_of",
]

Layout = Literal["speculators", "eagle3"]

# --------------------------------------------------------------------------------------------------
# Config builders
# --------------------------------------------------------------------------------------------------


def layer_config_from_draft(draft: PEagleDraft) -> dict[str, Any]:
    """The `transformer_layer_config` dict (a Llama config) of a draft model.

    Args:
        draft: a `PEagleDraft`; its `config` (a `DraftConfig`) describes the layers.

    Returns:
        A JSON-able Llama config dict with `num_hidden_layers` = the draft's layer count.
    """
    d = draft.config.llama_config().to_dict()
    keep = (
        "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim", "hidden_act",
        "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings", "mlp_bias",
        "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id", "pretraining_tp",
        "rms_norm_eps", "rope_parameters", "vocab_size",
    )  # fmt: skip
    out = {k: d[k] for k in keep if k in d}
    out["model_type"] = "llama"
    out["tie_word_embeddings"] = False
    out["use_cache"] = True
    out["num_hidden_layers"] = len(draft.layers)
    return json.loads(json.dumps(out))


def build_speculators_config(
    layer_config: dict[str, Any],
    *,
    draft_vocab_size: int,
    mask_token_id: int,
    aux_layer_ids: list[int],
    num_speculative_tokens: int,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
) -> dict[str, Any]:
    """The speculators-format `config.json` of a P-EAGLE draft (docs/export.md 2.1).

    Args:
        layer_config: the draft's Llama config (`transformer_layer_config`).
        draft_vocab_size: Vd (rows of `lm_head`).
        mask_token_id: token id of masked slots (vLLM's `pard_token`).
        aux_layer_ids: 3 target layer ids in vLLM's "input of layer" convention.
        num_speculative_tokens: K served by default (= trained `num_depths`).
        verifier_name_or_path: what vLLM loads as the target (hub id or local folder).
        verifier_architectures: the target's `architectures`.
    """
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "draft_vocab_size": int(draft_vocab_size),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
        "embed_requires_grad": True,
        "fc_norm": False,
        "mask_token_id": int(mask_token_id),
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "peagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_speculative_tokens),
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "architectures": list(verifier_architectures),
                "name_or_path": str(verifier_name_or_path),
            },
        },
        "speculators_model_type": "peagle",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "transformer_layer_config": dict(layer_config),
        "torch_dtype": "bfloat16",
    }


def build_eagle3_config(
    layer_config: dict[str, Any],
    *,
    draft_vocab_size: int,
    mask_token_id: int,
    aux_layer_ids: list[int],
    num_speculative_tokens: int,
) -> dict[str, Any]:
    """The plain EAGLE-3 `config.json` (docs/export.md 2.2): a Llama draft config plus the EAGLE-3/P-EAGLE keys."""
    out = dict(layer_config)
    out.update(
        {
            "architectures": [EAGLE3_ARCHITECTURES[0]],
            "draft_vocab_size": int(draft_vocab_size),
            "target_hidden_size": int(layer_config["hidden_size"]),
            "pard_token": int(mask_token_id),
            "mask_token_id": int(mask_token_id),
            "parallel_drafting": True,
            "num_depths": int(num_speculative_tokens),
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
            "norm_before_residual": False,
            "norm_before_fc": False,
            "torch_dtype": "bfloat16",
        }
    )
    return out


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def export_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors as exported: training-only keys dropped, `model.` stripped, floats bf16, d2t int64, t2d bool."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if is_training_only(key):
            continue
        name = key.removeprefix("model.")
        t = t.detach().to("cpu")
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif t.is_floating_point():
            t = t.to(torch.bfloat16)
        out[name] = t.contiguous()
    return out


def _write_files(dest: Path, files: dict[str, bytes | dict[str, torch.Tensor]]) -> None:
    for name, payload in files.items():
        if isinstance(payload, bytes):
            (dest / name).write_bytes(payload)
        else:
            save_file(payload, str(dest / name), metadata={"format": "pt"})
        fsync_file(dest / name)


def _write_dir_atomic(out_dir: Path, files: dict[str, bytes | dict[str, torch.Tensor]]) -> None:
    with publish_dir(out_dir) as tmp:
        _write_files(tmp, files)


def export_draft(
    draft: PEagleDraft,
    out_dir: str | Path,
    *,
    num_speculative_tokens: int,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    layout: Layout = "speculators",
    extra_files: dict[str, str] | None = None,
    in_place: bool = False,
) -> Path:
    """Write a vLLM-ready directory for `draft` and validate it.

    The mask token id and the aux layer ids (vLLM "input of layer" convention) come from `draft.config`.

    Args:
        draft: the trained draft (any dtype/device; written as bf16 on CPU).
        out_dir: destination directory (replaced atomically if it exists).
        num_speculative_tokens: K (= `peagle.num_depths`).
        verifier_name_or_path: the target vLLM loads.
        verifier_architectures: the target's architectures.
        layout: `speculators` (docs/export.md 2.1) or `eagle3` (docs/export.md 2.2).
        extra_files: more text files to write into the directory (name -> content).
        in_place: write the files into `out_dir` (created if missing; other files kept), e.g. a
            checkpoint's temporary directory, instead of replacing the directory atomically.

    Raises:
        ExportInvalidError: the written directory breaks a rule vLLM enforces (it is left in place).
    """
    layer = layer_config_from_draft(draft)
    vd = int(draft.lm_head.weight.shape[0])
    common: dict[str, Any] = {
        "draft_vocab_size": vd,
        "mask_token_id": int(draft.config.mask_token_id),
        "aux_layer_ids": list(draft.config.aux_layer_ids),
        "num_speculative_tokens": num_speculative_tokens,
    }
    if layout == "speculators":
        config = build_speculators_config(
            layer,
            verifier_name_or_path=verifier_name_or_path,
            verifier_architectures=verifier_architectures,
            **common,
        )
    elif layout == "eagle3":
        config = build_eagle3_config(layer, **common)
    else:
        raise ValueError(f"layout must be 'speculators' or 'eagle3', got {layout!r}")
    files: dict[str, bytes | dict[str, torch.Tensor]] = {
        "config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
        "model.safetensors": export_state_dict(draft.state_dict()),
    }
    for name, text in (extra_files or {}).items():
        files[name] = text.encode()
    out = Path(out_dir)
    if in_place:
        out.mkdir(parents=True, exist_ok=True)
        _write_files(out, files)
    else:
        _write_dir_atomic(out, files)
    check_export(out)
    return out


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def draft_config_from_export(cfg: dict[str, Any]) -> DraftConfig:
    """Rebuild the `DraftConfig` described by an export's `config.json` (either layout)."""
    from peagle.model.draft import DraftConfig

    layer = cfg.get("transformer_layer_config", cfg)
    rope = layer.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": float(layer.get("rope_theta", 1e4)),
    }
    return DraftConfig(
        hidden_size=int(layer["hidden_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer["num_key_value_heads"]),
        head_dim=int(layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]),
        intermediate_size=int(layer["intermediate_size"]),
        num_layers=int(layer["num_hidden_layers"]),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(cfg["draft_vocab_size"]),
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_parameters=dict(rope),
        max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
        hidden_act=str(layer.get("hidden_act", "silu")),
        mask_token_id=int(cfg.get("mask_token_id", cfg.get("pard_token", 0))),
        aux_layer_ids=list(cfg.get("eagle_aux_hidden_state_layer_ids") or []),
    )


def num_speculative_tokens_of(cfg: dict[str, Any]) -> int:
    """K written in an export's config (`speculative_tokens` of the default proposal, or `num_depths`)."""
    sc = cfg.get("speculators_config")
    if isinstance(sc, dict):
        methods = [m for m in sc.get("proposal_methods") or [] if isinstance(m, dict)]
        chosen = next(
            (m for m in methods if m.get("proposal_type") == sc.get("default_proposal_method")), None
        )
        chosen = chosen or (methods[0] if methods else {})
        return int(chosen.get("speculative_tokens", 1))
    return int(cfg.get("num_depths", 1))


def load_exported_draft(
    path: str | Path, *, dtype: torch.dtype = torch.float32, validate: bool = True
) -> PEagleDraft:
    """Rebuild a `PEagleDraft` from an export directory (round trip of `export_draft`).

    Args:
        path: the export directory (`config.json` + `model.safetensors`).
        dtype: dtype of the returned draft's float weights (stored as bf16).
        validate: run `check_export` first.

    Raises:
        ExportInvalidError: `validate` and the directory breaks a rule.
        CheckpointError: the weights do not fit the config.
    """
    from safetensors.torch import load_file

    from peagle.model.draft import PEagleDraft

    path = Path(path)
    if validate:
        check_export(path)
    cfg = read_export_config(path)
    draft = PEagleDraft(draft_config_from_export(cfg))
    state = {k.removeprefix("model."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    try:
        draft.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path / 'model.safetensors'} does not fit its config.json: {exc}") from None
    draft.to(dtype)
    if draft.d2t is not None:
        draft.d2t = draft.d2t.to(torch.int64)
        draft.t2d = draft.t2d.to(torch.bool)
    return draft.eval()
