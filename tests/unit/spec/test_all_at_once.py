"""Every problem of a spec in one answer: field-level and cross-field problems are collected together
(issue 39: `optim.betas` and the other cross-field rules were reported only once the field errors were fixed)."""

from __future__ import annotations

import pytest

from peagle.spec import SpecInvalidError, parse_spec


def _paths(data: dict) -> dict[str, str]:
    with pytest.raises(SpecInvalidError) as ei:
        parse_spec(data)
    return {p.path: p.message for p in ei.value.problems}


def test_field_and_cross_field_problems_come_together() -> None:
    paths = _paths({
        "target": {"model": "builtin:tiny-llama"},
        "optim": {"betas": [1.5, 0.9], "lr": -1.0},
        "resources": {"gpus": 100},
        "peagle": {"down_sample_ratio": 0.3, "down_sample_ratio_min": 0.9},
        "bogus": 1,
    })
    assert "resources.gpus" in paths and "64" in paths["resources.gpus"]  # field: le=64
    assert "optim.lr" in paths  # field
    assert "bogus" in paths  # unknown field
    assert paths["optim.betas.0"] == "must be in [0, 1), got 1.5"  # cross-field, same answer
    assert "peagle.down_sample_ratio_min" in paths  # cross-field, same answer


def test_a_cross_field_rule_judged_against_a_bad_field_is_not_reported() -> None:
    # gpus is out of range: the rule "gpus >= 1 on cuda" would be judged against the default (0), so only
    # the field's own problem is reported, once
    paths = _paths({"target": {"model": "builtin:tiny-llama"},
                    "resources": {"gpus": 100, "device": "cuda", "capture_gpus": 2}})
    assert list(paths) == ["resources.gpus"]


def test_missing_required_field_still_reports_itself() -> None:
    paths = _paths({"optim": {"betas": [1.5, 0.9]}})
    assert "target" in paths
