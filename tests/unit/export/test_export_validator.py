"""The validator catches every rule vLLM enforces and every pitfall of docs/algorithm.md 5.7/5.8, one message each.

Errors are what makes vLLM 0.32 refuse the draft or serve it wrongly; conventions vLLM does not enforce are
warnings (docs/export.md 6). Tests marked "now a warning" expected an error before issue 18 item 4.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle.errors import ExportInvalidError
from peagle.export.rules import validate_export_report
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


def _warned(d: Path, needle: str) -> str:
    """`needle` is exactly one warning and no error."""
    report = validate_export_report(d)
    assert not [b for b in report.errors if needle in b], report.errors
    hits = [w for w in report.warnings if needle in w]
    assert len(hits) == 1, report.warnings
    return hits[0]


def test_valid_export_passes(export_dir):
    assert validate_export(export_dir) == []
    assert validate_export_report(export_dir).warnings == []
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
    # the flipped offsets map two draft ids to one target id: an error on d2t alone (the table vLLM reads)
    _edit_weights(export_dir, lambda sd: {**sd, "d2t": sd["d2t"].flip(0)})
    _only(export_dir, "d2t maps two draft ids to one target id")


def test_t2d_disagreeing_with_a_valid_d2t_is_a_warning(export_dir):
    # now a warning: vLLM skips t2d, and this d2t maps Vd distinct in-range ids
    def move_one(sd):
        t2d = sd["t2d"].clone()
        last = int(t2d.nonzero().flatten()[-1])
        free = int((~t2d).nonzero().flatten()[-1])
        t2d[last], t2d[free] = False, True
        return {**sd, "t2d": t2d}

    _edit_weights(export_dir, move_one)
    assert "vLLM reads only d2t" in _warned(export_dir, "d2t and t2d disagree")


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
    # int32 is now a warning: vLLM copies d2t into its int64 parameter (a cast); a float table is an error
    _edit_weights(export_dir, lambda sd: {**sd, "d2t": sd["d2t"].to(torch.int32)})
    _warned(export_dir, "d2t is I32, not int64")
    _edit_weights(export_dir, lambda sd: {**sd, "d2t": sd["d2t"].to(torch.float32)})
    _only(export_dir, "d2t must be int64")


def test_t2d_wrong_dtype(export_dir):
    # now a warning: vLLM skips t2d when loading
    _edit_weights(export_dir, lambda sd: {**sd, "t2d": sd["t2d"].to(torch.uint8)})
    assert "vLLM skips t2d" in _warned(export_dir, "t2d is U8, not bool")


def test_training_only_tensor(export_dir):
    _edit_weights(export_dir, lambda sd: {**sd, "verifier_lm_head.weight": torch.zeros(VD, H, dtype=torch.bfloat16)})
    _only(export_dir, "training-only tensors")


def test_fp32_weights(export_dir):
    # now a warning: vLLM casts floating weights to the serving dtype at load
    _edit_weights(export_dir, lambda sd: {**sd, "fc.weight": sd["fc.weight"].float()})
    assert "vLLM casts them" in _warned(export_dir, "1 float tensors are F32, not bfloat16")
    _edit_config(export_dir, lambda c: c.update(torch_dtype="float32"))
    _warned(export_dir, "torch_dtype is 'float32'")


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
    # now a warning: for a speculators config vLLM replaces architectures from transformer_layer_config.model_type
    _edit_config(export_dir, lambda c: c.update(architectures=["LlamaEagle3DraftModel"]))
    assert "vLLM ignores it" in _warned(export_dir, "architectures is ['LlamaEagle3DraftModel']")


def test_missing_verifier(export_dir):
    _edit_config(export_dir, lambda c: c["speculators_config"].pop("verifier"))
    _only(export_dir, "verifier.name_or_path is required")


def test_missing_speculative_tokens(export_dir):
    _edit_config(export_dir, lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"))
    _only(export_dir, "speculative_tokens must be an int >= 1")


def test_norm_flags_must_be_false(export_dir):
    # norm_before_residual is now a warning: vLLM's peagle updater forwards it and vLLM applies it
    _edit_config(export_dir, lambda c: c.update(norm_before_residual=True))
    _warned(export_dir, "norm_before_residual is True")
    # fc_norm stays an error: the peagle updater drops it, so vLLM would serve without that norm
    _edit_config(export_dir, lambda c: c.update(norm_before_residual=False, fc_norm=True))
    _only(export_dir, "fc_norm must be false")


def test_missing_layer_config(export_dir):
    _edit_config(export_dir, lambda c: c.pop("transformer_layer_config"))
    _only(export_dir, "transformer_layer_config is required")


def test_qwen3_layer_type_is_accepted_but_others_are_not(export_dir):
    _edit_config(export_dir, lambda c: c["transformer_layer_config"].update(model_type="mistral"))
    _only(export_dir, "model_type must be one of ['llama', 'qwen3']")


def test_target_hidden_size_mismatch(export_dir):
    # vLLM sizes fc and mask_hidden from target_hidden_size: the errors are now the shapes it refuses
    # (the differing size itself is a warning: vLLM supports it, peagle's reference decoder does not)
    _edit_config(export_dir, lambda c: c.update(target_hidden_size=2 * H))
    _only(export_dir, f"fc.weight has shape [{H}, {3 * H}], expected [{H}, {6 * H}]")
    _only(export_dir, f"expected [1, 1, {6 * H}]")
    _warned(export_dir, "target_hidden_size")


def test_aux_ids_in_output_convention(export_dir):
    n = 8  # the tiny verifier has 8 layers: output-of-layer defaults are [1, 3, 4]
    _edit_config(export_dir, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, n // 2 - 1, n - 4]))
    # now a warning: vLLM serves any in-range ids; only the training convention (unseen here) can be off
    assert "[2, 4, 5]" in _warned(export_dir, "output-of-layer (hook) convention")


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
        c.pop("mask_token_id")  # vLLM takes the mask token from mask_token_id, pard_token or ptd_token_id

    _edit_config(export_dir, plain)
    bad = validate_export(export_dir)
    assert any("names in vLLM's registry" in b for b in bad), bad
    assert any("pard_token" in b for b in bad), bad
    # now a warning: vLLM reads parallel_drafting from --speculative-config, never from the draft config
    assert "parallel_drafting is not true" in " ".join(validate_export_report(export_dir).warnings)


def test_check_export_lists_every_violation(export_dir):
    _edit_config(export_dir, lambda c: c.pop("mask_token_id"))
    _edit_weights(export_dir, lambda sd: {k: v for k, v in sd.items() if k != "mask_hidden"})
    with pytest.raises(ExportInvalidError) as info:
        check_export(export_dir)
    assert len(info.value.violations) == 2
    assert info.value.code == "export_invalid"
