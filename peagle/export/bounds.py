"""Bounds on what an export may ask the validator to size, checked before anything is sized from it
(docs/export.md 5.1).

In the upload path (`peagle validate --portable`, run by the API on every uploaded draft) an export is
untrusted input: a `num_hidden_layers` of 10**9 once made the validator build a list of that length until
the OOM killer fired (issue 46). So its JSON (`config.json`, the `model.safetensors` header) is read
through these gates, each refusal naming the JSON path and why:

1. the bytes: at most a size limit, UTF-8, nested at most a depth limit. The depth is scanned on the
   bytes (`json_depth`), because `json.loads` recurses once per level;
2. the values JSON itself has no room for (`load_json`): NaN / Infinity, a number that overflows a float,
   an integer of more than `MAX_INT_DIGITS` digits, a key given twice. They parse to `Refused` markers that
   `refused_values` reports with their paths, with the strings no database can store (a NUL, a lone
   surrogate: `peagle.spec.text`), which the validator's messages would otherwise carry to the API's;
3. `ExportConfigBounds` (`config_bound_problems`): every number of `config.json` the validator sizes a
   tensor, a loop or a list from, with an upper limit that no real draft needs to pass (each field's
   description says why). The export's own rules (`peagle.export.rules`) run only when these pass.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, TypeGuard

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from peagle.spec.text import unstorable_problem

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_INT_DIGITS",
    "ExportConfigBounds",
    "Refused",
    "config_bound_problems",
    "is_int",
    "json_depth",
    "json_path",
    "load_json",
    "refused_values",
]

#: config.json of a real draft is 1-3 KB (a HF config with long `id2label` maps stays under 100 KB).
MAX_CONFIG_BYTES = 1 << 20
#: A real export config nests 4 levels (speculators_config.proposal_methods[0].x); 32 leaves room.
MAX_CONFIG_DEPTH = 32
#: No size, id or count of a real model has more than 20 digits (2**64); longer integers are refused
#: before Python's int() spends quadratic time on them.
MAX_INT_DIGITS = 24

# Limits of ExportConfigBounds, each with the real figures it is far above.
MAX_DRAFT_LAYERS = 256  # a P-EAGLE / EAGLE-3 draft has 1-4 layers (the job spec trains at most 32)
MAX_TARGET_LAYERS = 1024  # deepest real LLMs: 126 (Llama-3.1-405B), 96 (GPT-3 175B)
MAX_HIDDEN = 1 << 16  # widest real LLMs: 18432 (Nemotron-4-340B), 16384 (Llama-3.1-405B)
MAX_INTERMEDIATE = 1 << 18  # widest real MLPs: 73728 (Nemotron-4-340B), 53248 (Llama-3.1-405B)
MAX_HEADS = 1024  # real models: at most 128 attention heads (Llama-3.1-405B, DeepSeek-V3)
MAX_HEAD_DIM = 1024  # real models: 64-256 (Gemma: 256)
MAX_VOCAB = 1 << 20  # largest real vocabularies: 262144 (Gemma 3), 256000 (Gemma 2); the spec's Vd limit
MAX_POSITIONS = 1 << 27  # longest real context: 10485760 (Llama 4 Scout)
MAX_SPECULATIVE_TOKENS = 64  # P-EAGLE serves K of 2-8; the job spec trains at most 32 depths
MAX_LIST_ITEMS = 16  # aux layer ids: exactly 3; speculators writes 1 proposal method and 1 architecture


def is_int(x: Any) -> TypeGuard[int]:
    """A JSON integer: an int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Refused:
    """A JSON value that no export may hold, parsed in its place; `reason` says why."""

    reason: str


def json_depth(data: bytes, limit: int) -> int | None:
    """Offset of the first `[` or `{` nested deeper than `limit` in JSON text, or None.

    Linear in `data` and never recursive: only the bracket, quote and backslash bytes are visited, and
    brackets inside strings do not count.
    """
    depth, in_string, escaped_at = 0, False, -1
    for m in re.finditer(rb'[\[\]{}"\\]', data):
        i, c = m.start(), data[m.start()]
        if i == escaped_at:
            continue
        if in_string:
            if c == 0x5C:  # a backslash: the next byte is escaped
                escaped_at = i + 1
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in b"[{":
            depth += 1
            if depth > limit:
                return i
        else:
            depth -= 1
    return None


def _constant(name: str) -> Refused:
    return Refused(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def _float(text: str) -> float | Refused:
    x = float(text)
    return x if math.isfinite(x) else Refused(f"{text[:24]} overflows a float")


def _int(text: str) -> int | Refused:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return Refused(f"an integer of {len(text.lstrip('-'))} digits (no real size or id has more than 20)")
    return int(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        out[k] = Refused("duplicate key (JSON readers disagree on which value wins)") if k in out else v
    return out


def load_json(text: str) -> Any:
    """`json.loads` with `Refused` markers for NaN / Infinity, overflowing floats, over-long integers and
    repeated keys. Call it only on text whose depth `json_depth` has checked.

    Raises:
        json.JSONDecodeError: not JSON.
    """
    return json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int,
                      object_pairs_hook=_object)  # fmt: skip


def _printable(key: str) -> str:
    return key[:80].encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def json_path(loc: tuple[str | int, ...]) -> str:
    """`a.b[0].c` from a location (keys shortened to 80 characters, NULs and lone surrogates escaped)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{_printable(str(part))}"
    return out or "(root)"


def refused_values(data: Any, limit: int = 20) -> list[str]:
    """`path: reason` of the first `limit` `Refused` markers and unstorable strings (keys too) in parsed
    JSON (depth already bounded)."""

    def walk(x: Any, loc: tuple[str | int, ...]) -> Iterator[str]:
        if isinstance(x, Refused):
            yield f"{json_path(loc)}: {x.reason}"
        elif isinstance(x, str):
            problem = unstorable_problem(x)
            if problem:
                yield f"{json_path(loc)}: {problem}"
        elif isinstance(x, dict):
            for k, v in x.items():
                problem = unstorable_problem(k)
                if problem:
                    yield f"{json_path((*loc, k))}: the key {problem}"
                yield from walk(v, (*loc, k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                yield from walk(v, (*loc, i))

    out: list[str] = []
    for problem in walk(data, ()):
        out.append(problem)
        if len(out) == limit:
            break
    return out


# --------------------------------------------------------------------------------------------------
# The bounded contract of config.json
# --------------------------------------------------------------------------------------------------


def _size(limit: int, why: str) -> Any:
    return Field(default=None, ge=1, le=limit, description=why)


_TOKEN_ID = Field(default=None, ge=0, lt=MAX_VOCAB, description="a token id: below the vocabulary limit")


class _Open(BaseModel):
    # strict: "64", 64.0 and true are not 64; extra keys are the rules' business (or nobody's)
    model_config = ConfigDict(strict=True, extra="ignore")


class LayerBounds(_Open):
    """Sizes of a Llama-style draft layer config (`transformer_layer_config`, or the top level in the
    plain EAGLE-3 layout)."""

    num_hidden_layers: int | None = _size(
        MAX_DRAFT_LAYERS, "a draft has 1-4 layers; peagle trains at most 32"
    )
    hidden_size: int | None = _size(MAX_HIDDEN, "the widest real LLM has 18432")
    intermediate_size: int | None = _size(MAX_INTERMEDIATE, "the widest real MLP has 73728")
    num_attention_heads: int | None = _size(MAX_HEADS, "real models have at most 128 heads")
    num_key_value_heads: int | None = _size(MAX_HEADS, "real models have at most 128 heads")
    head_dim: int | None = _size(MAX_HEAD_DIM, "real models use 64-256")
    vocab_size: int | None = _size(MAX_VOCAB, "the largest real vocabulary has 262144 tokens")
    max_position_embeddings: int | None = _size(MAX_POSITIONS, "the longest real context is 10485760 tokens")
    rms_norm_eps: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False,
                                       description="real models use 1e-6 to 1e-5")  # fmt: skip


class MethodBounds(_Open):
    """One of `speculators_config.proposal_methods`."""

    speculative_tokens: int | None = _size(MAX_SPECULATIVE_TOKENS, "P-EAGLE serves K of 2-8")


class SpeculatorsBounds(_Open):
    """`speculators_config`."""

    proposal_methods: list[MethodBounds] | None = Field(
        default=None, max_length=MAX_LIST_ITEMS, description="speculators writes 1 proposal method"
    )


class ExportConfigBounds(LayerBounds):
    """Every number of an export's `config.json` the validator sizes something from (both layouts).

    Containers of the wrong type (a list for `transformer_layer_config` ...) pass here: the export's
    rules refuse them with vLLM's consequence, and a non-object has no sizes to bound.
    """

    transformer_layer_config: LayerBounds | None = None
    speculators_config: SpeculatorsBounds | None = None
    draft_vocab_size: int | None = _size(MAX_VOCAB, "the largest real vocabulary has 262144 tokens")
    target_hidden_size: int | None = _size(MAX_HIDDEN, "the widest real LLM has 18432")
    num_depths: int | None = _size(MAX_SPECULATIVE_TOKENS, "P-EAGLE serves K of 2-8")
    mask_token_id: int | None = _TOKEN_ID
    pard_token: int | None = _TOKEN_ID
    ptd_token_id: int | None = _TOKEN_ID
    eagle_aux_hidden_state_layer_ids: (
        list[Annotated[int, Field(ge=0, lt=MAX_TARGET_LAYERS)]] | None
    ) = Field(default=None, max_length=MAX_LIST_ITEMS,
              description="3 target layer ids; the deepest real LLM has 126 layers")  # fmt: skip
    architectures: list[Any] | None = Field(
        default=None, max_length=MAX_LIST_ITEMS, description="a config names 1 architecture"
    )


# pydantic error types on a container of the wrong type: left to the rules (see ExportConfigBounds)
_LEFT_TO_RULES = {"model_type", "model_attributes_type", "dict_type", "list_type"}
_WHY = {name: f.description for m in (ExportConfigBounds, MethodBounds, SpeculatorsBounds)
        for name, f in m.model_fields.items() if f.description}  # fmt: skip
_WHY["eagle_aux_hidden_state_layer_ids"] = "the deepest real LLM has 126 layers"


def _short(x: Any) -> str:
    if isinstance(x, list):
        return f"a list of {len(x)} items"
    if isinstance(x, dict):
        return f"an object of {len(x)} keys"
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _message(err: Any) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    ops = {"less_than_equal": "<=", "less_than": "<", "greater_than_equal": ">=", "greater_than": ">"}
    if kind in ops:
        what = f"must be {ops[kind]} {next(iter(ctx.values()))}"
    elif kind in ("int_type", "int_from_float"):
        what = "must be an integer"
    elif kind == "float_type":
        what = "must be a number"
    elif kind == "finite_number":
        what = "must be finite"
    elif kind == "too_long":
        what = f"must hold at most {ctx.get('max_length')} items"
    else:
        what = str(err["msg"])
    names = [p for p in err["loc"] if isinstance(p, str)]
    why = _WHY.get(names[-1]) if names else None
    return f"{what}, got {_short(err['input'])}" + (f" ({why})" if why else "")


def config_bound_problems(cfg: dict[str, Any]) -> list[str]:
    """`config.json: <path>: <reason>` for every number past `ExportConfigBounds` (empty = bounded)."""
    try:
        ExportConfigBounds.model_validate(cfg)
    except ValidationError as exc:
        return [f"config.json: {json_path(tuple(e['loc']))}: {_message(e)}"
                for e in exc.errors(include_url=False) if e["type"] not in _LEFT_TO_RULES]  # fmt: skip
    return []
