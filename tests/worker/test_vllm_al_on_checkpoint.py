"""Issue 20: vLLM's measured AL was only in an event line; it is recorded on the checkpoint it measured,
next to the reference decoder's AL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from peagle.progress import RecordingSink
from peagle.spec import preset
from worker.progress import ProgressCollector


def test_serve_check_eval_lands_on_its_checkpoint() -> None:
    c = ProgressCollector()
    c.add({"type": "event", "kind": "eval", "time": 1.0, "checkpoint_step": 8,
           "message": "vLLM serve check", "metrics": {"engine": "vllm", "vllm_acceptance_length": 1.19,
                                                     "vllm_num_drafts": 40, "al_ratio_vllm_over_reference": 0.97}})
    assert c.take().checkpoint_metrics == [{"step": 8, "metrics": {"vllm_acceptance_length": 1.19}}]


def test_pipeline_serve_check_names_the_checkpoint_and_rounds(
    tmp_path: Path, smollm2_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peagle.eval import final

    export = tmp_path / "export"
    export.mkdir()
    ref = {"acceptance_length": 1.2341463414634146, "per_position": [0.2], "num_drafts": 41, "tokens_generated": 50}
    (export / "eval.json").write_text(json.dumps({"checkpoint": "step_000240", "prompt_sets": {"humaneval": ref}}))
    vllm = {"acceptance_length": 1.1951219512195121, "per_position": [0.19], "num_drafts": 41, "tokens_generated": 50}
    seen: dict[str, Any] = {}

    def fake_measure(export_dir: Any, sets: Any, **kw: Any) -> dict[str, Any]:
        seen.update(kw)
        return {"parallel_drafting_ok": True, "problems": [], "prompt_sets": {"humaneval": vllm}, "serving": None}

    monkeypatch.setattr("peagle.eval.serve_check.vllm_python", lambda: Path("/usr/bin/python3"))
    monkeypatch.setattr("peagle.eval.serve_check.measure_vllm", fake_measure)
    sink = RecordingSink()
    final.serve_check(preset("demo"), export, smollm2_tokenizer, 4, sink, "target")
    ev = next(r for r in sink.records if r.get("kind") == "eval")
    assert ev["checkpoint_step"] == 240
    assert ev["metrics"]["vllm_acceptance_length"] == pytest.approx(1.1951219512195121)
    assert ev["message"] == ("vLLM serve check (humaneval, 8 prompts): AL 1.20 in vLLM vs 1.23 in the reference "
                             "decoder, parallel drafting on")
    # the serve check also times the speedup (eval.speedup, on by default): K 1..4, batch 1 and 8
    assert seen["speedup"].ks == [1, 2, 3, 4] and seen["speedup"].batch_sizes == [1, 8]
