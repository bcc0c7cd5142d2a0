"""Rules of an export's `model.safetensors` against its (bounded) config (docs/export.md 3, 5.1, 6).

`check_weights` reads the header first (`peagle.export.tensors`: nothing of the data before it passes),
then checks names, dtypes and shapes against the config, then the data: `d2t` / `t2d` whole (their
sizes are bounded by the vocabulary limit), every float tensor in chunks. Errors and warnings go to the
`ExportReport` of `peagle.export.rules`, with the same two severities.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from peagle.export.bounds import is_int
from peagle.export.tensors import all_finite, read_safetensors, read_tensor

if TYPE_CHECKING:
    from peagle.export.rules import ExportReport

__all__ = ["check_weights", "is_training_only"]

# Keys of the draft's state dict that exist only for training (never exported).
_TRAINING_ONLY_PREFIXES = ("verifier_norm.", "verifier_lm_head.", "verifier.")
_TRAINING_ONLY_SUBSTRINGS = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
_INT_DTYPES = ("I64", "I32", "I16", "I8", "U8")


def is_training_only(key: str) -> bool:
    """True for state-dict keys that exist only for training (verifier head/norm, rotary buffers)."""
    return key.startswith(_TRAINING_ONLY_PREFIXES) or any(s in key for s in _TRAINING_ONLY_SUBSTRINGS)


def _listed(names: list[Any], most: int = 8) -> str:
    """`names` for a message: the first `most`, then how many more."""
    more = len(names) - most
    return f"{names[:most]}" + (f" and {more} more" if more > 0 else "")


def check_weights(f: Path, layer: dict[str, Any], cfg: dict[str, Any], r: ExportReport) -> None:
    """Weights against the (bounded) config: the header first (`peagle.export.tensors`), then shapes and
    dtypes, then the data: d2t / t2d whole (their sizes are bounded by the vocabulary limits), every float
    tensor in chunks."""
    bad, warn = r.errors, r.warnings
    sf, problems = read_safetensors(f)
    if sf is None:
        bad.extend(problems)
        return
    keys = list(sf.tensors)
    raw = {k.removeprefix("model."): k for k in keys}
    shapes = {k.removeprefix("model."): list(t.shape) for k, t in sf.tensors.items()}
    dtypes = {k.removeprefix("model."): t.dtype for k, t in sf.tensors.items()}
    prefixed = [k for k in keys if k.startswith("model.")]
    if prefixed:
        bad.append(
            f"model.safetensors: {len(prefixed)} tensor names start with 'model.' (e.g. {prefixed[0]!r}); "
            "vLLM adds the prefix itself and would look for 'model.model.*' (it refuses to load)"
        )
    keys = [k.removeprefix("model.") for k in keys]
    training = [k for k in keys if is_training_only(k)]
    if training:
        bad.append(
            f"model.safetensors: training-only tensors must not be exported: {_listed(sorted(training))} (vLLM "
            "has no such parameter and refuses to load)"
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
    if not (is_int(h) and is_int(n_layers) and is_int(v) and is_int(vd) and is_int(t)):
        return  # the config errors already say why
    _check_shapes(keys, shapes, h, t, n_layers, v, vd, cfg, r)
    try:
        _check_vocab_mapping(lambda name: read_tensor(sf, raw[name]), keys, shapes, dtypes, v, vd, r)
        floats = [raw[k] for k in keys if dtypes[k] in _FLOAT_DTYPES]
        nonfinite = set(all_finite(sf, floats))
    except OSError as exc:
        bad.append(f"model.safetensors: cannot be read ({exc})")
        return
    for k in keys:
        if raw[k] in nonfinite:
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
    # ASCII digits only: str.isdigit() takes '²', which int() refuses; names are at most 512 characters
    layer_ids = sorted({int(m[1]) for k in keys if (m := re.match(r"layers\.([0-9]+)(\.|$)", k))})
    # sized from the weights (at most 16384 tensors), never from n_layers alone
    if len(layer_ids) != n_layers or layer_ids != list(range(n_layers)):
        bad.append(
            f"config.json: transformer_layer_config.num_hidden_layers is {n_layers} but the weights hold "
            f"{len(layer_ids)} layers {_listed(layer_ids, 16)} (vLLM refuses extra layers and leaves missing "
            "ones uninitialised)"
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
