"""Warm start (`draft.init_from`): what the value names, and whether its weights can continue in a job.

Three kinds of source, one string:

| value                    | the source                                                            |
|--------------------------|-----------------------------------------------------------------------|
| `job:<id>`               | the owner's earlier job, its best checkpoint                          |
| `job:<id>@step_<N>`      | the same job's checkpoint of step N                                   |
| `draft:<upload id>`      | an uploaded draft (a speculators-format export)                       |
| a folder (CLI only)      | a local export folder, a checkpoint folder, or a run directory (best) |

Every kind ends up as an export folder (`config.json` + `model.safetensors`, docs/export.md); its
`config.json` alone says whether the weights fit the new job. `init_from_problems` compares it with the
job's spec and its target's config, torch-free, so the API answers before queueing and the trainer
before training, with the same messages. What must agree: the hidden size and vocabulary of the target,
the draft's layer count, the aux layer ids, the draft vocabulary size and (set explicitly) the mask token.
The draft vocabulary MAPPING (which target token each draft row is) comes from the source: a warm-started
job takes its parent's vocabulary instead of counting its own data's tokens. K (`peagle.num_depths`) may
differ: no weight of a P-EAGLE draft depends on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from peagle.run_folder import JOB_PREFIX, parse_job_ref
from peagle.spec.resolve import aux_layer_ids

if TYPE_CHECKING:
    from peagle.spec.schema import TrainSpec

__all__ = [
    "DRAFT_PREFIX",
    "InitFrom",
    "init_from_problems",
    "parse_init_from",
    "source_facts",
]

DRAFT_PREFIX = "draft:"
_ID = r"[A-Za-z0-9_]{1,64}"
_DRAFT = re.compile(rf"draft:(?P<id>{_ID})")


@dataclass(frozen=True)
class InitFrom:
    """A parsed `draft.init_from`: `kind` job / draft / path, `ref` (the id or the folder), `step` (job only)."""

    kind: Literal["job", "draft", "path"]
    ref: str
    step: int | None = None

    @property
    def parent(self) -> dict[str, Any]:
        """What the API shows as the job's parent: `{"job": id, "step": N | None}` or `{"draft": id}`."""
        if self.kind == "job":
            return {"job": self.ref, "step": self.step}
        return {self.kind: self.ref}


def parse_init_from(value: str) -> InitFrom:
    """The source `value` names (module docstring).

    Raises:
        ValueError: a `job:`/`draft:` value of the wrong shape (the message says the right one).
    """
    if value.startswith(JOB_PREFIX):
        job = parse_job_ref(value)  # the form is the run folder's (`peagle.run_folder.job_ref`)
        if job is None:
            raise ValueError(f"{value!r}: write job:<id> (its best checkpoint) or job:<id>@step_<N>")
        return InitFrom("job", *job)
    if value.startswith(DRAFT_PREFIX):
        m = _DRAFT.fullmatch(value)
        if m is None:
            raise ValueError(f"{value!r}: write draft:<upload id>")
        return InitFrom("draft", m["id"])
    if value.startswith("builtin:") or not value.strip():
        raise ValueError(f"{value!r}: job:<id>, job:<id>@step_<N>, draft:<upload id> or an export folder")
    return InitFrom("path", value)


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def source_facts(cfg: dict[str, Any]) -> dict[str, Any]:
    """What an export's `config.json` says about its draft (either layout; None where it says nothing):
    hidden_size, vocab_size (the target's), num_layers, aux_layer_ids, draft_vocab_size, mask_token_id."""
    layer = cfg.get("transformer_layer_config")
    layer = layer if isinstance(layer, dict) else cfg
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    return {
        "hidden_size": _int(layer.get("hidden_size")),
        "vocab_size": _int(layer.get("vocab_size")),
        "num_layers": _int(layer.get("num_hidden_layers")),
        "aux_layer_ids": [int(i) for i in aux] if isinstance(aux, list) and all(_int(i) is not None for i in aux)
        else None,
        "draft_vocab_size": _int(cfg.get("draft_vocab_size")),
        "mask_token_id": _int(cfg.get("mask_token_id", cfg.get("pard_token"))),
    }


def init_from_problems(cfg: dict[str, Any], spec: TrainSpec, target_config: dict[str, Any] | None, *,
                       source: str) -> list[str]:
    """Why the export whose `config.json` is `cfg` cannot start `spec`'s draft (empty = it can).

    Args:
        cfg: the source's export config.
        spec: the new job's spec.
        target_config: the new job's target `config.json` (None: the checks that need it are left to the
            trainer, which has the target).
        source: how messages name the source, e.g. "job job_01...'s draft".

    Each message names the spec field that disagrees with the source and both values.
    """
    facts = source_facts(cfg)
    out: list[str] = []
    missing = [k for k in ("hidden_size", "vocab_size", "num_layers", "draft_vocab_size") if facts[k] is None]
    if missing:
        return [f"{source} has no {', '.join(missing)} in its config.json (not a P-EAGLE export)"]
    target = target_config or {}
    # a multimodal target keeps its language model's config under text_config
    nested = target.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else target
    hidden, vocab, n_layers = (_int(text.get(k)) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if hidden is not None and facts["hidden_size"] != hidden:
        out.append(f"hidden size {facts['hidden_size']} of {source} differs from the target's {hidden}")
    if vocab is not None and facts["vocab_size"] != vocab:
        out.append(f"vocabulary of {facts['vocab_size']} tokens of {source} differs from the target's {vocab}")
    if facts["num_layers"] != spec.draft.num_layers:
        out.append(f"{source} has {facts['num_layers']} decoder layers, draft.num_layers is "
                   f"{spec.draft.num_layers} (set draft.num_layers: {facts['num_layers']})")
    if facts["aux_layer_ids"] is not None:
        wanted: list[int] | None = None
        if spec.draft.aux_layer_ids != "auto":
            wanted = list(spec.draft.aux_layer_ids)
        elif n_layers is not None:
            try:
                wanted = aux_layer_ids("auto", n_layers)
            except ValueError:
                wanted = None
        if wanted is not None and wanted != facts["aux_layer_ids"]:
            out.append(f"aux layer ids {facts['aux_layer_ids']} of {source} differ from this job's {wanted} "
                       f"(set draft.aux_layer_ids: {facts['aux_layer_ids']})")
    vd = spec.draft.draft_vocab_size
    if vd is not None and vd != facts["draft_vocab_size"]:
        out.append(f"draft vocabulary of {facts['draft_vocab_size']} tokens of {source} differs from "
                   f"draft.draft_vocab_size {vd} (leave it unset: a warm start takes its parent's vocabulary)")
    mask = spec.draft.mask_token_id
    if mask != "auto" and facts["mask_token_id"] is not None and mask != facts["mask_token_id"]:
        out.append(f"mask token {facts['mask_token_id']} of {source} differs from draft.mask_token_id {mask} "
                   "(leave it auto: a warm start takes its parent's mask token)")
    return out
