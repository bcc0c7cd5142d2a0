"""Builders shared by the trainer tests and their subprocess scripts (tiny target/draft/spec/batches)."""

from __future__ import annotations

from typing import Any

import torch

from peagle.builtin import build_tiny_llama
from peagle.model.draft import DraftConfig, PEagleDraft
from peagle.model.initialization import init_from_target
from peagle.spec import TrainSpec, parse_spec
from peagle.train.batch import SyntheticBatchSource

V, VD, H = 256, 64, 32


def tiny_draft(num_layers: int = 2, seed: int = 0) -> PEagleDraft:
    """A 2-layer draft (H=32, 4 heads / 2 KV heads, V=256, Vd=64) initialised from a tiny target."""
    target = build_tiny_llama(vocab_size=V, hidden_size=H, num_heads=4, num_kv_heads=2, num_layers=2, seed=seed)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[::4] = True
    cfg = DraftConfig.from_target(
        target.config, num_layers=num_layers, draft_vocab_size=VD, mask_token_id=3, aux_layer_ids=[0, 1, 1]
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = PEagleDraft(cfg)
    init_from_target(draft, target, t2d)
    return draft


def tiny_spec(**sections: dict[str, Any]) -> TrainSpec:
    """A CPU spec with small knobs; `sections` update the dict sections (e.g. optim={"lr": 1e-2})."""
    data: dict[str, Any] = {
        "target": {"model": "builtin:tiny-llama"},
        "data": {"sources": [{"path": "builtin:sharegpt"}], "max_length": 32},
        "draft": {"num_layers": 2, "draft_vocab_size": VD},
        "peagle": {"num_depths": 4, "down_sample_ratio": 0.8, "down_sample_ratio_min": 0.3},
        "optim": {"lr": 1e-3, "epochs": 1, "pack_length": 32, "schedule": "cosine", "warmup_ratio": 0.1,
                  "micro_batch_size": 2},
        "checkpoints": {"every_steps": 2, "keep_last": 2, "select_best_by": "tau_sim"},
        "eval": {"prompt_sets": []},
        "resources": {"device": "cpu"},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return parse_spec(data)


def tiny_source(
    num_batches: int = 4, batch_size: int = 2, seq_len: int = 32, seed: int = 0, learnable: bool = False
) -> SyntheticBatchSource:
    return SyntheticBatchSource(
        num_batches=num_batches, batch_size=batch_size, seq_len=seq_len, hidden_size=H, vocab_size=V,
        draft_vocab_size=VD, seed=seed, num_docs=2, pad=3, learnable=learnable,
    )
