"""Shared set-up of the slow vLLM tests here: SmolLM2 as the target and a 1-layer draft of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def smollm2_and_draft(smollm2_path: Path, *, copy_layers: bool) -> tuple[Any, Any]:
    """(SmolLM2 in fp32, a 1-layer draft of it: Vd = 4096, K-independent, embeddings/head from the target,
    its decoder layer too when `copy_layers`); skips when the vLLM venv is missing."""
    from transformers import AutoModelForCausalLM

    from peagle.eval.serve_check import vllm_python
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target, init_layers_from_target

    if vllm_python() is None:
        # a built venv that is not found is a bug (it hid a wrong repo root once): never a skip
        assert not (REPO / ".vllm-venv" / "bin" / "python").exists(), "vllm_python() misses .vllm-venv"
        pytest.skip("vLLM venv missing: run `make vllm-env` (builds .vllm-venv)")
    target = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    n = target.config.num_hidden_layers
    cfg = DraftConfig.from_target(target.config, num_layers=1, draft_vocab_size=4096, mask_token_id=49151,
                                  aux_layer_ids=[2, n // 2, n - 3])  # fmt: skip
    torch.manual_seed(0)
    draft = PEagleDraft(cfg)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[:4096] = True
    init_from_target(draft, target, t2d)
    if copy_layers:
        init_layers_from_target(draft, target)
    return target, draft
