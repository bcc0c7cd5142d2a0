"""The untrained draft of a run: built fresh from the target (`build_initial_draft`), or from the weights of a
warm start (`warm_start`, `draft.init_from`). Shared by the pipeline and its preview (`peagle.preview`);
`peagle.pipeline` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peagle.spec import TrainSpec

__all__ = ["MASK_HIDDEN_BATCHES", "WarmStart", "build_initial_draft", "warm_start"]


#: Micro-batches (the first of epoch 0, the same on every DDP rank) whose features give `mask_hidden`'s start
#: under `draft.mask_hidden_init: feature_mean`.
MASK_HIDDEN_BATCHES = 8


def build_initial_draft(spec: TrainSpec, model: Any, vocab: Any, mask_token_id: int, aux_ids: list[int],
                        source: Any = None, *, from_checkpoint: bool = False,
                        init_weights: dict[str, torch.Tensor] | None = None) -> Any:
    """The untrained draft of a run (seeded by `optim.seed`, embeddings/lm_head rows from the target, the
    decoder layers / fc / final norm too when `draft.layer_init == "target"`, `mask_hidden` from the
    features of the first micro-batches when `draft.mask_hidden_init == "feature_mean"`).

    Args:
        spec: the job spec (`draft.num_layers`, `draft.layer_init`, `draft.mask_hidden_init`, `optim.seed`).
        model: the loaded target.
        vocab: the run's `DraftVocab` (`selected`, `t2d`).
        mask_token_id: the resolved mask token.
        aux_ids: the resolved aux layer ids.
        source: the run's training batch source (`num_batches()`, `batch(epoch, index)` with "aux" [B, N, 3H]
            and "document_ids" [B, N]); needed only for `feature_mean`.
        from_checkpoint: the run resumes from a checkpoint, which replaces every weight: `feature_mean` reads
            nothing and `mask_hidden` keeps its random start.
        init_weights: a warm start's tensors (`WarmStart.state`, the export's names): they replace every
            weight of the built draft; `feature_mean` reads nothing.

    Raises:
        ValueError: `feature_mean` without a source.
    """
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import (
        feature_mean,
        init_from_target,
        init_layers_from_target,
        init_mask_hidden,
    )

    torch.manual_seed(spec.optim.seed)
    cfg = DraftConfig.from_target(
        model.config,
        num_layers=spec.draft.num_layers,
        draft_vocab_size=vocab.draft_vocab_size,
        mask_token_id=mask_token_id,
        aux_layer_ids=aux_ids,
    )
    draft = PEagleDraft(cfg)
    init_from_target(draft, model, vocab.t2d)
    if spec.draft.layer_init == "target":
        init_layers_from_target(draft, model)
    if init_weights is not None:
        from peagle.train.checkpoint import load_init_weights

        load_init_weights(draft, init_weights, source=str(spec.draft.init_from))
    elif spec.draft.mask_hidden_init == "feature_mean" and not from_checkpoint:
        if source is None:
            raise ValueError("draft.mask_hidden_init feature_mean needs the run's batch source")
        first = (source.batch(0, i) for i in range(min(MASK_HIDDEN_BATCHES, source.num_batches())))
        init_mask_hidden(draft, feature_mean((b["aux"], b["document_ids"]) for b in first))
    return draft


@dataclass
class WarmStart:
    """The source of a warm start (`draft.init_from`): its export folder, tensors, vocabulary, mask token."""

    export_dir: Path
    state: dict[str, torch.Tensor]
    vocab: Any  # DraftVocab
    mask_token_id: int
    provenance: dict[str, Any]


def warm_start(spec: TrainSpec, target_config: dict[str, Any], vocab_size: int, *,
               source: Path | None = None) -> WarmStart:
    """Read and check the source `spec.draft.init_from` names (a folder here: the service resolves
    `job:`/`draft:` to one before the trainer starts, `worker.supervisor`).

    Args:
        spec: the job spec (`draft.init_from` set).
        target_config: the target's config as a dict (hidden size, vocabulary, layers).
        vocab_size: V, rows of the target's embedding.
        source: a checkpoint folder to read instead (a resumed run's own, which holds the parent's
            vocabulary and mask token).

    Raises:
        SpecInvalidError: (field `draft.init_from`) the source's draft does not fit this job.
        CheckpointError / ExportInvalidError: the source is missing or not a valid export.
    """
    from peagle.data.vocab import DraftVocab
    from peagle.spec import SpecInvalidError, SpecProblem
    from peagle.spec.init_from import init_from_problems, parse_init_from
    from peagle.train.checkpoint import init_source_dir, read_init_weights

    value = str(spec.draft.init_from)
    ref = parse_init_from(value)
    if source is None and ref.kind != "path":
        raise SpecInvalidError([SpecProblem(loc=("draft", "init_from"), message=(
            f"{value!r} names a source of the service (it resolves it before training); here give an export "
            "folder, a checkpoint folder or a run directory"))])
    export_dir = source if source is not None else init_source_dir(ref.ref)
    cfg, state = read_init_weights(export_dir)
    problems = init_from_problems(cfg, spec, target_config, source=f"the draft in {export_dir}")
    d2t, t2d = state.get("d2t"), state.get("t2d")
    vd = int(state["lm_head.weight"].shape[0]) if "lm_head.weight" in state else 0
    if d2t is None and vd != vocab_size:
        problems.append(f"the draft in {export_dir} has {vd} vocabulary rows and no d2t mapping; the target has "
                        f"{vocab_size} tokens")
    if problems:
        raise SpecInvalidError([SpecProblem(loc=("draft", "init_from"), message=m) for m in problems])
    if d2t is None:
        vocab = DraftVocab(torch.arange(vocab_size, dtype=torch.long), vocab_size, None, None)
    else:
        selected = d2t.to(torch.long) + torch.arange(vd, dtype=torch.long)  # [Vd] target ids, ascending
        if t2d is None:
            t2d = torch.zeros(vocab_size, dtype=torch.bool)
            t2d[selected] = True
        vocab = DraftVocab(selected, vocab_size, d2t.to(torch.long), t2d.to(torch.bool))
    mask = int(cfg.get("mask_token_id", cfg.get("pard_token", 0)))
    meta = export_dir / "meta.json"
    step = None
    if meta.is_file():
        import json

        try:
            step = json.loads(meta.read_text(encoding="utf-8")).get("step")
        except (OSError, ValueError):
            step = None
    prov = {"init_from": value, "export_dir": str(export_dir), "step": step, "draft_vocab_size": vd,
            "mask_token_id": mask, "resumed": source is not None}
    return WarmStart(export_dir, state, vocab, mask, prov)
