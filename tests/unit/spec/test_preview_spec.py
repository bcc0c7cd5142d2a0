"""`preview` (a first curve on a first slice): the section, its cross-field checks, the preview's own spec,
its metric keys and its place among the phases."""

from __future__ import annotations

import pytest

from peagle.spec import PHASES, parse_spec, preset
from peagle.spec.doc import render
from peagle.spec.metrics import is_preview_key, key_patterns, preview_key, preview_values
from tests.unit.spec.spec_problems import BASE, problems


def test_no_preview_by_default_and_the_fields_have_bounds() -> None:
    spec = parse_spec(BASE)
    assert spec.preview.conversations == 0 and spec.preview.steps >= 1
    got = problems(preview={"conversations": -1, "steps": 0})
    assert set(got) == {"preview.conversations", "preview.steps"}
    assert "preview.bogus" in problems(preview={"bogus": 1}) or "preview" in str(problems(preview={"bogus": 1}))


def test_a_preview_that_cannot_run_is_off_with_its_reason_not_refused() -> None:
    """A spec made from the demo that caps its data below the preview, splits the job or runs under torchrun
    stays valid (the demo's users and tests shrink it): the preview is off, and the reason says why."""
    from peagle.spec.preview import preview_off_reason

    def reason(**sections: object) -> str | None:
        return preview_off_reason(parse_spec({**BASE, **sections}))

    capped = {"sources": [{"path": "builtin:sharegpt", "max_samples": 100}]}
    assert reason(data=capped) is None  # no preview asked for
    assert "at most 100 conversations" in str(reason(data=capped, preview={"conversations": 100}))
    assert reason(data=capped, preview={"conversations": 99}) is None
    assert "at most 50" in str(reason(data={**capped, "max_samples": 50}, preview={"conversations": 60}))
    # a source without a cap: the data's size is not known from the spec, the preview runs
    assert reason(data={"sources": [{"path": "a.jsonl"}, {"path": "b.jsonl", "max_samples": 3}]},
                  preview={"conversations": 10}) is None
    assert "engine workers" in str(reason(resources={"engine": {}}, preview={"conversations": 8}))
    assert "torchrun" in str(reason(resources={"gpus": 2, "device": "cuda"}, preview={"conversations": 8}))
    demo = preset("demo").model_dump(mode="json")
    demo["data"]["sources"][0]["max_samples"] = 16
    assert problems(**{k: v for k, v in demo.items() if k != "target"}, target=demo["target"]) == {}


def test_the_demo_previews_and_the_preview_spec_is_a_first_slice() -> None:
    from peagle.spec.preview import preview_spec

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
