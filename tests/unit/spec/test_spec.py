"""The job spec: every field documented and range-checked; every problem reported at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from peagle.spec import (
    SpecInvalidError,
    TrainSpec,
    load_spec_file,
    parse_spec,
    preset,
    preset_names,
    spec_hash,
)

MIN = {"target": {"model": "builtin:tiny-llama"}}


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    seen.add(model)
    for field in model.model_fields.values():
        ann = field.annotation
        for cand in (*getattr(ann, "__args__", ()), ann):
            if isinstance(cand, type) and issubclass(cand, BaseModel) and cand not in seen:
                _models(cand, seen)


def all_models() -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    _models(TrainSpec, seen)
    return seen


def test_every_field_has_a_description_and_models_forbid_extra() -> None:
    models = all_models()
    assert len(models) >= 10
    for model in models:
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_minimal_spec_gets_defaults() -> None:
    spec = parse_spec(MIN)
    assert spec.spec_version == 1
    assert spec.peagle.num_depths == 8
    assert spec.data.sources[0].path == "builtin:sharegpt"
    assert spec.draft.aux_layer_ids == "auto"
    assert spec.draft.layer_init == "target"


def test_layer_init_choices() -> None:
    assert parse_spec({**MIN, "draft": {"layer_init": "random"}}).draft.layer_init == "random"
    with pytest.raises(SpecInvalidError) as ei:
        parse_spec({**MIN, "draft": {"layer_init": "copy"}})
    [p] = ei.value.problems
    assert p.path == "draft.layer_init" and "random" in p.message


def test_mask_hidden_init_choices() -> None:
    assert parse_spec(MIN).draft.mask_hidden_init == "random"
    assert parse_spec({**MIN, "draft": {"mask_hidden_init": "feature_mean"}}).draft.mask_hidden_init == "feature_mean"
    with pytest.raises(SpecInvalidError) as ei:
        parse_spec({**MIN, "draft": {"mask_hidden_init": "zeros"}})
    [p] = ei.value.problems
    assert p.path == "draft.mask_hidden_init" and "feature_mean" in p.message


def test_depth_decay_range() -> None:
    assert parse_spec(MIN).peagle.depth_decay == 1.0  # the count-normalised loss unless asked
    assert parse_spec({**MIN, "peagle": {"depth_decay": 0.5}}).peagle.depth_decay == 0.5
    for bad in (0, -0.5, 1.5):
        with pytest.raises(SpecInvalidError) as ei:
            parse_spec({**MIN, "peagle": {"depth_decay": bad}})
        [p] = ei.value.problems
        assert p.path == "peagle.depth_decay", bad


def test_target_temperature_range() -> None:
    assert parse_spec(MIN).peagle.target_temperature == 1.0  # the target's own distribution unless asked
    assert parse_spec({**MIN, "peagle": {"target_temperature": 0}}).peagle.target_temperature == 0.0
    for bad in (-0.1, 10.5, "hot"):
        with pytest.raises(SpecInvalidError) as ei:
            parse_spec({**MIN, "peagle": {"target_temperature": bad}})
        [p] = ei.value.problems
        assert p.path == "peagle.target_temperature", bad


def test_logit_mse_range() -> None:
    assert parse_spec(MIN).peagle.logit_mse == 0.0  # the KL alone unless asked
    assert parse_spec({**MIN, "peagle": {"logit_mse": 2.5}}).peagle.logit_mse == 2.5
    for bad in (-0.1, 101, "lots"):
        with pytest.raises(SpecInvalidError) as ei:
            parse_spec({**MIN, "peagle": {"logit_mse": bad}})
        [p] = ei.value.problems
        assert p.path == "peagle.logit_mse", bad


def test_unknown_field_is_rejected_with_its_path() -> None:
    with pytest.raises(SpecInvalidError) as ei:
        parse_spec({**MIN, "peagle": {"num_depth": 4}})
    [p] = ei.value.problems
    assert p.path == "peagle.num_depth"
    assert p.pointer == "/peagle/num_depth"
    assert "unknown field" in p.message


def test_every_field_error_listed_at_once() -> None:
    bad = {
        "target": {"model": ""},
        "peagle": {"num_depths": 0, "down_sample_ratio": 1.5},
        "optim": {"lr": -1, "epochs": 0},
        "draft": {"num_layers": 0},
    }
    with pytest.raises(SpecInvalidError) as ei:
        parse_spec(bad)
    paths = {p.path for p in ei.value.problems}
    assert {
        "target.model",
        "peagle.num_depths",
        "peagle.down_sample_ratio",
        "optim.lr",
        "optim.epochs",
        "draft.num_layers",
    } <= paths
    assert "6 problems" in str(ei.value) or len(ei.value.problems) >= 6


def test_cross_field_errors_name_the_field_and_are_all_listed() -> None:
    bad = {
        **MIN,
        "peagle": {"down_sample_ratio": 0.5, "down_sample_ratio_min": 0.8, "num_depths": 4},
        "draft": {"aux_layer_ids": [2, 2, 5]},
        "eval": {"num_speculative_tokens": 6},
        "data": {"sources": [{"path": "x.jsonl"}], "max_length": 4096},
        "optim": {"pack_length": 1024, "betas": [0.9, 1.0]},
    }
    with pytest.raises(SpecInvalidError) as ei:
        parse_spec(bad)
    by_path = {p.path: p.message for p in ei.value.problems}
    assert "peagle.down_sample_ratio_min" in by_path
    assert "0.5" in by_path["peagle.down_sample_ratio_min"]
    assert "distinct" in by_path["draft.aux_layer_ids"]
    assert "eval.num_speculative_tokens" in by_path
    assert "optim.pack_length" in by_path
    assert "optim.betas.1" in by_path
    assert ei.value.problems[0].pointer.startswith("/")


@pytest.mark.parametrize(
    ("patch", "path"),
    [
        ({"draft": {"aux_layer_ids": [1, 2]}}, "draft.aux_layer_ids"),
        ({"draft": {"aux_layer_ids": [-1, 2, 3]}}, "draft.aux_layer_ids"),
        ({"draft": {"mask_token_id": -5}}, "draft.mask_token_id"),
        ({"resources": {"device": "cpu", "gpus": 2}}, "resources.gpus"),
        ({"resources": {"device": "cpu", "attention": "flex"}}, "resources.attention"),
        ({"checkpoints": {"select_best_by": "acceptance_length"}, "eval": {"prompt_sets": []}}, "checkpoints.select_best_by"),
        ({"peagle": {"num_depths": 2.5}}, "peagle.num_depths"),
        ({"peagle": {"sequence_partitions": 0}}, "peagle.sequence_partitions"),
        ({"tags": ["has space"]}, "tags.0"),
        ({"spec_version": 2}, "spec_version"),
    ],
)
def test_each_rule(patch: dict, path: str) -> None:
    with pytest.raises(SpecInvalidError) as ei:
        parse_spec({**MIN, **patch})
    assert path in {p.path for p in ei.value.problems}, ei.value.problems


def test_not_an_object() -> None:
    with pytest.raises(SpecInvalidError, match="must be an object"):
        parse_spec([1, 2])


@pytest.mark.parametrize("name", preset_names())
def test_presets_are_valid_and_roundtrip(name: str) -> None:
    spec = preset(name)
    again = parse_spec(json.loads(spec.model_dump_json()))
    assert again == spec
    assert spec_hash(again) == spec_hash(spec)


def test_demo_and_gpu_presets_shape() -> None:
    demo = preset("demo")
    assert demo.target.model == "builtin:smollm2-135m-instruct"
    assert demo.resources.gpus == 0
    gpu = preset("gpu-llama3-8b")
    assert gpu.peagle.num_depths == 8 and gpu.draft.num_layers == 4 and gpu.draft.draft_vocab_size == 32000
    assert gpu.resources.gpus >= 1
    with pytest.raises(KeyError, match="unknown preset"):
        preset("nope")


def test_yaml_and_json_files_validate_the_same(tmp_path: Path) -> None:
    data = {**MIN, "peagle": {"num_depths": 0}}
    y = tmp_path / "s.yaml"
    j = tmp_path / "s.json"
    y.write_text(yaml.safe_dump(data))
    j.write_text(json.dumps(data))
    errs = []
    for f in (y, j):
        with pytest.raises(SpecInvalidError) as ei:
            load_spec_file(f)
        errs.append([(p.path, p.message) for p in ei.value.problems])
    assert errs[0] == errs[1]
    good = tmp_path / "g.yaml"
    good.write_text(yaml.safe_dump(MIN))
    assert load_spec_file(good).target.model == "builtin:tiny-llama"


def test_unreadable_or_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(SpecInvalidError, match="cannot read"):
        load_spec_file(tmp_path / "missing.yaml")
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    with pytest.raises(SpecInvalidError, match="not valid"):
        load_spec_file(bad)


def test_spec_hash_changes_with_content() -> None:
    a = parse_spec(MIN)
    b = parse_spec({**MIN, "optim": {"seed": 1}})
    assert spec_hash(a) != spec_hash(b)
    assert spec_hash(a, sections=("data",)) == spec_hash(b, sections=("data",))


def test_spec_module_is_torch_free() -> None:
    import subprocess
    import sys

    code = "import sys, peagle.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
