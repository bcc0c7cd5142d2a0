"""The promotion comparison in a real vLLM (slow: 2 probes, 4 engine starts): two SmolLM2 drafts measured by
alternating engine starts on the same prompts, each with AL per position and the served speedup per K and
batch size against the verifier beside it, and the rule deciding on those numbers (docs/retrain.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import smollm2_and_draft

pytestmark = pytest.mark.slow


def test_two_drafts_measured_in_one_comparison_and_decided(smollm2_path: Path, smollm2_tokenizer: object,
                                                             tmp_path: Path) -> None:
    from peagle.data.prompts import prompt_set_ids
    from peagle.eval.compare import METHOD, compare_drafts, comparison_problems
    from peagle.eval.promotion import decide
    from peagle.export.writer import export_draft

    exports = {}
    for name, copy_layers in (("child", True), ("current", False)):
        _, draft = smollm2_and_draft(smollm2_path, copy_layers=copy_layers)
        exports[name] = export_draft(draft.eval(), tmp_path / name, num_speculative_tokens=2,
                                     verifier_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct",
                                     verifier_architectures=["LlamaForCausalLM"])
    assert comparison_problems(exports) == []
    sets = {"humaneval": prompt_set_ids("humaneval", 2, smollm2_tokenizer)}
    res = compare_drafts(exports, sets, verifier=smollm2_path, max_new_tokens=16, batch_sizes=[2], num_prompts=2,
                         rounds=1)
    assert res["method"] == METHOD and res["order"] == [["child", "current"]]
    for name, n in res["drafts"].items():
        assert n["parallel_drafting_ok"] is True, (name, n["problems"])
        assert n["acceptance_length"] >= 1.0 and len(n["per_position"]) == 2
        assert n["prompt_sets"]["humaneval"]["num_prompts"] == 2
        table = n["serving"]["table"]
        assert [(r["num_speculative_tokens"], r["batch_size"]) for r in table] == [(2, 1), (2, 2)]
        assert all(r["speedup"] > 0 and r["base_tokens_per_s"] > 0 for r in table)
    # the draft whose layer starts as the target's accepts more than the one with random layers
    child, current = res["drafts"]["child"], res["drafts"]["current"]
    assert child["acceptance_length"] > current["acceptance_length"]
    d = decide(child, current, [1, 2])
    assert d.decision in ("promoted", "declined"), d.reason
    assert [r["batch_size"] for r in d.rows] == [1, 2] and all(r["child"] and r["current"] for r in d.rows)
