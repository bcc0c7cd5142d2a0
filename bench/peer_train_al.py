"""Peer draft for bench_al: speculators 0.9.0's own `PEagleDraftModel` + loss, trained like a peagle run.

Runs in `.peer-venv` (speculators installed with --no-deps next to the CPU torch; `bash bench/peer_env.sh`)
and imports peagle from this checkout only for the DATA side, so both drafts see the same features:

  * the run's prepared rows (RUN/data, reloaded by spec hash), its draft vocab, mask token and aux ids;
  * the same batches: the run's feature shards (RUN/data/features/train, e.g. captured by vLLM, aux in bf16,
    upcast to fp32 here as our draft upcasts them) read by the trainer's own `OfflineFeatureSource` (same row
    order per seed, same shift of docs/decisions.md decision 1, same target logits restricted to the draft
    vocab); an online run (no shards) captures the same rows in-process (`build_batch_source`);
  * the same optimizer settings (AdamW lr/betas/wd, schedule, warmup, grad clip), steps and seed;
  * the same training positions: the loss mask, or every in-document slot when the run trains all of them
    (`peagle.loss_positions` all), passed as the peer's `loss_mask`;
  * embeddings and lm_head rows initialised from the target, as both implementations do.

The peer computes its own COD sampling, mask, forward and KL loss (`loss_config` kl_div, eager). The
captured target logits are fed through `verifier_last_hidden_states` with `verifier_norm` and
`verifier_lm_head` replaced by identities, so its training targets are exactly ours. After training the
weights (same tensor names as ours) go through peagle's exporter (validated) to `--out`.

    .peer-venv/bin/python bench/peer_train_al.py --run RUN --out EXPORT_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402


def _complete(shards: Path) -> bool:
    """True when `shards` holds a finished feature capture (its manifest says complete)."""
    try:
        return bool(json.loads((shards / "manifest.json").read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log", type=Path, default=None)
    ap.add_argument("--stop-at", type=int, default=None, help="stop after this step (same LR schedule as the run)")
    args = ap.parse_args()

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import PEagleDraftModel
    from speculators.models.peagle.config import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from peagle.data.packing import PackedRows, next_in_document
    from peagle.data.prepare import PreparedData
    from peagle.data.vocab import load_vocab
    from peagle.export.writer import export_draft, layer_config_from_draft
    from peagle.model.draft import PEagleDraft
    from peagle.pipeline import build_initial_draft, verifier_name
    from peagle.spec import parse_spec
    from peagle.target.capture import TargetCapture
    from peagle.target.loader import load_target
    from peagle.target.sources import OfflineFeatureSource, build_batch_source
    from peagle.train.optim import build_optimizer, build_scheduler, total_steps

    spec = parse_spec(json.loads((args.run / "resolved_spec.json").read_text()))
    model, _, path = load_target(spec, torch.device("cpu"))
    blob = torch.load(args.run / "data" / "prepared.pt", weights_only=True)  # the run's cached rows
    prepared = PreparedData(
        PackedRows(*blob["train"]), PackedRows(*blob["eval"]), load_vocab(args.run / "data" / "vocab.safetensors"),
        int(blob["mask_token_id"]), {}, args.run / "data",
    )  # fmt: skip
    vocab = prepared.vocab
    aux_ids = list(spec.draft.aux_layer_ids)
    shards = args.run / "data" / "features" / "train"
    if _complete(shards):  # the run's own feature shards (captured by vLLM or in-process): exactly its batches
        source: Any = OfflineFeatureSource(shards, spec.optim.micro_batch_size, spec.optim.seed)
    else:  # an online run: capture the same rows in-process
        capture = TargetCapture(model, aux_ids, None if vocab.is_full else vocab.selected)
        source = build_batch_source(spec, capture, prepared.train, args.run / "peer_unused")
    steps = total_steps(spec.optim, source.num_batches())

    # Our step-0 draft gives the shared initial embedding / lm_head rows and the layer config.
    ours = build_initial_draft(spec, model, vocab, int(prepared.mask_token_id), aux_ids, source)
    layer_cfg = LlamaConfig(**layer_config_from_draft(ours))
    layer_cfg._attn_implementation = "sdpa"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer_cfg,
        draft_vocab_size=vocab.draft_vocab_size,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=aux_ids,
        mask_token_id=int(prepared.mask_token_id),
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=spec.peagle.num_depths)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=list(model.config.architectures)),
        ),
    )
    torch.manual_seed(spec.optim.seed)
    peer = PEagleDraftModel(config)
    if vocab.t2d is not None:
        peer.load_vocab_mappings(vocab.t2d, vocab.d2t)
    with torch.no_grad():
        peer.embed_tokens.weight.copy_(ours.embed_tokens.weight)
        peer.lm_head.weight.copy_(ours.lm_head.weight)
    peer.verifier_norm = torch.nn.Identity()  # targets = the captured draft-vocab logits, unchanged
    peer.verifier_lm_head = torch.nn.Identity()
    peer.train()
    loss_config = resolve_loss_config("kl_div", "eager")
    # the peer's own recipe: one learning rate for every parameter (its layers start random)
    optimizer = build_optimizer(peer, spec.optim.model_copy(update={"layer_lr_scale": 1.0}))
    scheduler = build_scheduler(optimizer, spec.optim, steps)
    params = [p for p in peer.parameters() if p.requires_grad]
    p = spec.peagle
    log = args.log.open("w") if args.log else sys.stdout
    nb = source.num_batches()
    for step in range(min(steps, args.stop_at or steps)):
        t0 = time.perf_counter()
        epoch, index = divmod(step, nb)
        batch = source.batch(epoch, index)
        b = 0  # micro_batch_size 1 (the demo preset); one packed row per step
        loss_mask = batch["loss_mask"][b : b + 1]
        if p.loss_positions == "all":  # the run's own training positions (docs/decisions.md decision 20)
            loss_mask = next_in_document(batch["document_ids"][b : b + 1]).to(loss_mask.dtype)
        # features as stored (bf16 from a bf16 target) upcast to the peer's fp32, as our draft upcasts them
        _, loss, _metrics = peer(
            hidden_states=batch["aux"][b : b + 1].float(),
            input_ids=batch["input_ids"][b : b + 1],
            document_ids=batch["document_ids"][b : b + 1],
            loss_mask=loss_mask,
            verifier_last_hidden_states=batch["target_logits"][b : b + 1].float(),
            loss_config=loss_config,
            max_anchors=p.max_anchors,
            num_depths=p.num_depths,
            down_sample_ratio=p.down_sample_ratio,
            down_sample_ratio_min=p.down_sample_ratio_min,
        )
        loss.backward()
        clip = spec.optim.grad_clip
        torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        rec = {"step": step + 1, "total": steps, "loss": float(loss.detach()), "seconds": round(time.perf_counter() - t0, 2)}
        log.write(json.dumps(rec) + "\n")
        log.flush()

    state = {k: v for k, v in peer.state_dict().items() if not k.startswith("verifier_")}
    draft = PEagleDraft(ours.config)
    draft.load_state_dict(state, strict=True)
    export_draft(
        draft,
        args.out,
        num_speculative_tokens=p.num_depths,
        verifier_name_or_path=verifier_name(spec, path),
        verifier_architectures=list(model.config.architectures),
    )
    print(json.dumps({"export": str(args.out), "steps": min(steps, args.stop_at or steps), "schedule_steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
