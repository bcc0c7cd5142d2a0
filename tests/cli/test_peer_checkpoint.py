"""A P-EAGLE checkpoint written by speculators 0.9.0's own save code passes `peagle validate` and loads in vLLM.

Issue 18 item 4: speculators writes `architectures: ["PEagleDraftModel"]` and fp32 weights; vLLM 0.32 loads
it (it picks the architecture from `transformer_layer_config.model_type` and casts weights to the serving
dtype), so the validator only warns about both. The checkpoint is built in `.peer-venv` (bench/peer_env.sh).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from peagle.cli import app

REPO = Path(__file__).resolve().parents[2]
PEER_PY = REPO / ".peer-venv" / "bin" / "python"
SMOL_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"

# speculators' own construction + save_pretrained (as a speculators user trains and saves a P-EAGLE draft);
# embed_tokens / lm_head come from the verifier through speculators' load_verifier_weights.
_SAVE = """
import json, sys
import torch
from transformers import LlamaConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.peagle import PEagleDraftModel
from speculators.models.peagle.config import PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

target, out, hub = sys.argv[1], sys.argv[2], sys.argv[3]
t = json.load(open(f"{target}/config.json"))
n = t["num_hidden_layers"]
keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
        "rms_norm_eps", "max_position_embeddings", "hidden_act")
layer = LlamaConfig(**{k: t[k] for k in keys}, num_hidden_layers=1, tie_word_embeddings=False)
cfg = PEagleSpeculatorConfig(
    transformer_layer_config=layer, draft_vocab_size=4096, norm_before_residual=False,
    eagle_aux_hidden_state_layer_ids=[2, n // 2, n - 3], mask_token_id=t["vocab_size"] - 1,
    speculators_config=SpeculatorsConfig(
        algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=target, architectures=t["architectures"])))
torch.manual_seed(0)
model = PEagleDraftModel(cfg)
t2d = torch.zeros(t["vocab_size"], dtype=torch.bool)
t2d[:4096] = True
model.load_vocab_mappings(t2d, t2d.nonzero().flatten() - torch.arange(4096))
model.load_verifier_weights()
model.config.speculators_config.verifier.name_or_path = hub  # what a user's checkpoint names
model.save_pretrained(out)
"""


@pytest.fixture(scope="module")
def peer_checkpoint(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not PEER_PY.exists():
        pytest.skip("peer venv missing: run `bash bench/peer_env.sh` (builds .peer-venv)")
    out = tmp_path_factory.mktemp("peer") / "peagle-draft"
    proc = subprocess.run([str(PEER_PY), "-c", _SAVE, str(smollm2_path), str(out), SMOL_HUB],
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_speculators_checkpoint_is_what_the_issue_describes(peer_checkpoint: Path) -> None:
    from safetensors import safe_open

    cfg = json.loads((peer_checkpoint / "config.json").read_text())
    assert cfg["architectures"] == ["PEagleDraftModel"]
    with safe_open(str(peer_checkpoint / "model.safetensors"), framework="pt") as sf:
        assert sf.get_slice("fc.weight").get_dtype() == "F32"


def test_peagle_validate_accepts_a_speculators_checkpoint(peer_checkpoint: Path) -> None:
    res = CliRunner().invoke(app, ["validate", str(peer_checkpoint)])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("ok: ")
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning: ")]
    assert any("architectures is ['PEagleDraftModel']" in w for w in warnings), res.stderr
    assert any("F32, not bfloat16" in w for w in warnings), res.stderr
    as_json = CliRunner().invoke(app, ["validate", str(peer_checkpoint), "--json"])
    assert as_json.exit_code == 0
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is True and doc["violations"] == [] and len(doc["warnings"]) >= 2


@pytest.mark.slow
def test_vllm_loads_a_speculators_checkpoint(peer_checkpoint: Path, smollm2_tokenizer, monkeypatch) -> None:
    from peagle.data.prompts import tokenize_prompts
    from peagle.eval.serve_check import run_vllm_probe, vllm_python

    assert vllm_python() is not None, "vLLM venv missing: run `make vllm-env`"
    monkeypatch.setenv("TQDM_DISABLE", "1")  # run_vllm_probe drops it (it crashes vLLM's generate)
    prompts = tokenize_prompts(smollm2_tokenizer, ["def add(a, b):"])
    res = run_vllm_probe(peer_checkpoint, prompts, max_new_tokens=8)
    assert res["problems"] == [] and res["parallel_drafting_ok"] is True
    spec = res["speculative_config"]
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True
    assert spec["num_speculative_tokens"] == 3 and spec["draft_architectures"] == ["PeagleLlamaForCausalLM"]
    assert res["mask_hidden_loaded"] is True and res["num_drafts"] > 0
