"""Validator of vLLM-ready P-EAGLE export directories (docs/export.md 4-5, docs/algorithm.md 5.7-5.8).

`validate_export(dir)` lists every violation, one precise message each (empty = valid):
config rules of vLLM's speculators parser and `peagle` updater (speculators_config shape, proposal
methods, verifier, `speculators_model_type`, `mask_token_id`, layer config, norm flags,
`target_hidden_size`), the plain EAGLE-3 rules (`architectures` in vLLM's registry, `pard_token`,
`parallel_drafting`), and the weight rules (no `model.` prefix, no training-only tensors, bf16 floats,
`mask_hidden` of 3H, `num_hidden_layers` = layers in the weights, fused first layer, `d2t` int64
offsets consistent with `t2d`, `d2t` present when Vd < V, no NaN). `check_export` raises
`ExportInvalidError` with all of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeGuard

import torch
from safetensors import safe_open

from peagle.errors import ExportInvalidError

__all__ = [
    "EAGLE3_ARCHITECTURES",
    "SPECULATORS_ARCHITECTURE",
    "check_export",
    "is_training_only",
    "read_export_config",
    "validate_export",
]

SPECULATORS_ARCHITECTURE = "PEagleSpeculator"
# Names vLLM's model registry maps to its Llama EAGLE-3 draft (llama_eagle3.py).
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Draft layer model types the vLLM `peagle` config updater accepts.
_LAYER_MODEL_TYPES = ("llama", "qwen3")
# Keys of the draft's state dict that exist only for training (never exported).
_TRAINING_ONLY_PREFIXES = ("verifier_norm.", "verifier_lm_head.", "verifier.")
_TRAINING_ONLY_SUBSTRINGS = ("rotary_emb.inv_freq",)
_NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_LAYER_REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
)


def is_training_only(key: str) -> bool:
    """True for state-dict keys that exist only for training (verifier head/norm, rotary buffers)."""
    return key.startswith(_TRAINING_ONLY_PREFIXES) or any(s in key for s in _TRAINING_ONLY_SUBSTRINGS)


def read_export_config(path: str | Path) -> dict[str, Any]:
    """`config.json` of an export directory as a dict.

    Raises:
        ExportInvalidError: missing or not a JSON object.
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ExportInvalidError([f"{f}: config.json is missing"])
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportInvalidError([f"{f}: not valid JSON ({exc})"]) from None
    if not isinstance(data, dict):
        raise ExportInvalidError([f"{f}: must be a JSON object, got {type(data).__name__}"])
    return data


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _verifier_num_layers(name_or_path: Any) -> int | None:
    if not isinstance(name_or_path, str):
        return None
    cfg = Path(name_or_path).expanduser() / "config.json"
    if not cfg.is_file():
        return None
    try:
        n = json.loads(cfg.read_text(encoding="utf-8")).get("num_hidden_layers")
    except (OSError, json.JSONDecodeError):
        return None
    return n if _is_int(n) else None


def _check_speculators_config(cfg: dict[str, Any], bad: list[str]) -> dict[str, Any] | None:
    """Rules of vLLM's speculators config parser; returns the layer config when usable."""
    sc = cfg.get("speculators_config")
    if not isinstance(sc, dict):
        bad.append("config.json: speculators_config must be an object")
        sc = {}
    methods = sc.get("proposal_methods")
    if not isinstance(methods, list) or not methods:
        bad.append("config.json: speculators_config.proposal_methods must be a non-empty list")
        methods = []
    for i, m in enumerate(methods):
        if not isinstance(m, dict) or "proposal_type" not in m:
            bad.append(
                f"config.json: speculators_config.proposal_methods[{i}] must be an object with proposal_type"
            )
    valid = [m for m in methods if isinstance(m, dict)]
    default = sc.get("default_proposal_method")
    chosen = next((m for m in valid if m.get("proposal_type") == default), valid[0] if valid else None)
    if chosen is not None:
        k = chosen.get("speculative_tokens")
        if not _is_int(k) or k < 1:
            bad.append(
                f"config.json: the selected proposal method's speculative_tokens must be an int >= 1, got {k!r}"
            )
    verifier = sc.get("verifier")
    if (
        not isinstance(verifier, dict)
        or not isinstance(verifier.get("name_or_path"), str)
        or not verifier.get("name_or_path")
    ):
        bad.append(
            "config.json: speculators_config.verifier.name_or_path is required (the target vLLM loads)"
        )
    elif not isinstance(verifier.get("architectures"), list) or not verifier["architectures"]:
        bad.append(
            "config.json: speculators_config.verifier.architectures must list the target's architectures"
        )
    mt = cfg.get("speculators_model_type")
    if mt is None:
        bad.append("config.json: speculators_model_type is required")
    elif mt != "peagle":
        bad.append(
            f"config.json: speculators_model_type must be 'peagle' (vLLM turns on parallel drafting only for it), "
            f"got {mt!r}"
        )
    if cfg.get("architectures") != [SPECULATORS_ARCHITECTURE]:
        bad.append(
            f"config.json: architectures must be [{SPECULATORS_ARCHITECTURE!r}], got {cfg.get('architectures')!r}"
        )
    if "mask_token_id" not in cfg:
        bad.append(
            "config.json: mask_token_id is required (vLLM maps it to pard_token; without it loading fails)"
        )
    for flag in _NORM_FLAGS:
        if cfg.get(flag, False) is not False:
            bad.append(
                f"config.json: {flag} must be false (the draft was trained without it), got {cfg[flag]!r}"
            )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        bad.append("config.json: transformer_layer_config is required and must be an object")
        return None
    return layer


def _check_eagle3_config(cfg: dict[str, Any], bad: list[str]) -> dict[str, Any]:
    arch = cfg.get("architectures")
    if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in EAGLE3_ARCHITECTURES:
        bad.append(
            f"config.json: architectures must be one of {list(EAGLE3_ARCHITECTURES)} (names in vLLM's registry), "
            f"got {arch!r}"
        )
    if "pard_token" not in cfg and "ptd_token_id" not in cfg:
        bad.append("config.json: pard_token (the mask token id) is required for parallel drafting in vLLM")
    if cfg.get("parallel_drafting") is not True:
        bad.append('config.json: parallel_drafting must be true (serve with "parallel_drafting": true)')
    for flag in ("norm_before_residual", "norm_before_fc"):
        if cfg.get(flag, False) is not False:
            bad.append(f"config.json: {flag} must be false, got {cfg[flag]!r}")
    return cfg


def _check_layer_config(layer: dict[str, Any], cfg: dict[str, Any], bad: list[str], where: str) -> None:
    mt = layer.get("model_type")
    if mt not in _LAYER_MODEL_TYPES:
        bad.append(f"config.json: {where}model_type must be one of {list(_LAYER_MODEL_TYPES)}, got {mt!r}")
    for key in _LAYER_REQUIRED:
        if not (_is_int(layer.get(key)) or (key == "rms_norm_eps" and isinstance(layer.get(key), float))):
            bad.append(f"config.json: {where}{key} is required")
    if layer.get("tie_word_embeddings", False):
        bad.append(f"config.json: {where}tie_word_embeddings must be false (the draft has its own lm_head)")
    v, vd = layer.get("vocab_size"), cfg.get("draft_vocab_size")
    if not _is_int(vd) or vd < 1:
        bad.append(f"config.json: draft_vocab_size must be an int >= 1, got {vd!r}")
    elif _is_int(v) and vd > v:
        bad.append(f"config.json: draft_vocab_size ({vd}) must be <= {where}vocab_size ({v})")
    mask = cfg.get("mask_token_id", cfg.get("pard_token", cfg.get("ptd_token_id")))
    if mask is not None and (not _is_int(mask) or (_is_int(v) and not 0 <= mask < v)):
        bad.append(f"config.json: mask_token_id must be an int in [0, vocab_size={v}), got {mask!r}")
    ths = cfg.get("target_hidden_size")
    if ths is not None and ths != layer.get("hidden_size"):
        bad.append(
            f"config.json: target_hidden_size ({ths}) must be null or equal hidden_size ({layer.get('hidden_size')}): "
            "mask_hidden is 3*hidden_size"
        )


def _check_aux_ids(cfg: dict[str, Any], bad: list[str]) -> None:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return
    if not isinstance(ids, list) or len(ids) != 3 or not all(_is_int(i) for i in ids) or len(set(ids)) != 3:
        bad.append(f"config.json: eagle_aux_hidden_state_layer_ids must be 3 distinct ints, got {ids!r}")
        return
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    n = _verifier_num_layers(verifier.get("name_or_path"))
    if n is None:
        return
    if any(not 0 <= i < n for i in ids):
        bad.append(
            f"config.json: eagle_aux_hidden_state_layer_ids {ids} out of range for a {n}-layer target "
            f"(vLLM 'input of layer' ids are in [0, {n}))"
        )
    elif sorted(ids) == [1, n // 2 - 1, n - 4] and sorted(ids) != [2, n // 2, n - 3]:
        bad.append(
            f"config.json: eagle_aux_hidden_state_layer_ids {ids} look like the output-of-layer (hook) convention; "
            f"vLLM expects input-of-layer ids, e.g. {[2, n // 2, n - 3]}"
        )


def _check_weights(f: Path, layer: dict[str, Any], cfg: dict[str, Any], bad: list[str]) -> None:
    try:
        handle = safe_open(str(f), framework="pt")
    except (OSError, ValueError, RuntimeError) as exc:
        bad.append(f"model.safetensors: cannot be read ({exc})")
        return
    with handle as sf:
        keys = list(sf.keys())
        raw = {k.removeprefix("model."): k for k in keys}
        shapes = {k: list(sf.get_slice(k).get_shape()) for k in keys}
        dtypes = {k: sf.get_slice(k).get_dtype() for k in keys}
        prefixed = [k for k in keys if k.startswith("model.")]
        if prefixed:
            bad.append(
                f"model.safetensors: {len(prefixed)} tensor names start with 'model.' (e.g. {prefixed[0]!r}); "
                "vLLM adds the prefix itself and would look for 'model.model.*'"
            )
        keys = [k.removeprefix("model.") for k in keys]
        shapes = {k.removeprefix("model."): s for k, s in shapes.items()}
        dtypes = {k.removeprefix("model."): d for k, d in dtypes.items()}
        training = [k for k in keys if is_training_only(k)]
        if training:
            bad.append(f"model.safetensors: training-only tensors must not be exported: {sorted(training)}")
        for k in keys:
            if k in ("d2t", "t2d") or is_training_only(k):
                continue
            if dtypes[k] != "BF16":
                bad.append(f"model.safetensors: {k} must be bfloat16, got {dtypes[k]}")
        h, n_layers = layer.get("hidden_size"), layer.get("num_hidden_layers")
        v, vd = layer.get("vocab_size"), cfg.get("draft_vocab_size")
        if not (_is_int(h) and _is_int(n_layers) and _is_int(v) and _is_int(vd)):
            return  # the config errors already say why
        _check_shapes(keys, shapes, h, n_layers, v, vd, bad)
        _check_vocab_mapping(lambda name: sf.get_tensor(raw[name]), keys, shapes, dtypes, v, vd, bad)
        for k in keys:
            if dtypes[k] in ("BF16", "F16", "F32", "F64"):
                t = sf.get_tensor(raw[k])
                if not torch.isfinite(t.float()).all():
                    bad.append(f"model.safetensors: {k} contains NaN or inf (never loaded/trained?)")


def _check_shapes(
    keys: list[str], shapes: dict[str, list[int]], h: int, n_layers: int, v: int, vd: int, bad: list[str]
) -> None:
    def want(key: str, shape: list[int], why: str = "") -> None:
        if key not in shapes:
            bad.append(f"model.safetensors: {key} is missing{why}")
        elif shapes[key] != shape:
            bad.append(f"model.safetensors: {key} has shape {shapes[key]}, expected {shape}{why}")

    if "mask_hidden" not in shapes:
        bad.append(
            "model.safetensors: mask_hidden is missing (vLLM refuses a parallel-drafting draft without it)"
        )
    elif shapes["mask_hidden"] not in ([1, 1, 3 * h], [1, 3 * h], [3 * h]):
        bad.append(
            f"model.safetensors: mask_hidden has shape {shapes['mask_hidden']}, expected [1, 1, {3 * h}] "
            f"(3 x hidden_size {h})"
        )
    want("fc.weight", [h, 3 * h])
    want("norm.weight", [h])
    want("lm_head.weight", [vd, h], " (draft_vocab_size x hidden_size)")
    want("embed_tokens.weight", [v, h], " (P-EAGLE trains the embedding; it must be exported)")
    layer_ids = sorted(
        {int(k.split(".")[1]) for k in keys if k.startswith("layers.") and k.split(".")[1].isdigit()}
    )
    if layer_ids != list(range(n_layers)):
        bad.append(
            f"config.json: transformer_layer_config.num_hidden_layers is {n_layers} but the weights hold "
            f"{len(layer_ids)} layers {layer_ids}"
        )
    if "layers.0.hidden_norm.weight" not in shapes and n_layers >= 1:
        bad.append("model.safetensors: layers.0.hidden_norm.weight is missing (fused EAGLE-3 first layer)")
    q0 = shapes.get("layers.0.self_attn.q_proj.weight")
    if q0 is not None and q0[1] != 2 * h:
        bad.append(
            f"model.safetensors: layers.0.self_attn.q_proj.weight takes {q0[1]} inputs, expected {2 * h} (2H)"
        )


def _check_vocab_mapping(
    get: Any,
    keys: list[str],
    shapes: dict[str, list[int]],
    dtypes: dict[str, str],
    v: int,
    vd: int,
    bad: list[str],
) -> None:
    has_d2t, has_t2d = "d2t" in keys, "t2d" in keys
    if vd < v and not has_d2t:
        bad.append(
            f"model.safetensors: d2t is missing while draft_vocab_size ({vd}) < vocab_size ({v}); vLLM would use "
            "an identity mapping and acceptance collapses"
        )
    t2d = None
    if has_t2d:
        if dtypes["t2d"] != "BOOL":
            bad.append(f"model.safetensors: t2d must be bool, got {dtypes['t2d']}")
        elif shapes["t2d"] != [v]:
            bad.append(f"model.safetensors: t2d has shape {shapes['t2d']}, expected [{v}] (vocab_size)")
        else:
            t2d = get("t2d")
            if int(t2d.sum()) != vd:
                bad.append(
                    f"model.safetensors: t2d selects {int(t2d.sum())} tokens, expected draft_vocab_size {vd}"
                )
                t2d = None
    if not has_d2t:
        return
    if dtypes["d2t"] != "I64":
        bad.append(f"model.safetensors: d2t must be int64, got {dtypes['d2t']}")
        return
    if shapes["d2t"] != [vd]:
        bad.append(f"model.safetensors: d2t has shape {shapes['d2t']}, expected [{vd}] (draft_vocab_size)")
        return
    d2t = get("d2t")
    target = torch.arange(vd) + d2t  # [Vd] target id of each draft index
    if t2d is not None:
        selected = t2d.nonzero().flatten()  # [Vd]
        if torch.equal(target, selected):
            return
        if torch.equal(d2t, selected):
            bad.append(
                "model.safetensors: d2t holds absolute target ids; vLLM expects offsets (target_id - index)"
            )
        else:
            bad.append(
                "model.safetensors: d2t and t2d disagree (arange(Vd) + d2t must equal nonzero(t2d), ascending)"
            )
        return
    if bool((target < 0).any()) or bool((target >= v).any()):
        hint = (
            " (absolute ids instead of offsets?)" if bool((d2t < v).all()) and bool((d2t >= 0).all()) else ""
        )
        bad.append(f"model.safetensors: d2t maps draft ids outside [0, {v}){hint}")
    elif not bool((target[1:] > target[:-1]).all()):
        bad.append("model.safetensors: d2t must map draft ids to distinct, ascending target ids")


def validate_export(path: str | Path) -> list[str]:
    """Every violation of vLLM's loading rules in an export directory (empty list = valid).

    Detects the layout from `config.json`: `speculators_config` present = speculators format, else the
    plain EAGLE-3 layout.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: not a directory"]
    try:
        cfg = read_export_config(path)
    except ExportInvalidError as exc:
        return list(exc.violations)
    bad: list[str] = []
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        layer = _check_speculators_config(cfg, bad)
        where = "transformer_layer_config."
    else:
        layer = _check_eagle3_config(cfg, bad)
        where = ""
    if layer is None:
        return bad
    _check_layer_config(layer, cfg, bad, where)
    _check_aux_ids(cfg, bad)
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype not in (None, "bfloat16"):
        bad.append(f"config.json: torch_dtype must be 'bfloat16' (the weights are bf16), got {dtype!r}")
    f = path / "model.safetensors"
    if not f.is_file():
        bad.append("model.safetensors is missing")
    else:
        _check_weights(f, layer, cfg, bad)
    return bad


def check_export(path: str | Path) -> None:
    """Raise `ExportInvalidError` (listing every violation) unless `path` is a valid export."""
    bad = validate_export(path)
    if bad:
        raise ExportInvalidError(bad)
