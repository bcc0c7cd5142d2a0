"""The validator catches every rule vLLM enforces and every pitfall of docs/algorithm.md 5.7/5.8, one message each."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle.errors import ExportInvalidError
from peagle.export.writer import check_export, validate_export

H, V, VD = 64, 512, 128


def _edit_weights(d: Path, fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    sd = load_file(str(d / "model.safetensors"))
    save_file(fn(sd), str(d / "model.safetensors"))


def _edit_config(d: Path, fn: Callable[[dict], None]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _only(d: Path, needle: str) -> str:
    bad = validate_export(d)
    hits = [b for b in bad if needle in b]
    assert len(hits) == 1, bad
    return hits[0]


def test_valid_export_passes(export_dir):
    assert validate_export(export_dir) == []
    check_export(export_dir)


def test_model_prefix(export_dir):
    _edit_weights(export_dir, lambda sd: {f"model.{k}": v for k, v in sd.items()})
    msg = _only(export_dir, "start with 'model.'")
    assert "model.model" in msg
    assert len(validate_export(export_dir)) == 1  # shapes are still checked under the stripped names


def test_missing_mask_hidden(export_dir):
    _edit_weights(export_dir, lambda sd: {k: v for k, v in sd.items() if k != "mask_hidden"})
    assert "parallel-drafting" in _only(export_dir, "mask_hidden is missing")


def test_wrong_mask_hidden_size(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "mask_hidden": torch.zeros(1, 1, 2 * H, dtype=torch.bfloat16)})
    assert f"[1, 1, {3 * H}]" in _only(export_dir, "mask_hidden has shape")


def test_missing_mask_token_id(export_dir):
    _edit_config(export_dir, lambda c: c.pop("mask_token_id"))
    _only(export_dir, "mask_token_id is required")


def test_mask_token_out_of_range(export_dir):
    _edit_config(export_dir, lambda c: c.update(mask_token_id=V))
    _only(export_dir, "mask_token_id must be an int in [0, vocab_size=512)")


def test_num_hidden_layers_mismatch(export_dir):
    _edit_config(export_dir, lambda c: c["transformer_layer_config"].update(num_hidden_layers=4))
    assert "weights hold 2 layers" in _only(export_dir, "num_hidden_layers is 4")


def test_absolute_d2t(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "d2t": sd["d2t"] + torch.arange(VD)})
    _only(export_dir, "d2t holds absolute target ids")


def test_d2t_disagrees_with_t2d(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "d2t": sd["d2t"].flip(0)})
    _only(export_dir, "d2t and t2d disagree")


def test_absolute_d2t_without_t2d(export_dir):
    def absolute(sd):
        sd = {k: v for k, v in sd.items() if k != "t2d"}
        sd["d2t"] = sd["d2t"] + torch.arange(VD) + 400  # absolute ids past V
        return sd

    _edit_weights(export_dir, absolute)
    _only(export_dir, "d2t maps draft ids outside")


def test_missing_d2t_with_compressed_vocab(export_dir):
    _edit_weights(export_dir, lambda sd: {k: v for k, v in sd.items() if k not in ("d2t", "t2d")})
    assert "identity mapping" in _only(export_dir, "d2t is missing")


def test_d2t_wrong_dtype(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "d2t": sd["d2t"].to(torch.int32)})
    _only(export_dir, "d2t must be int64")


def test_t2d_wrong_dtype(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "t2d": sd["t2d"].to(torch.uint8)})
    _only(export_dir, "t2d must be bool")


def test_training_only_tensor(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "verifier_lm_head.weight": torch.zeros(VD, H, dtype=torch.bfloat16)})
    _only(export_dir, "training-only tensors")


def test_fp32_weights(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "fc.weight": sd["fc.weight"].float()})
    _only(export_dir, "fc.weight must be bfloat16")


def test_nan_weights(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "norm.weight": torch.full((H,), float("nan"), dtype=torch.bfloat16)})
    _only(export_dir, "norm.weight contains NaN")


def test_lm_head_rows_must_match_draft_vocab(export_dir):
    _edit_config(export_dir, lambda c: c.update(draft_vocab_size=VD + 1))
    bad = validate_export(export_dir)
    assert any("lm_head.weight has shape" in b for b in bad), bad


def test_wrong_speculators_model_type(export_dir):
    _edit_config(export_dir, lambda c: c.update(speculators_model_type="eagle3"))
    _only(export_dir, "speculators_model_type must be 'peagle'")


def test_unregistered_architecture(export_dir):
    _edit_config(export_dir, lambda c: c.update(architectures=["LlamaEagle3DraftModel"]))
    _only(export_dir, "architectures must be ['PEagleSpeculator']")


def test_missing_verifier(export_dir):
    _edit_config(export_dir, lambda c: c["speculators_config"].pop("verifier"))
    _only(export_dir, "verifier.name_or_path is required")


def test_missing_speculative_tokens(export_dir):
    _edit_config(export_dir, lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"))
    _only(export_dir, "speculative_tokens must be an int >= 1")


def test_norm_flags_must_be_false(export_dir):
    _edit_config(export_dir, lambda c: c.update(norm_before_residual=True))
    _only(export_dir, "norm_before_residual must be false")


def test_missing_layer_config(export_dir):
    _edit_config(export_dir, lambda c: c.pop("transformer_layer_config"))
    _only(export_dir, "transformer_layer_config is required")


def test_qwen3_layer_type_is_accepted_but_others_are_not(export_dir):
    _edit_config(export_dir, lambda c: c["transformer_layer_config"].update(model_type="mistral"))
    _only(export_dir, "model_type must be one of ['llama', 'qwen3']")


def test_target_hidden_size_mismatch(export_dir):
    _edit_config(export_dir, lambda c: c.update(target_hidden_size=2 * H))
    _only(export_dir, "target_hidden_size")


def test_aux_ids_in_output_convention(export_dir):
    n = 8  # the tiny verifier has 8 layers: output-of-layer defaults are [1, 3, 4]
    _edit_config(export_dir, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, n // 2 - 1, n - 4]))
    assert "[2, 4, 5]" in _only(export_dir, "output-of-layer (hook) convention")


def test_aux_ids_out_of_range(export_dir):
    _edit_config(export_dir, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 8]))
    _only(export_dir, "out of range for a 8-layer target")


def test_missing_files(tmp_path):
    assert validate_export(tmp_path / "nope") == [f"{tmp_path / 'nope'}: not a directory"]
    assert "config.json is missing" in validate_export(tmp_path)[0]
    (tmp_path / "config.json").write_text("{not json")
    assert "not valid JSON" in validate_export(tmp_path)[0]


def test_missing_weights_file(export_dir):
    (export_dir / "model.safetensors").unlink()
    assert validate_export(export_dir) == ["model.safetensors is missing"]


def test_eagle3_layout_rules(export_dir):
    def plain(c):
        layer = c.pop("transformer_layer_config")
        for k in ("speculators_config", "speculators_model_type"):
            c.pop(k)
        c.update(layer)
        c["architectures"] = ["LlamaEagle3DraftModel"]

    _edit_config(export_dir, plain)
    bad = validate_export(export_dir)
    assert any("names in vLLM's registry" in b for b in bad), bad
    assert any("pard_token" in b for b in bad), bad
    assert any("parallel_drafting must be true" in b for b in bad), bad


def test_check_export_lists_every_violation(export_dir):
    _edit_config(export_dir, lambda c: c.pop("mask_token_id"))
    _edit_weights(export_dir, lambda sd: {k: v for k, v in sd.items() if k != "mask_hidden"})
    with pytest.raises(ExportInvalidError) as info:
        check_export(export_dir)
    assert len(info.value.violations) == 2
    assert info.value.code == "export_invalid"
