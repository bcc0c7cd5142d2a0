"""Validator of vLLM-ready P-EAGLE export directories (docs/export.md 4-5, docs/algorithm.md 5.7-5.8).

Two severities (docs/export.md 6 lists every rule and its class):

* errors: what makes vLLM 0.32 refuse to load the draft or serve it wrongly; each message names that
  consequence. `validate_export(dir)` returns them (empty = valid), `check_export` raises
  `ExportInvalidError` with all of them.
* warnings: conventions vLLM does not enforce (top-level `architectures` of a speculators config, which
  vLLM replaces from `transformer_layer_config.model_type`; fp32/fp16 weights and `torch_dtype`, which
  vLLM casts to the serving dtype; `t2d`, which vLLM skips; ...). `validate_export_report(dir)` returns
  both lists; `peagle validate` prints warnings and still exits 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import torch
from safetensors import safe_open

from peagle.errors import ExportInvalidError

__all__ = [
    "EAGLE3_ARCHITECTURES",
    "SPECULATORS_ARCHITECTURE",
    "ExportReport",
    "check_export",
    "is_training_only",
    "read_export_config",
    "validate_export",
    "validate_export_report",
    "verifier_of",
]

SPECULATORS_ARCHITECTURE = "PEagleSpeculator"
# Names vLLM 0.32's model registry maps to its Llama EAGLE-3 draft (llama_eagle3.py); the first is written.
EAGLE3_ARCHITECTURES = (
    "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM",
    "PeagleLlamaForCausalLM",
    "PEagleDraftModel",
)
# Draft layer model types the vLLM `peagle` config updater accepts.
_LAYER_MODEL_TYPES = ("llama", "qwen3")
# Keys of the draft's state dict that exist only for training (never exported).
_TRAINING_ONLY_PREFIXES = ("verifier_norm.", "verifier_lm_head.", "verifier.")
_TRAINING_ONLY_SUBSTRINGS = ("rotary_emb.inv_freq",)
# Flags vLLM's `peagle` updater forwards (and vLLM applies) vs. flags it drops (vLLM serves without them).
_APPLIED_NORM_FLAGS = ("norm_before_residual", "norm_before_fc")
_DROPPED_NORM_FLAGS = ("fc_norm", "norm_output")
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
_INT_DTYPES = ("I64", "I32", "I16", "I8", "U8")


@dataclass
class ExportReport:
    """What `validate_export_report` found: `errors` (vLLM refuses / serves wrongly) and `warnings`."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


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


def verifier_of(cfg: dict[str, Any]) -> str | None:
    """The verifier an export's config names (`speculators_config.verifier.name_or_path`: a hub id, a
    `builtin:*` name or a folder), or None when it names none (the eagle3 layout, a malformed config).
    `peagle.builtin.local_verifier` maps it to what loads on this machine."""
    sc = cfg.get("speculators_config")
    verifier = sc.get("verifier") if isinstance(sc, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) and name else None


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


def _check_speculators_config(cfg: dict[str, Any], r: ExportReport) -> dict[str, Any] | None:
    """Rules of vLLM's speculators config parser; returns the layer config when usable."""
    bad, warn = r.errors, r.warnings
    sc = cfg.get("speculators_config")
    if not isinstance(sc, dict):
        bad.append(
            "config.json: speculators_config must be an object (vLLM refuses to load: invalid speculators config)"
        )
        sc = {}
    methods = sc.get("proposal_methods")
    if not isinstance(methods, list) or not methods:
        bad.append(
            "config.json: speculators_config.proposal_methods must be a non-empty list (vLLM refuses to load)"
        )
        methods = []
    for i, m in enumerate(methods):
        if i == 0 and not isinstance(m, dict):
            bad.append(
                "config.json: speculators_config.proposal_methods[0] must be an object (vLLM reads "
                "speculative_tokens from it; it refuses to load)"
            )
        elif not isinstance(m, dict) or "proposal_type" not in m:
            warn.append(
                f"config.json: speculators_config.proposal_methods[{i}] has no proposal_type (vLLM does not "
                "read it; speculators' own tools do)"
            )
    first = methods[0] if methods and isinstance(methods[0], dict) else None
    if first is not None:
        k = first.get("speculative_tokens")
        if not _is_int(k) or k < 1:
            bad.append(
                "config.json: proposal_methods[0].speculative_tokens must be an int >= 1, got "
                f"{k!r} (vLLM takes num_speculative_tokens from it; it refuses to load)"
            )
        default = sc.get("default_proposal_method")
        if default is not None and first.get("proposal_type") != default:
            warn.append(
                f"config.json: default_proposal_method is {default!r} but vLLM serves proposal_methods[0] "
                f"({first.get('proposal_type')!r}, speculative_tokens {k!r})"
            )
    verifier = sc.get("verifier")
    if (
        not isinstance(verifier, dict)
        or not isinstance(verifier.get("name_or_path"), str)
        or not verifier.get("name_or_path")
    ):
        bad.append(
            "config.json: speculators_config.verifier.name_or_path is required (the target vLLM loads; "
            "without it vLLM refuses to load)"
        )
    elif not isinstance(verifier.get("architectures"), list) or not verifier["architectures"]:
        warn.append(
            "config.json: speculators_config.verifier.architectures does not list the target's architectures "
            "(vLLM does not read it)"
        )
    mt = cfg.get("speculators_model_type")
    if mt is None:
        bad.append("config.json: speculators_model_type is required (vLLM refuses to load without it)")
    elif mt != "peagle":
        bad.append(
            f"config.json: speculators_model_type must be 'peagle' (vLLM turns on parallel drafting only for it; "
            f"otherwise it refuses or serves the draft as a sequential one), got {mt!r}"
        )
    if cfg.get("architectures") != [SPECULATORS_ARCHITECTURE]:
        warn.append(
            f"config.json: architectures is {cfg.get('architectures')!r}, not [{SPECULATORS_ARCHITECTURE!r}] "
            "(vLLM ignores it: it picks the architecture from transformer_layer_config.model_type)"
        )
    if "mask_token_id" not in cfg:
        bad.append(
            "config.json: mask_token_id is required (vLLM maps it to pard_token; without it loading fails)"
        )
    warn.extend(_applied_norm_warnings(cfg))
    for flag in _DROPPED_NORM_FLAGS:
        if cfg.get(flag, False) is not False:
            bad.append(
                f"config.json: {flag} must be false, got {cfg[flag]!r} (vLLM's peagle loader drops it and "
                "would serve the draft without that norm)"
            )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        bad.append(
            "config.json: transformer_layer_config is required and must be an object (vLLM refuses to load)"
        )
        return None
    return layer


def _check_eagle3_config(cfg: dict[str, Any], r: ExportReport) -> dict[str, Any]:
    bad, warn = r.errors, r.warnings
    arch = cfg.get("architectures")
    if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in EAGLE3_ARCHITECTURES:
        bad.append(
            f"config.json: architectures must be one of {list(EAGLE3_ARCHITECTURES)} (names in vLLM's registry "
            f"for its Llama EAGLE-3 draft; vLLM refuses others), got {arch!r}"
        )
    if not any(k in cfg for k in ("mask_token_id", "pard_token", "ptd_token_id")):
        bad.append(
            "config.json: pard_token (the mask token id) is required for parallel drafting in vLLM "
            "(mask_token_id or ptd_token_id also work; without one vLLM refuses to load)"
        )
    if cfg.get("parallel_drafting") is not True:
        warn.append(
            "config.json: parallel_drafting is not true; vLLM reads it only from --speculative-config "
            '(serve with "parallel_drafting": true)'
        )
    warn.extend(_applied_norm_warnings(cfg))
    return cfg


def _applied_norm_warnings(cfg: dict[str, Any]) -> list[str]:
    """Norm flags vLLM applies but the reference decoder does not (both layouts)."""
    return [
        f"config.json: {flag} is {cfg[flag]!r}: vLLM applies it, but peagle's reference decoder "
        "does not (use `peagle eval --engine vllm` for this draft)"
        for flag in _APPLIED_NORM_FLAGS
        if cfg.get(flag, False) is not False
    ]


def _check_layer_config(layer: dict[str, Any], cfg: dict[str, Any], r: ExportReport, where: str) -> None:
    bad, warn = r.errors, r.warnings
    mt = layer.get("model_type")
    if where and mt is None:
        warn.append(f"config.json: {where}model_type is missing (vLLM assumes 'llama')")
    elif where and mt not in _LAYER_MODEL_TYPES:
        bad.append(
            f"config.json: {where}model_type must be one of {list(_LAYER_MODEL_TYPES)}, got {mt!r} "
            "(vLLM's peagle loader refuses others)"
        )
    elif not where and mt not in _LAYER_MODEL_TYPES:
        warn.append(
            f"config.json: model_type is {mt!r}, not one of {list(_LAYER_MODEL_TYPES)} (vLLM builds the draft "
            "from `architectures`; peagle has only checked these)"
        )
    for key in _LAYER_REQUIRED:
        if not (_is_int(layer.get(key)) or (key == "rms_norm_eps" and isinstance(layer.get(key), float))):
            bad.append(
                f"config.json: {where}{key} is required (vLLM would build the draft from transformers' default "
                "and the weights would not fit)"
            )
    if layer.get("tie_word_embeddings", False):
        warn.append(
            f"config.json: {where}tie_word_embeddings is true; vLLM ignores it for an EAGLE-3 draft and loads "
            "lm_head.weight"
        )
    v, vd = layer.get("vocab_size"), cfg.get("draft_vocab_size")
    if vd is None and _is_int(v):
        warn.append(f"config.json: draft_vocab_size is missing (vLLM takes vocab_size {v})")
    elif not _is_int(vd) or vd < 1:
        bad.append(
            f"config.json: draft_vocab_size must be an int >= 1, got {vd!r} (vLLM refuses to build lm_head)"
        )
    elif _is_int(v) and vd > v:
        bad.append(
            f"config.json: draft_vocab_size ({vd}) must be <= {where}vocab_size ({v}) (vLLM scatters draft "
            "logits into the target vocabulary)"
        )
    mask = cfg.get("mask_token_id", cfg.get("pard_token", cfg.get("ptd_token_id")))
    if mask is not None and (not _is_int(mask) or (_is_int(v) and not 0 <= mask < v)):
        bad.append(
            f"config.json: mask_token_id must be an int in [0, vocab_size={v}), got {mask!r} (vLLM embeds it in "
            "every parallel-drafting slot)"
        )
    ths, h = cfg.get("target_hidden_size"), layer.get("hidden_size")
    if ths is not None and not (_is_int(ths) and ths >= 1):
        bad.append(f"config.json: target_hidden_size must be null or an int >= 1, got {ths!r}")
    elif ths is not None and ths != h:
        warn.append(
            f"config.json: target_hidden_size ({ths}) differs from hidden_size ({h}): vLLM sizes fc and "
            "mask_hidden from it (3 x target_hidden_size), but peagle's reference decoder cannot load this draft"
        )


def _check_aux_ids(cfg: dict[str, Any], r: ExportReport) -> None:
    bad, warn = r.errors, r.warnings
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return
    if not isinstance(ids, list) or len(ids) != 3 or not all(_is_int(i) for i in ids):
        bad.append(
            f"config.json: eagle_aux_hidden_state_layer_ids must be 3 ints, got {ids!r} (vLLM feeds fc "
            "3 x hidden_size of captured states)"
        )
        return
    if len(set(ids)) != 3:
        warn.append(
            f"config.json: eagle_aux_hidden_state_layer_ids {ids} repeat a layer (vLLM captures it twice)"
        )
    n = _verifier_num_layers(verifier_of(cfg))
    if n is None:
        return
    if any(not 0 <= i < n for i in ids):
        bad.append(
            f"config.json: eagle_aux_hidden_state_layer_ids {ids} out of range for a {n}-layer target "
            f"(vLLM 'input of layer' ids are in [0, {n}); it never captures the others)"
        )
    elif sorted(ids) == [1, n // 2 - 1, n - 4] and sorted(ids) != [2, n // 2, n - 3]:
        warn.append(
            f"config.json: eagle_aux_hidden_state_layer_ids {ids} look like the output-of-layer (hook) convention; "
            f"vLLM expects input-of-layer ids, e.g. {[2, n // 2, n - 3]} (it serves either; a draft trained on "
            "the other convention is served on states one layer off)"
        )


def _check_weights(f: Path, layer: dict[str, Any], cfg: dict[str, Any], r: ExportReport) -> None:
    bad, warn = r.errors, r.warnings
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
                "vLLM adds the prefix itself and would look for 'model.model.*' (it refuses to load)"
            )
        keys = [k.removeprefix("model.") for k in keys]
        shapes = {k.removeprefix("model."): s for k, s in shapes.items()}
        dtypes = {k.removeprefix("model."): d for k, d in dtypes.items()}
        training = [k for k in keys if is_training_only(k)]
        if training:
            bad.append(
                f"model.safetensors: training-only tensors must not be exported: {sorted(training)} (vLLM has "
                "no such parameter and refuses to load)"
            )
        for k in keys:
            if k in ("d2t", "t2d") or is_training_only(k):
                continue
            if dtypes[k] not in _FLOAT_DTYPES:
                bad.append(
                    f"model.safetensors: {k} must be a float tensor, got {dtypes[k]} (vLLM cannot serve it)"
                )
        cast = sorted({dtypes[k] for k in keys if dtypes[k] in _FLOAT_DTYPES and dtypes[k] != "BF16"})
        if cast:
            n_cast = sum(1 for k in keys if dtypes[k] in cast)
            warn.append(
                f"model.safetensors: {n_cast} float tensors are {'/'.join(cast)}, not bfloat16 (vLLM casts them "
                "to the serving dtype at load; the file is larger than needed)"
            )
        h, n_layers = layer.get("hidden_size"), layer.get("num_hidden_layers")
        v = layer.get("vocab_size")
        vd = cfg.get("draft_vocab_size", v)
        t = cfg.get("target_hidden_size") or h
        if not (_is_int(h) and _is_int(n_layers) and _is_int(v) and _is_int(vd) and _is_int(t)):
            return  # the config errors already say why
        _check_shapes(keys, shapes, h, t, n_layers, v, vd, cfg, r)
        _check_vocab_mapping(lambda name: sf.get_tensor(raw[name]), keys, shapes, dtypes, v, vd, r)
        for k in keys:
            if dtypes[k] in _FLOAT_DTYPES:
                x = sf.get_tensor(raw[k])
                if not torch.isfinite(x.float()).all():
                    bad.append(
                        f"model.safetensors: {k} contains NaN or inf (never loaded/trained?); vLLM would serve "
                        "garbage drafts"
                    )


def _check_shapes(
    keys: list[str],
    shapes: dict[str, list[int]],
    h: int,
    t: int,
    n_layers: int,
    v: int,
    vd: int,
    cfg: dict[str, Any],
    r: ExportReport,
) -> None:
    """Shapes vLLM's weight loader asserts (h: draft hidden size, t: target hidden size, fc takes 3t)."""
    bad = r.errors
    refuse = " (vLLM's weight loader refuses a mismatch)"

    def want(
        key: str, shape: list[int], why: str = "", missing: str = " (vLLM would serve it uninitialised)"
    ) -> None:
        if key not in shapes:
            bad.append(f"model.safetensors: {key} is missing{why}{missing}")
        elif shapes[key] != shape:
            bad.append(f"model.safetensors: {key} has shape {shapes[key]}, expected {shape}{why}{refuse}")

    if "mask_hidden" not in shapes:
        bad.append(
            "model.safetensors: mask_hidden is missing (vLLM refuses a parallel-drafting draft without it)"
        )
    elif shapes["mask_hidden"] not in ([1, 1, 3 * t], [1, 3 * t], [3 * t]):
        bad.append(
            f"model.safetensors: mask_hidden has shape {shapes['mask_hidden']}, expected [1, 1, {3 * t}] "
            f"(3 x target hidden size {t}; vLLM refuses to load)"
        )
    want("fc.weight", [h, 3 * t])
    want("norm.weight", [h])
    want("lm_head.weight", [vd, h], " (draft_vocab_size x hidden_size)")
    if "embed_tokens.weight" in shapes or cfg.get("embed_requires_grad", True):
        want(
            "embed_tokens.weight",
            [v, h],
            " (P-EAGLE trains the embedding; it must be exported)",
            missing=" (vLLM would serve the draft with the target's embedding instead)",
        )
    else:
        r.warnings.append(
            "model.safetensors: embed_tokens.weight is absent (vLLM shares the target's; embed_requires_grad is false)"
        )
    layer_ids = sorted(
        {int(k.split(".")[1]) for k in keys if k.startswith("layers.") and k.split(".")[1].isdigit()}
    )
    if layer_ids != list(range(n_layers)):
        bad.append(
            f"config.json: transformer_layer_config.num_hidden_layers is {n_layers} but the weights hold "
            f"{len(layer_ids)} layers {layer_ids} (vLLM refuses extra layers and leaves missing ones uninitialised)"
        )
    if "layers.0.hidden_norm.weight" not in shapes and n_layers >= 1:
        bad.append(
            "model.safetensors: layers.0.hidden_norm.weight is missing (fused EAGLE-3 first layer; vLLM would "
            "serve it uninitialised)"
        )
    q0 = shapes.get("layers.0.self_attn.q_proj.weight")
    if q0 is not None and q0[1] != 2 * h:
        bad.append(
            f"model.safetensors: layers.0.self_attn.q_proj.weight takes {q0[1]} inputs, expected {2 * h} (2H)"
            f"{refuse}"
        )


def _check_vocab_mapping(
    get: Any,
    keys: list[str],
    shapes: dict[str, list[int]],
    dtypes: dict[str, str],
    v: int,
    vd: int,
    r: ExportReport,
) -> None:
    """`d2t` is what vLLM reads (errors); `t2d` vLLM skips (warnings), it only cross-checks `d2t`."""
    bad, warn = r.errors, r.warnings
    has_d2t, has_t2d = "d2t" in keys, "t2d" in keys
    if vd < v and not has_d2t:
        bad.append(
            f"model.safetensors: d2t is missing while draft_vocab_size ({vd}) < vocab_size ({v}); vLLM would use "
            "an identity mapping and acceptance collapses"
        )
    t2d = None
    if has_t2d:
        if dtypes["t2d"] != "BOOL":
            warn.append(f"model.safetensors: t2d is {dtypes['t2d']}, not bool (vLLM skips t2d)")
        elif shapes["t2d"] != [v]:
            warn.append(f"model.safetensors: t2d has shape {shapes['t2d']}, not [{v}] (vLLM skips t2d)")
        else:
            t2d = get("t2d")
            if int(t2d.sum()) != vd:
                warn.append(
                    f"model.safetensors: t2d selects {int(t2d.sum())} tokens, not draft_vocab_size {vd} "
                    "(vLLM skips t2d)"
                )
                t2d = None
    if not has_d2t:
        return
    if dtypes["d2t"] not in _INT_DTYPES:
        bad.append(
            f"model.safetensors: d2t must be int64, got {dtypes['d2t']} (vLLM loads it as integer offsets)"
        )
        return
    if dtypes["d2t"] != "I64":
        warn.append(f"model.safetensors: d2t is {dtypes['d2t']}, not int64 (vLLM casts it at load)")
    if shapes["d2t"] != [vd]:
        bad.append(
            f"model.safetensors: d2t has shape {shapes['d2t']}, expected [{vd}] (draft_vocab_size; vLLM "
            "refuses a mismatch)"
        )
        return
    d2t = get("d2t").long()
    target = torch.arange(vd) + d2t  # [Vd] target id of each draft index
    if t2d is not None:
        selected = t2d.nonzero().flatten()  # [Vd]
        if torch.equal(target, selected):
            return
        if torch.equal(d2t, selected):
            bad.append(
                "model.safetensors: d2t holds absolute target ids; vLLM expects offsets (target_id - index) and "
                "would serve drafts of the wrong tokens"
            )
            return
    if bool((target < 0).any()) or bool((target >= v).any()):
        hint = (
            " (absolute ids instead of offsets?)" if bool((d2t < v).all()) and bool((d2t >= 0).all()) else ""
        )
        bad.append(f"model.safetensors: d2t maps draft ids outside [0, {v}){hint}; vLLM cannot serve it")
    elif int(target.unique().numel()) != vd:
        bad.append(
            "model.safetensors: d2t maps two draft ids to one target id (vLLM would drop one draft logit)"
        )
    elif t2d is not None:
        warn.append(
            "model.safetensors: d2t and t2d disagree (arange(Vd) + d2t != nonzero(t2d)); vLLM reads only d2t, "
            "so check that d2t is the mapping the draft was trained with"
        )
    elif not bool((target[1:] > target[:-1]).all()):
        warn.append(
            "model.safetensors: d2t maps draft ids to target ids out of ascending order (vLLM accepts it)"
        )


def validate_export_report(path: str | Path) -> ExportReport:
    """Errors (vLLM refuses / serves wrongly) and warnings (conventions vLLM does not enforce) of an export.

    Detects the layout from `config.json`: `speculators_config` present = speculators format, else the
    plain EAGLE-3 layout.
    """
    path = Path(path)
    r = ExportReport()
    if not path.is_dir():
        r.errors.append(f"{path}: not a directory")
        return r
    try:
        cfg = read_export_config(path)
    except ExportInvalidError as exc:
        r.errors.extend(exc.violations)
        return r
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        layer = _check_speculators_config(cfg, r)
        where = "transformer_layer_config."
    else:
        layer = _check_eagle3_config(cfg, r)
        where = ""
    if layer is None:
        return r
    _check_layer_config(layer, cfg, r, where)
    _check_aux_ids(cfg, r)
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype not in (None, "bfloat16"):
        r.warnings.append(
            f"config.json: torch_dtype is {dtype!r}, not 'bfloat16' (vLLM serves in the target's dtype or --dtype)"
        )
    f = path / "model.safetensors"
    if not f.is_file():
        r.errors.append("model.safetensors is missing")
    else:
        _check_weights(f, layer, cfg, r)
    return r


def validate_export(path: str | Path) -> list[str]:
    """Every error of an export directory: what makes vLLM refuse it or serve it wrongly (empty = valid).

    Warnings (conventions vLLM does not enforce) are in `validate_export_report`.
    """
    return validate_export_report(path).errors


def check_export(path: str | Path) -> None:
    """Raise `ExportInvalidError` (listing every error) unless `path` is a valid export."""
    bad = validate_export(path)
    if bad:
        raise ExportInvalidError(bad)
