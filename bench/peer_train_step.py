"""Peer side of bench_train_step: speculators 0.9.0 `PEagleDraftModel`, run in `.peer-venv`.

    .peer-venv/bin/python bench/peer_train_step.py DATA.pt --warmup 2 --steps 5 --threads 2

DATA.pt holds the shifted row (`input_ids`, `loss_mask`, `document_ids` [1, T]), the SmolLM2 layer
config dict, `draft_vocab_size`, `num_depths`, r, r_min and `mask_token_id`. The model is built with
`draft_attn_impl="sdpa"` and the eager KL; the verifier lm_head / norm and the draft lm_head and
embeddings get random weights (speculators starts them as NaN and would load them from the verifier).
One step = forward (COD, mask, layers, loss) + backward + grad clip + AdamW step, the speculators
trainer's step. Prints one JSON line: {"step_seconds": [...], "step_cpu_seconds": [...] (process CPU
time), "supervised_elements": [...], "trainable_params": n}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.peagle import PEagleDraftModel
from speculators.models.peagle.config import PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = torch.load(args.data, weights_only=False)
    layer_cfg = LlamaConfig(**data["layer_config"])
    layer_cfg._attn_implementation = "sdpa"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer_cfg,
        draft_vocab_size=data["draft_vocab_size"],
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=data["aux_layer_ids"],
        mask_token_id=data["mask_token_id"],
        speculators_config=SpeculatorsConfig(
            algorithm="peagle",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=data["num_depths"])],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    torch.manual_seed(0)
    model = PEagleDraftModel(config)
    t2d = data["t2d"]
    d2t = torch.nonzero(t2d).flatten() - torch.arange(int(t2d.sum()))
    model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():  # random stand-ins for the weights speculators loads from the verifier
        for p in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
            p.normal_(0.0, 0.02)
    model.train()
    h = layer_cfg.hidden_size
    t = data["input_ids"].shape[1]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, t, 3 * h, generator=g)
    verifier_last = torch.randn(1, t, h, generator=g)
    loss_config = resolve_loss_config("kl_div", "eager")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    times, cpu_times, flat = [], [], []
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss, metrics = model(
            hidden_states=hidden,
            input_ids=data["input_ids"],
            document_ids=data["document_ids"],
            loss_mask=data["loss_mask"],
            verifier_last_hidden_states=verifier_last,
            loss_config=loss_config,
            num_depths=data["num_depths"],
            down_sample_ratio=data["r"],
            down_sample_ratio_min=data["r_min"],
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            flat.append(int(sum(float(metrics[f"position_{d}_acc_total"]) for d in range(data["num_depths"]))))
    print(json.dumps({"step_seconds": times, "step_cpu_seconds": cpu_times, "supervised_elements": flat,
                      "trainable_params": sum(p.numel() for p in params)}))


if __name__ == "__main__":
    main()
