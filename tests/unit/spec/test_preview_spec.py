"""`preview` (a first curve on a first slice): the section, its cross-field checks, the preview's own spec,
its metric keys and its place among the phases."""

from __future__ import annotations

import pytest

from peagle.spec import PHASES, SpecInvalidError, parse_spec, preset
from peagle.spec.doc import render
from peagle.spec.metrics import is_preview_key, key_patterns, preview_key, preview_values

BASE = {"target": {"model": "org/model"}}


def problems(**sections) -> dict[str, str]:
    try:
        parse_spec({**BASE, **sections})
    except SpecInvalidError as exc:
        return {p.path: p.message for p in exc.problems}
    return {}


def test_no_preview_by_default_and_the_fields_have_bounds() -> None:
    spec = parse_spec(BASE)
    assert spec.preview.conversations == 0 and spec.preview.steps >= 1
    got = problems(preview={"conversations": -1, "steps": 0})
    assert set(got) == {"preview.conversations", "preview.steps"}
    assert "preview.bogus" in problems(preview={"bogus": 1}) or "preview" in str(problems(preview={"bogus": 1}))


def test_what_cannot_work_is_refused_at_the_field() -> None:
    capped = {"sources": [{"path": "builtin:sharegpt", "max_samples": 100}]}
    assert "below the data's 100 conversations" in problems(data=capped, preview={"conversations": 100})[
        "preview.conversations"]
    assert problems(data=capped, preview={"conversations": 99}) == {}
    assert "below the data's 50" in problems(data={**capped, "max_samples": 50},
                                             preview={"conversations": 60})["preview.conversations"]
    # a source without a cap: the data's size is not known from the spec, nothing to refuse
    assert problems(data={"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "max_samples": 3}]},
                    preview={"conversations": 10}) == {}
    split = problems(resources={"engine": {}}, preview={"conversations": 8})
    assert "engine workers" in split["preview.conversations"]
    ddp = problems(resources={"gpus": 2, "device": "cuda"}, preview={"conversations": 8})
    assert "torchrun" in ddp["preview.conversations"]
    # every problem at once: the preview's and the others'
    both = problems(resources={"engine": {}, "capture": "offline"}, preview={"conversations": 8})
    assert {"preview.conversations", "resources.capture"} <= set(both)


def test_the_demo_previews_and_the_preview_spec_is_a_first_slice() -> None:
    from peagle.preview import preview_spec

    demo = preset("demo")
    assert 0 < demo.preview.conversations < (demo.data.sources[0].max_samples or 0)
    p = preview_spec(demo)
    assert p.data.max_samples == demo.preview.conversations and p.data.eval_samples == 0
    assert p.optim.max_steps == demo.preview.steps and p.checkpoints.every_steps == demo.preview.steps
    assert p.eval.prompt_sets == [] and not p.eval.serve_check and p.preview.conversations == 0
    # what decides a regenerated answer is the main run's: the preview's answers are the cache's entries
    assert p.target == demo.target and p.data.regenerate == demo.data.regenerate
    assert p.data.max_length == demo.data.max_length and p.optim.seed == demo.optim.seed
    assert p.data.sources == demo.data.sources
    with pytest.raises(ValueError, match="no preview"):
        preview_spec(preset("tiny"))


def test_preview_metric_keys_are_one_definition() -> None:
    assert preview_key("loss") == "preview_loss" and is_preview_key("preview_acc_0")
    assert not is_preview_key("loss") and not is_preview_key("eval_loss")
    assert preview_values({"loss": 2.0, "acc_0": 0.5}) == {"preview_loss": 2.0, "preview_acc_0": 0.5}
    assert key_patterns()["preview_prefix"] == "preview_"


def test_preview_is_a_phase_after_validating_and_in_the_reference() -> None:
    assert PHASES.index("preview") == PHASES.index("validating") + 1 < PHASES.index("preparing_data")
    ref = render()
    assert "`preview.conversations`" in ref and "`preview.steps`" in ref
