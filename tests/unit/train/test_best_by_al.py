"""Issue 18 item 3: the best checkpoint is picked by measured AL whenever eval prompts exist
(`checkpoints.select_best_by: auto`, the default); tau_sim is the fallback without prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_helpers import tiny_draft, tiny_source, tiny_spec

from peagle.spec import parse_spec
from peagle.train.checkpoint import best_metric_value, read_state
from peagle.train.loop import Trainer

HUMANEVAL_1 = {"prompt_sets": [{"name": "humaneval", "num_prompts": 1}]}


def test_auto_is_the_default_and_resolves_by_prompt_sets() -> None:
    base = {"target": {"model": "builtin:tiny-llama"}, "data": {"sources": [{"path": "builtin:sharegpt"}]}}
    spec = parse_spec(base)
    assert spec.checkpoints.select_best_by == "auto"
    assert spec.resolve(cuda_available=False).checkpoints.select_best_by == "acceptance_length"
    no_prompts = parse_spec({**base, "eval": {"prompt_sets": []}})
    assert no_prompts.resolve(cuda_available=False).checkpoints.select_best_by == "tau_sim"
    explicit = parse_spec({**base, "checkpoints": {"select_best_by": "loss"}})
    assert explicit.resolve(cuda_available=False).checkpoints.select_best_by == "loss"


def test_an_unresolved_auto_is_refused() -> None:
    with pytest.raises(ValueError, match="resolve"):
        best_metric_value({"tau_sim": 1.2}, "auto")


def test_trainer_ranks_by_measured_al_when_prompts_exist(tmp_path: Path) -> None:
    # AL peaks at the first checkpoint (step 2) while the loss still falls: the AL peak is the best one
    spec = tiny_spec(checkpoints={"select_best_by": "auto", "every_steps": 2}, eval=HUMANEVAL_1,
                     optim={"epochs": 2})  # 8 steps, checkpoints at 2, 4, 6, 8
    al_at = {2: 1.9, 4: 1.5, 6: 1.4, 8: 1.3}

    def hook(draft: Any, step: int) -> dict[str, float]:
        return {"acceptance_length": al_at[step]}

    Trainer(spec, tiny_draft(), tiny_source(), run_dir=tmp_path, evaluate_hook=hook).train()
    state = read_state(tmp_path / "checkpoints")
    assert state["select_best_by"] == "acceptance_length"
    assert state["best"] == "step_000002" and state["best_metric"] == {"acceptance_length": 1.9}


def test_trainer_falls_back_to_tau_sim_without_prompts(tmp_path: Path) -> None:
    spec = tiny_spec(checkpoints={"select_best_by": "auto", "every_steps": 4}, eval={"prompt_sets": []})
    Trainer(spec, tiny_draft(), tiny_source(), run_dir=tmp_path).train()
    state = read_state(tmp_path / "checkpoints")
    assert state["select_best_by"] == "tau_sim" and "tau_sim" in (state["best_metric"] or {})
