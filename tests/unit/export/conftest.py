"""Export fixtures: a tiny random target and an initialised draft (Vd < V), exported to tmp dirs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

V, H, VD, LAYERS, N_TARGET = 512, 64, 128, 2, 8


@pytest.fixture(scope="module")
def tiny_target():
    from peagle.builtin import build_tiny_llama

    return build_tiny_llama(vocab_size=V, hidden_size=H, num_layers=N_TARGET, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def verifier_dir(tiny_target, tmp_path_factory) -> Path:
    """A folder holding the tiny target's config.json (what the export names as verifier)."""
    d = tmp_path_factory.mktemp("verifier")
    (d / "config.json").write_text(json.dumps(tiny_target.config.to_dict()))
    return d


@pytest.fixture(scope="module")
def tiny_draft(tiny_target):
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target

    cfg = DraftConfig.from_target(
        tiny_target.config, num_layers=LAYERS, draft_vocab_size=VD, mask_token_id=V - 1,
        aux_layer_ids=[2, N_TARGET // 2, N_TARGET - 3],
    )  # fmt: skip
    torch.manual_seed(0)
    draft = PEagleDraft(cfg)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V - 1, generator=torch.Generator().manual_seed(1))[:VD]] = True
    init_from_target(draft, tiny_target, t2d)
    return draft.eval()


@pytest.fixture
def export_dir(tiny_draft, tiny_target, verifier_dir, tmp_path) -> Path:
    from peagle.export.writer import export_draft

    return export_draft(
        tiny_draft, tmp_path / "export", num_speculative_tokens=3, verifier_name_or_path=str(verifier_dir),
        verifier_architectures=["LlamaForCausalLM"],
    )  # fmt: skip
