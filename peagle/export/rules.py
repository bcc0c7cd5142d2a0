"""Validator of vLLM-ready P-EAGLE export directories (docs/export.md 4-5, docs/algorithm.md 5.7-5.8).

Two severities (docs/export.md 6 lists every rule and its class):

* errors: what makes vLLM 0.32 refuse to load the draft or serve it wrongly; each message names that
  consequence. `validate_export(dir)` returns them (empty = valid), `check_export` raises
  `ExportInvalidError` with all of them.
* warnings: conventions vLLM does not enforce (top-level `architectures` of a speculators config, which
  vLLM replaces from `transformer_layer_config.model_type`; fp32/fp16 weights and `torch_dtype`, which
  vLLM casts to the serving dtype; `t2d`, which vLLM skips; ...). `validate_export_report(dir)` returns
  both lists; `peagle validate` prints warnings and still exits 0.

An export may be untrusted (an upload: `peagle validate --portable`). Nothing is sized from it before its
bounds pass (`peagle.export.bounds`: config.json's size, depth, values and every number the rules size
from; `peagle.export.tensors`: the safetensors header, checked before any tensor data is read), tensor
data is read in bounded chunks, and `portable=True` never reads a host path the export names. The
rules of `model.safetensors` live in `peagle.export.weights`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.errors import ExportInvalidError
from peagle.export.bounds import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    config_bound_problems,
    is_int,
    json_depth,
    load_json,
    refused_values,
)
from peagle.export.weights import check_weights, is_training_only

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
# Flags vLLM's `peagle` updater forwards (and vLLM applies) vs. flags it drops (vLLM serves without them).
_APPLIED_NORM_FLAGS = ("norm_before_residual", "norm_before_fc")
_DROPPED_NORM_FLAGS = ("fc_norm", "norm_output")


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


def read_export_config(path: str | Path) -> dict[str, Any]:
    """`config.json` of an export directory as a dict, read through the bounds of `peagle.export.bounds`
    (at most `MAX_CONFIG_BYTES`, nested at most `MAX_CONFIG_DEPTH` levels, no NaN / Infinity, over-long
    integer or repeated key).

    Raises:
        ExportInvalidError: missing, past a bound (each named by its JSON path) or not a JSON object.
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ExportInvalidError([f"{f}: config.json is missing"])
    try:
        with f.open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)  # never more, whatever the file claims to be
    except OSError as exc:
        raise ExportInvalidError([f"{f}: cannot be read ({exc})"]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ExportInvalidError([f"{f}: is over the limit of {MAX_CONFIG_BYTES} bytes (a draft's config.json "
                                  "is a few KB)"])  # fmt: skip
    at = json_depth(raw, MAX_CONFIG_DEPTH)
    if at is not None:
        raise ExportInvalidError([f"{f}: nested deeper than {MAX_CONFIG_DEPTH} levels at byte {at} (a draft's "
                                  "config nests 4)"])  # fmt: skip
    try:
        data = load_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ExportInvalidError([f"{f}: not valid JSON ({exc})"]) from None
    refused = refused_values(data)
    if refused:
        raise ExportInvalidError([f"{f}: {p}" for p in refused])
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


def _verifier_num_layers(name_or_path: Any) -> int | None:
    """Layer count of a verifier FOLDER on this machine (never called in portable mode: it reads a host
    path the export names)."""
    if not isinstance(name_or_path, str):
        return None
    try:
        n = read_export_config(Path(name_or_path).expanduser()).get("num_hidden_layers")
    except (ExportInvalidError, OSError, RuntimeError):  # RuntimeError: expanduser without a home
        return None
    return n if is_int(n) else None


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
        if not is_int(k) or k < 1:
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
        if not (is_int(layer.get(key)) or (key == "rms_norm_eps" and isinstance(layer.get(key), float))):
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
    if vd is None and is_int(v):
        warn.append(f"config.json: draft_vocab_size is missing (vLLM takes vocab_size {v})")
    elif not is_int(vd) or vd < 1:
        bad.append(
            f"config.json: draft_vocab_size must be an int >= 1, got {vd!r} (vLLM refuses to build lm_head)"
        )
    elif is_int(v) and vd > v:
        bad.append(
            f"config.json: draft_vocab_size ({vd}) must be <= {where}vocab_size ({v}) (vLLM scatters draft "
            "logits into the target vocabulary)"
        )
    mask = cfg.get("mask_token_id", cfg.get("pard_token", cfg.get("ptd_token_id")))
    if mask is not None and (not is_int(mask) or (is_int(v) and not 0 <= mask < v)):
        bad.append(
            f"config.json: mask_token_id must be an int in [0, vocab_size={v}), got {mask!r} (vLLM embeds it in "
            "every parallel-drafting slot)"
        )
    ths, h = cfg.get("target_hidden_size"), layer.get("hidden_size")
    if ths is not None and not (is_int(ths) and ths >= 1):
        bad.append(f"config.json: target_hidden_size must be null or an int >= 1, got {ths!r}")
    elif ths is not None and ths != h:
        warn.append(
            f"config.json: target_hidden_size ({ths}) differs from hidden_size ({h}): vLLM sizes fc and "
            "mask_hidden from it (3 x target_hidden_size), but peagle's reference decoder cannot load this draft"
        )


def _check_aux_ids(cfg: dict[str, Any], r: ExportReport, portable: bool) -> None:
    bad, warn = r.errors, r.warnings
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return
    if not isinstance(ids, list) or len(ids) != 3 or not all(is_int(i) for i in ids):
        bad.append(
            f"config.json: eagle_aux_hidden_state_layer_ids must be 3 ints, got {ids!r} (vLLM feeds fc "
            "3 x hidden_size of captured states)"
        )
        return
    if len(set(ids)) != 3:
        warn.append(
            f"config.json: eagle_aux_hidden_state_layer_ids {ids} repeat a layer (vLLM captures it twice)"
        )
    if portable:
        if verifier_of(cfg) is not None:
            warn.append(
                "config.json: eagle_aux_hidden_state_layer_ids are not checked against the verifier's layer "
                "count (--portable never reads a verifier the export names; `peagle validate` where the "
                "verifier is does)"
            )
        return
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


def validate_export_report(path: str | Path, *, portable: bool = False) -> ExportReport:
    """Errors (vLLM refuses / serves wrongly) and warnings (conventions vLLM does not enforce) of an export.

    Detects the layout from `config.json`: `speculators_config` present = speculators format, else the
    plain EAGLE-3 layout. Any input gives a report (never an exception), in memory bounded by the limits
    of `peagle.export.bounds` / `peagle.export.tensors`, whatever the export's sizes claim.

    Args:
        path: the export directory.
        portable: the export may come from anyone (an upload): read only its own files (no links out of
            it) and no host path it names (the verifier's folder); the checks that need the verifier's
            config are skipped with a warning.
    """
    r = ExportReport()
    _check_export_dir(Path(path), r, portable)
    r.errors, r.warnings = _capped(r.errors), _capped(r.warnings)
    return r


# A real report has a few messages of under 400 characters; a hostile export could ask for one message per
# tensor (16384) or echo a 1 MiB string of its config back, into the API's database.
_MAX_MESSAGES = 100
_MAX_MESSAGE_CHARS = 2000


def _capped(messages: list[str]) -> list[str]:
    out = [m if len(m) <= _MAX_MESSAGE_CHARS else f"{m[:_MAX_MESSAGE_CHARS]}... ({len(m)} characters)"
           for m in messages[:_MAX_MESSAGES]]  # fmt: skip
    if len(messages) > _MAX_MESSAGES:
        out.append(f"... and {len(messages) - _MAX_MESSAGES} more")
    return out


def _check_export_dir(path: Path, r: ExportReport, portable: bool) -> None:
    """`validate_export_report`'s checks, in order; each stage runs only when the one before it leaves
    nothing unbounded."""
    if not path.is_dir():
        r.errors.append(f"{path}: not a directory")
        return
    if portable:
        links = [n for n in ("config.json", "model.safetensors") if (path / n).is_symlink()]
        if links:
            r.errors.extend(f"{n}: is a link (--portable reads only the export's own files)" for n in links)
            return
    try:
        cfg = read_export_config(path)
    except ExportInvalidError as exc:
        r.errors.extend(exc.violations)
        return
    bounds = config_bound_problems(cfg)
    if bounds:  # nothing is sized from a config past its bounds
        r.errors.extend(bounds)
        return
    if "speculators_config" in cfg or "speculators_model_type" in cfg:
        layer = _check_speculators_config(cfg, r)
        where = "transformer_layer_config."
    else:
        layer = _check_eagle3_config(cfg, r)
        where = ""
    if layer is None:
        return
    _check_layer_config(layer, cfg, r, where)
    _check_aux_ids(cfg, r, portable)
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype not in (None, "bfloat16"):
        r.warnings.append(
            f"config.json: torch_dtype is {dtype!r}, not 'bfloat16' (vLLM serves in the target's dtype or --dtype)"
        )
    f = path / "model.safetensors"
    if not f.is_file():
        r.errors.append("model.safetensors is missing")
    else:
        check_weights(f, layer, cfg, r)


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
