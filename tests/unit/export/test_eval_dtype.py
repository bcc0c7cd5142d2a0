"""`peagle eval` runs the reference decoder as the job's own evaluation does (issue 20: the CLI eval took
2 m 35 s where the same eval inside the job took 47 s: the CLI loaded the target in fp32, the job in bf16)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from peagle.cli import evaluate as export_eval
from peagle.eval.reference import EvalReport


def test_auto_is_the_dtypes_the_job_evaluates_in() -> None:
    assert export_eval.reference_dtypes({"torch_dtype": "bfloat16"}, "auto") == (torch.bfloat16, torch.float32)
    assert export_eval.reference_dtypes({"torch_dtype": "bfloat16"}, "float32") == (torch.float32, torch.float32)
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32, bfloat16"):
        export_eval.reference_dtypes({}, "int8")


def test_cli_default_is_auto() -> None:
    from peagle.cli.run import eval_cmd

    assert inspect.signature(eval_cmd).parameters["dtype"].default.default == "auto"
    assert inspect.signature(export_eval.run_eval).parameters["dtype"].default == "auto"


def test_run_eval_loads_the_target_in_the_exports_dtype(
    export_dir: Path, tiny_target_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_evaluate(target: Any, draft: Any, prompts: Any, **kw: Any) -> EvalReport:
        seen["target"] = next(target.parameters()).dtype
        seen["draft"] = next(draft.parameters()).dtype
        return EvalReport(acceptance_length=1.0, per_position=[], num_drafts=0, num_accepted_tokens=0,
                          tokens_generated=0, num_prompts=1, num_speculative_tokens=3)

    monkeypatch.setattr("peagle.eval.reference.evaluate_prompts", fake_evaluate)
    export_eval.run_eval(export_dir, prompts="humaneval", num_prompts=1, max_new_tokens=1,
                         target=str(tiny_target_path))
    assert seen == {"target": torch.bfloat16, "draft": torch.float32}
