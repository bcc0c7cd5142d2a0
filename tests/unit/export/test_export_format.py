"""The speculators-format export: key names, dtypes, config rules, round trip (docs/export.md 2.1, docs/decisions.md decision 10)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from peagle.export.writer import export_draft, load_exported_draft, validate_export
from peagle.model.draft import expected_state_keys

V, H, VD, LAYERS = 512, 64, 128, 2  # the shapes built by conftest.py


def test_weights_have_vllm_names_and_dtypes(export_dir):
    sd = load_file(str(export_dir / "model.safetensors"))
    assert sorted(sd) == expected_state_keys(LAYERS, compressed_vocab=True)
    assert not any(k.startswith("model.") for k in sd)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (VD,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)
    assert sd["mask_hidden"].shape == (1, 1, 3 * H)
    floats = [k for k in sd if k not in ("d2t", "t2d")]
    assert all(sd[k].dtype == torch.bfloat16 for k in floats)
    assert torch.equal(torch.arange(VD) + sd["d2t"], sd["t2d"].nonzero().flatten())
    assert sd["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H


def test_config_follows_the_speculators_layout(export_dir, verifier_dir):
    cfg = json.loads((export_dir / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["architectures"] == ["PEagleSpeculator"]
    sc = cfg["speculators_config"]
    assert sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"] == {"architectures": ["LlamaForCausalLM"], "name_or_path": str(verifier_dir)}
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == LAYERS
    assert layer["hidden_size"] == H and layer["vocab_size"] == V and layer["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == VD and cfg["mask_token_id"] == V - 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert all(cfg[f] is False for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
    assert cfg["target_hidden_size"] is None and cfg["torch_dtype"] == "bfloat16"
    assert validate_export(export_dir) == []


def test_eagle3_layout_is_valid_and_plain(tiny_draft, tmp_path):
    out = export_draft(
        tiny_draft, tmp_path / "e3", num_speculative_tokens=3, verifier_name_or_path="x",
        verifier_architectures=["LlamaForCausalLM"], layout="eagle3",
    )  # fmt: skip
    cfg = json.loads((out / "config.json").read_text())
    assert "speculators_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["pard_token"] == V - 1 and cfg["parallel_drafting"] is True
    assert cfg["num_hidden_layers"] == LAYERS and cfg["target_hidden_size"] == H
    assert validate_export(out) == []


def test_training_only_tensors_and_prefix_are_dropped(tiny_draft, tmp_path):
    from peagle.export.writer import export_state_dict

    sd = {f"model.{k}": v for k, v in tiny_draft.state_dict().items()}
    sd["verifier_lm_head.weight"] = torch.zeros(VD, H)
    sd["verifier_norm.weight"] = torch.ones(H)
    out = export_state_dict(sd)
    assert sorted(out) == expected_state_keys(LAYERS, compressed_vocab=True)


def test_round_trip_gives_the_same_logits(tiny_draft, export_dir):
    loaded = load_exported_draft(export_dir)
    ref = type(tiny_draft)(tiny_draft.config)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                         for k, v in tiny_draft.state_dict().items()})  # fmt: skip
    ref.eval()
    n = 7
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, n), generator=g)
    aux = torch.randn(1, n, 3 * H, generator=g)
    is_masked = torch.tensor([[False] * 5 + [True] * 2])
    pos = torch.arange(n)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    with torch.no_grad():
        want = ref.compute_logits(ref(ids, aux, is_masked, pos, mask))
        got = loaded.compute_logits(loaded(ids, aux, is_masked, pos, mask))
        orig = tiny_draft.compute_logits(tiny_draft(ids, aux, is_masked, pos, mask))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, orig, rtol=0.05, atol=0.05)  # bf16 storage tolerance
    assert torch.equal(loaded.d2t, tiny_draft.d2t) and torch.equal(loaded.t2d, tiny_draft.t2d)
    assert loaded.config.mask_token_id == tiny_draft.config.mask_token_id
    assert loaded.config.aux_layer_ids == tiny_draft.config.aux_layer_ids


def test_full_vocab_export_has_no_mapping(tiny_target, tmp_path):
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target

    cfg = DraftConfig.from_target(tiny_target.config, num_layers=1, draft_vocab_size=None, mask_token_id=3,
                                  aux_layer_ids=[2, 4, 5])  # fmt: skip
    d = PEagleDraft(cfg)
    init_from_target(d, tiny_target, None)
    out = export_draft(d, tmp_path / "full", num_speculative_tokens=2, verifier_name_or_path="v",
                       verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
    sd = load_file(str(out / "model.safetensors"))
    assert "d2t" not in sd and "t2d" not in sd
    assert validate_export(out) == []


def test_export_refuses_a_nan_draft(tiny_target, tmp_path):
    from peagle.errors import ExportInvalidError
    from peagle.model.draft import DraftConfig, PEagleDraft

    cfg = DraftConfig.from_target(tiny_target.config, num_layers=1, draft_vocab_size=None, mask_token_id=3,
                                  aux_layer_ids=[2, 4, 5])  # fmt: skip
    with pytest.raises(ExportInvalidError, match=r"embed_tokens\.weight contains NaN"):
        export_draft(PEagleDraft(cfg), tmp_path / "nan", num_speculative_tokens=2, verifier_name_or_path="v",
                     verifier_architectures=["LlamaForCausalLM"])  # fmt: skip
