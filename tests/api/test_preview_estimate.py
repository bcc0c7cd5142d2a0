"""The dry run of a job with a preview (issue 39: the first curve within 10 minutes on a 2-core AVX2-only
machine): the preview is a phase of its own, its answers are not generated again by the main run, and the
estimate says when the first curve comes (`first_curve_s` and a note); the README states the demo's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from api.checkpoint_schemas import Estimate
from peagle.spec import parse_spec, preset
from service.estimate import MODEL_RANGE, estimate

AVX2 = frozenset({"avx", "avx2", "fma"})
BF16 = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def _demo(flags: frozenset[str], **over: Any) -> dict[str, Any]:
    data = preset("demo").model_dump(mode="json")
    for key, value in over.items():
        data[key] = {**data[key], **value}
    return estimate(parse_spec(data), dataset_rows={}, queue="q", queue_position=0, vllm_available=True,
                    cpu_flags=flags)


def test_the_demo_shows_a_first_curve_within_ten_minutes_on_avx2() -> None:
    est = _demo(AVX2)
    assert est["target_dtype"] == "float32"  # auto on an AVX2-only CPU
    phases = list(est["phase_seconds"])
    assert phases[:4] == ["starting", "preparing_data", "preview", "regenerating"], phases
    # the demo's preview is sized so that even the top of the model's range is within 10 minutes
    assert est["first_curve_s"] * MODEL_RANGE[1] <= 600, est["first_curve_s"]
    assert any(n.startswith("first training curve after about ") and "preview of 40 steps on the first 48" in n
               for n in est["notes"]), est["notes"]
    assert "first_curve_s" in Estimate.model_fields  # the response model states it

    without = _demo(AVX2, preview={"conversations": 0})
    assert "preview" not in without["phase_seconds"]
    assert without["first_curve_s"] > 10 * est["first_curve_s"]  # regeneration of every answer comes first
    # the preview's answers come from the cache: the main regeneration is shorter by what it generated
    assert est["phase_seconds"]["regenerating"] < without["phase_seconds"]["regenerating"]
    assert est["funnel"] == without["funnel"] and est["optimizer_steps"] == without["optimizer_steps"]


def test_a_preview_that_does_not_run_is_said_and_not_estimated() -> None:
    est = _demo(BF16, data={"sources": [{"path": "builtin:sharegpt", "max_samples": 40}]})
    assert "preview" not in est["phase_seconds"]
    assert any(n.startswith("no preview: the data has at most 40 conversations") for n in est["notes"]), est["notes"]


def test_readme_states_the_dry_runs_first_curve() -> None:
    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"a preview trains (\d+) steps on the first (\d+) conversations before the main run \(the dry "
                  r"run: first curve about (\d+) minutes after the start on the AVX2-only machine, (\d+) minutes on "
                  r"the AVX-512 one\)", text)
    assert m is not None
    demo = preset("demo")
    avx2, bf16 = _demo(AVX2), _demo(BF16)
    assert [int(g) for g in m.groups()] == [demo.preview.steps, demo.preview.conversations,
                                           round(avx2["first_curve_s"] / 60), round(bf16["first_curve_s"] / 60)]
