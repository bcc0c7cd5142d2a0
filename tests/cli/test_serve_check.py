"""The vLLM serve check (slow): an export loads in vLLM with parallel drafting really on."""

from __future__ import annotations

import json

import pytest

from peagle.eval.serve_check import compare_reports, run_vllm_probe
from tests.cli.conftest import smollm2_and_draft

pytestmark = pytest.mark.slow
SMOL_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smollm2_export(smollm2_path, tmp_path_factory):
    from peagle.export.writer import export_draft

    target, draft = smollm2_and_draft(smollm2_path, copy_layers=False)
    # the portable name a demo job's export carries; the probe maps it back to the builtin's folder
    out = export_draft(draft, tmp_path_factory.mktemp("vllm") / "export", num_speculative_tokens=3,
                       verifier_name_or_path=SMOL_HUB, verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
    return out, target, draft.eval()


def test_vllm_loads_with_parallel_drafting(smollm2_export, smollm2_tokenizer, monkeypatch):
    from peagle.data.prompts import tokenize_prompts
    from peagle.eval.reference import evaluate_prompts

    # walk-through: with TQDM_DISABLE in the environment, vLLM's generate died dividing by zero
    monkeypatch.setenv("TQDM_DISABLE", "1")
    export, target, draft = smollm2_export
    prompts = tokenize_prompts(smollm2_tokenizer, ["Write a haiku about the sea.", "def add(a, b):"])
    res = run_vllm_probe(export, prompts, max_new_tokens=16)
    assert res["problems"] == [] and res["parallel_drafting_ok"] is True
    spec = res["speculative_config"]
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True
    assert spec["num_speculative_tokens"] == 3 and spec["draft_architectures"] == ["PeagleLlamaForCausalLM"]
    assert res["mask_hidden_loaded"] is True
    assert res["num_drafts"] > 0 and len(res["per_position"]) == 3 and res["acceptance_length"] >= 1.0
    ref = evaluate_prompts(target, draft, prompts, num_speculative_tokens=3, max_new_tokens=16)
    cmp = compare_reports(ref.to_dict(with_outputs=True), res)
    assert cmp["num_prompts"] == 2 and cmp["vllm"]["parallel_drafting_ok"] is True
    # the export still names the hub id: the local folder was given to vLLM through a temporary view
    assert json.loads((export / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == SMOL_HUB
