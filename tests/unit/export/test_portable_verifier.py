"""Exports name a verifier that works where the draft is downloaded; this machine resolves it to a folder."""

from __future__ import annotations

import json
from pathlib import Path

from peagle.builtin import local_verifier
from peagle.engine.prober import loadable_export
from peagle.pipeline import verifier_name
from peagle.spec import preset

SMOL_HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_builtin_targets_export_a_portable_name(tmp_path: Path) -> None:
    host_folder = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    host_folder.mkdir(parents=True)
    assert verifier_name(preset("demo"), host_folder) == SMOL_HUB
    # the tiny random target has no hub original: the builtin name, which any peagle install rebuilds
    assert verifier_name(preset("tiny"), host_folder) == "builtin:tiny-llama"
    spec = preset("demo").model_copy(deep=True)
    spec.target.name_or_path = "my-org/smol-finetune"
    assert verifier_name(spec, host_folder) == "my-org/smol-finetune"  # the spec's word wins


def test_local_verifier_maps_portable_names_back_to_folders(smollm2_path: Path, tiny_target_path: Path) -> None:
    assert Path(local_verifier(SMOL_HUB)) == smollm2_path
    assert Path(local_verifier("builtin:tiny-llama")) == tiny_target_path
    assert local_verifier("some-org/other-model") == "some-org/other-model"


def test_loadable_export_names_the_local_folder_and_leaves_the_export_alone(tmp_path: Path) -> None:
    export = tmp_path / "export"
    export.mkdir()
    cfg = {"speculators_config": {"verifier": {"name_or_path": SMOL_HUB, "architectures": ["LlamaForCausalLM"]}}}
    (export / "config.json").write_text(json.dumps(cfg))
    (export / "model.safetensors").write_bytes(b"weights")
    local = tmp_path / "target"
    with loadable_export(export, local) as view:
        assert view != export
        got = json.loads((view / "config.json").read_text())
        assert got["speculators_config"]["verifier"]["name_or_path"] == str(local)
        assert (view / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((export / "config.json").read_text()) == cfg
    with loadable_export(export, SMOL_HUB) as same:  # nothing to map: the export itself
        assert same == export


def test_verifier_of_reads_the_name_an_export_records() -> None:
    from peagle.export.writer import verifier_of

    assert verifier_of({"speculators_config": {"verifier": {"name_or_path": SMOL_HUB}}}) == SMOL_HUB
    # the eagle3 layout names none; malformed or empty entries name none either (never "" or a non-string)
    for cfg in ({}, {"architectures": ["LlamaForCausalLMEagle3"]}, {"speculators_config": None},
                {"speculators_config": {"verifier": "x"}}, {"speculators_config": {"verifier": {"name_or_path": ""}}},
                {"speculators_config": {"verifier": {"name_or_path": 7}}}, {"speculators_config": []}):
        assert verifier_of(cfg) is None, cfg
