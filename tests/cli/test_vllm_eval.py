"""Issue 18 with a real vLLM (slow; 3 engine starts): the job's evaluation measures AL per prompt set and the
serving speedup in vLLM without the target in the trainer process (the vLLM target engine: model None), its
numbers fit the API's schema, and a run without drafts gives the same answer (no AL) in both engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from peagle.progress import RecordingSink
from peagle.spec import parse_spec
from tests.cli.conftest import smollm2_and_draft

pytestmark = pytest.mark.slow


def _spec(**eval_: Any) -> Any:
    return parse_spec({
        "target": {"model": "builtin:smollm2-135m-instruct"},
        "data": {"sources": [{"path": "builtin:sharegpt"}]},
        "peagle": {"num_depths": 3},
        "eval": {"engine": "vllm", "max_new_tokens": 16, **eval_},
    })


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> tuple[Any, Any]:
    target, draft = smollm2_and_draft(smollm2_path, copy_layers=True)
    return target, draft.eval()


def test_job_evaluation_in_vllm_without_the_target(smollm2: Any, smollm2_path: Path, smollm2_tokenizer: Any,
                                                   tmp_path: Path) -> None:
    from api.checkpoint_schemas import CheckpointEvaluation
    from peagle.eval.final import evaluate_export, evaluation_summary
    from peagle.export.writer import export_draft

    _, draft = smollm2
    ckpt = export_draft(draft, tmp_path / "step_000008", num_speculative_tokens=3,
                        verifier_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
                        verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
    (ckpt / "meta.json").write_text(json.dumps({"step": 8, "metrics": {"eval_tau_sim": 1.1}}))
    spec = _spec(prompt_sets=[{"name": "humaneval", "num_prompts": 2}, {"name": "sharegpt-heldout", "num_prompts": 2}],
                 speedup_num_prompts=2, speedup_rounds=1, speedup_sweep=False)
    sink = RecordingSink()
    out = evaluate_export(spec, ckpt, None, smollm2_tokenizer, 3, sink, target_path=smollm2_path)
    assert out["engine"] == "vllm" and out["parallel_drafting_ok"] is True and out["tau_sim"] == 1.1
    assert set(out["prompt_sets"]) == {"humaneval", "sharegpt-heldout"}
    for rep in out["prompt_sets"].values():
        # vLLM's global counters equal the sums of its per-request histograms (one definition, verified)
        assert rep["counters_agree"] is True and rep["num_drafts"] > 0 and rep["acceptance_length"] >= 1.0
        assert rep["per_request_spread"] is not None and len(rep["per_request"]) == 2
    serving = out["serving"]
    assert serving["engines"] == "both" and serving["hardware"]["device"] == "cpu"
    assert [r["batch_size"] for r in (serving["batch_1"], serving["batch_n"])] == [1, 2]
    for row in serving["table"]:
        assert row["base_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0 and row["speedup"] > 0
        assert row["acceptance_length"] is not None and row["num_speculative_tokens"] == 3
    assert serving["parallel_drafting_ok"] is True and len(serving["recommended"]) == 2
    assert any("served speedup (vLLM on cpu" in r.get("message", "") for r in sink.records)
    # what the checkpoint keeps is what the API serves
    CheckpointEvaluation.model_validate(evaluation_summary(out))


def test_no_drafts_no_al_in_both_engines(smollm2: Any, smollm2_path: Path, smollm2_tokenizer: Any) -> None:
    """One new token per prompt: the prefill's token only, nothing drafted. The AL hook (vLLM on an export
    of the draft in memory, the trainer holding no target) and the reference decoder both say: not measured."""
    from peagle.eval.live import al_hook

    target, draft = smollm2
    spec = _spec(prompt_sets=[{"name": "humaneval", "num_prompts": 2}], max_new_tokens=1)
    by_vllm = al_hook(spec, None, smollm2_tokenizer, 3, target_path=smollm2_path)(draft, 4)
    reference = al_hook(spec.model_copy(update={"eval": spec.eval.model_copy(update={"engine": "reference"})}),
                        target, smollm2_tokenizer, 3, target_path=smollm2_path)(draft, 4)
    assert by_vllm == {} and reference == {}
