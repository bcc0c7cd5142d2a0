"""Issue 20: measured AL is a live series (periodic and at every checkpoint), numbers are rounded and
labelled in messages, and a data error stays under the phase it happened in."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from peagle.errors import DataInvalidError
from peagle.pipeline import run_pipeline
from peagle.progress import RecordingSink
from peagle.spec import TrainSpec, parse_spec, preset


def _tiny(**eval_: Any) -> TrainSpec:
    data = preset("tiny").model_dump(mode="json")
    data["eval"].update(eval_)
    return parse_spec(data)


def test_spec_fields_are_checked() -> None:
    assert preset("demo").eval.al_every_steps == 240 and preset("tiny").eval.al_every_steps is None
    data = preset("tiny").model_dump(mode="json")
    data["eval"].update(prompt_sets=[], al_every_steps=5)
    with pytest.raises(Exception, match=r"eval\.al_every_steps: needs at least one eval\.prompt_sets entry"):
        parse_spec(data)


def test_al_is_measured_during_training_and_at_every_checkpoint(tmp_path: Path, tiny_target_path: Path) -> None:
    sink = RecordingSink()
    spec = _tiny(al_every_steps=3, al_num_prompts=1)  # checkpoints every 4 steps (tiny preset)
    run_pipeline(spec, tmp_path / "run", sink=sink)
    recs: list[dict[str, Any]] = sink.records
    total = max(r["step"] for r in recs if r["type"] == "metric")
    metric_al = {r["step"] for r in recs if r["type"] == "metric" and "acceptance_length" in r["values"]}
    assert set(range(3, total + 1, 3)) <= metric_al
    cks = [r for r in recs if r.get("kind") == "checkpoint"]
    assert cks and all("acceptance_length" in c["metrics"] for c in cks)
    # a checkpoint's AL measured off the periodic grid is an eval record of its own (a point on the chart)
    eval_al = {r["step"] for r in recs if r.get("kind") == "eval" and "step" in r
               and "acceptance_length" in r["metrics"]}
    assert eval_al == {c["step"] for c in cks} - set(range(3, total + 1, 3))
    done = next(r for r in recs if r.get("kind") == "phase" and r["phase"] == "done")
    assert re.fullmatch(r"done: AL \d+\.\d\d \(reference decoder, humaneval, 2 prompts\) \(step_\d{6}\)",
                        done["message"]), done["message"]
    logs = [r["message"] for r in recs if r["type"] == "log" and "AL" in r["message"]]
    assert any(re.search(r"humaneval \(2 prompts, reference decoder\): AL \d+\.\d\d,", m) for m in logs), logs


def test_a_data_error_stays_under_preparing_data(tmp_path: Path, tiny_target_path: Path) -> None:
    data = preset("tiny").model_dump(mode="json")
    data["data"]["min_assistant_tokens"] = 100_000  # every conversation is skipped
    sink = RecordingSink()
    with pytest.raises(DataInvalidError):
        run_pipeline(parse_spec(data), tmp_path / "run", sink=sink)
    phases = [r["phase"] for r in sink.records if r.get("kind") == "phase"]
    assert phases[-1] == "preparing_data", phases
