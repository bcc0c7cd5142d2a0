"""The preview (`peagle.preview`): a short real run on the first conversations before the main run, whose
results it must not change; its metrics are `preview_*`, its answers are the main run's cache entries, a
resumed run skips a finished one, and a SIGTERM during it pauses the job as one in training does."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from peagle.errors import TrainingInterrupted
from peagle.progress import RecordingSink
from peagle.spec import parse_spec, preset
from peagle.spec.metrics import LOSS, is_preview_key, preview_key

PREVIEW = {"conversations": 8, "steps": 3}


def _spec(preview: dict[str, int] | None) -> Any:
    data = preset("tiny").model_dump(mode="json")
    # the target writes the answers (transformers, a few tokens): the preview's answers must be the cache's
    data["data"]["regenerate"] = {"enabled": True, "engine": "hf", "max_new_tokens": 6, "batch_size": 4, "temperature": 1.0,
                                  "on_length": "keep"}
    data["resources"]["target_engine"] = "hf"
    data["eval"]["prompt_sets"] = []  # no AL: the runs compare training, and stay short
    if preview is not None:
        data["preview"] = preview
    return parse_spec(data)


def _main_metrics(sink: RecordingSink) -> list[dict[str, Any]]:
    return [r for r in sink.records if r["type"] == "metric" and not any(map(is_preview_key, r["values"]))]


def _preview_metrics(sink: RecordingSink) -> list[dict[str, Any]]:
    return [r for r in sink.records if r["type"] == "metric" and any(map(is_preview_key, r["values"]))]


def _checkpoint_steps(sink: RecordingSink) -> list[int]:
    return [r["step"] for r in sink.records if r["type"] == "event" and r["kind"] == "checkpoint"]


def _expected_checkpoints(sink: RecordingSink) -> list[int]:
    """The main run's checkpoints (tiny: every 4 steps and the last), none of the preview's (its 3 steps)."""
    total = _main_metrics(sink)[-1]["step"]
    assert total > 3
    return [s for s in range(1, total + 1) if s % 4 == 0 or s == total]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    from peagle.train.checkpoint import find_resumable, load_training_state

    found = find_resumable(run / "checkpoints")
    assert found is not None
    return load_training_state(found)["draft"]


class _PauseAtFirstPreviewStep(RecordingSink):
    """Sends this process SIGTERM at the first preview metric: what the supervisor does for a pause."""

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        super().metric(step, epoch, values)
        if any(map(is_preview_key, values)) and not getattr(self, "sent", False):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def regen_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "regen-cache"
    monkeypatch.setenv("PEAGLE_REGEN_CACHE", str(cache))
    return cache


def test_a_preview_comes_first_and_changes_nothing_of_the_main_run(tmp_path: Path, tiny_target_path: Path,
                                                                     regen_cache: Path) -> None:
    from peagle.pipeline import run_pipeline

    with_preview, sink = tmp_path / "with", RecordingSink()
    run_pipeline(_spec(PREVIEW), with_preview, sink=sink)

    phases = [r["phase"] for r in sink.records if r["type"] == "event" and r["kind"] == "phase"]
    assert phases[:3] == ["validating", "preview", "preparing_data"], phases
    assert phases.count("training") == 1 and phases.count("capturing") == 1  # the preview's are not the job's
    pre = _preview_metrics(sink)
    assert [r["step"] for r in pre] == [1, 2, 3]
    assert all(set(map(is_preview_key, r["values"])) == {True} for r in pre)
    assert preview_key(LOSS) in pre[0]["values"]
    first_main = next(i for i, r in enumerate(sink.records) if r in _main_metrics(sink))
    assert sink.records.index(pre[-1]) < first_main  # the first curve comes before the main run's
    # nothing of the preview is a checkpoint, a data funnel or an evaluation of the job
    assert _checkpoint_steps(sink) == _expected_checkpoints(sink)
    assert len([r for r in sink.records if r["type"] == "event" and r["kind"] == "data"]) == 1
    logs = [r["message"] for r in sink.records if r["type"] == "log"]
    assert any(m.startswith("preview: step 3/3") for m in logs), logs
    assert any(m.startswith("preview: done in ") for m in logs), logs
    done = json.loads((with_preview / "preview" / "done.json").read_text())
    assert done["steps"] == 3 and done["conversations"] == 8

    # the preview's regenerated answers are the main run's cache entries: generated once
    p_regen = json.loads((with_preview / "preview" / "data" / "report.json").read_text())["regeneration"]
    m_regen = json.loads((with_preview / "data" / "report.json").read_text())["regeneration"]
    assert p_regen["generated"] >= 6 and m_regen["cached"] >= p_regen["generated"]
    assert m_regen["generated"] + m_regen["cached"] >= p_regen["generated"] + 10

    # the same spec without a preview (its answers all from the cache now): the same losses and weights
    alone, plain = tmp_path / "alone", RecordingSink()
    run_pipeline(_spec(None), alone, sink=plain)
    assert not _preview_metrics(plain) and not (alone / "preview").exists()
    assert "preview" not in [r["phase"] for r in plain.records if r["type"] == "event" and r["kind"] == "phase"]
    a, b = _main_metrics(sink), _main_metrics(plain)
    assert [r["values"][LOSS] for r in a if LOSS in r["values"]] == [r["values"][LOSS] for r in b if LOSS in r["values"]]
    wa, wb = _final_weights(with_preview), _final_weights(alone)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # a resumed run finds the finished preview and does not run it again
    again = RecordingSink()
    run_pipeline(_spec(PREVIEW), with_preview, sink=again)
    assert not _preview_metrics(again)
    assert any(r["type"] == "log" and r["message"].startswith("preview: done earlier") for r in again.records)


def test_a_pause_during_the_preview_resumes_it(tmp_path: Path, tiny_target_path: Path, regen_cache: Path) -> None:
    from peagle.pipeline import run_pipeline

    run, sink = tmp_path / "run", _PauseAtFirstPreviewStep()
    with pytest.raises(TrainingInterrupted, match="paused at step 1"):
        run_pipeline(_spec(PREVIEW), run, sink=sink)
    assert not (run / "preview" / "done.json").exists()
    assert [r["step"] for r in _preview_metrics(sink)] == [1] and not _main_metrics(sink)
    assert not [r for r in sink.records if r["type"] == "event" and r["kind"] == "checkpoint"]

    resumed = RecordingSink()
    run_pipeline(_spec(PREVIEW), run, sink=resumed)
    assert [r["step"] for r in _preview_metrics(resumed)] == [2, 3]  # from the preview's own checkpoint
    assert (run / "preview" / "done.json").exists()
    assert _checkpoint_steps(resumed) == _expected_checkpoints(resumed)
