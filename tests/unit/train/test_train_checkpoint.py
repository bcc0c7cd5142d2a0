"""Crash-safe checkpoints: completeness, truncation, retention, best selection; schedule and sinks."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_spec

from peagle.errors import CheckpointError
from peagle.progress import JsonlSink, MultiSink, NullSink, RecordingSink
from peagle.train.checkpoint import (
    find_resumable,
    load_training_state,
    read_state,
    save_checkpoint,
    verify_checkpoint,
)
from peagle.train.optim import LRSchedule, total_steps


def _save(root: Path, step: int, tau: float, **kw: object) -> Path:
    def writer(tmp: Path, draft: object) -> None:
        (tmp / "config.json").write_text('{"x": 1}')
        (tmp / "model.safetensors").write_bytes(b"weights" * 10)

    info = save_checkpoint(root, step=step, epoch=step / 10, training_state={"step": step, "w": torch.ones(3)},
                           metrics={"tau_sim": tau, "loss": 1.0}, extra_writer=writer, **kw)
    return info.path


def test_checkpoint_layout_and_resume_choice(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _save(root, 2, 0.5)
    p4 = _save(root, 4, 0.4)
    assert sorted(x.name for x in p4.iterdir()) == [
        "COMPLETE", "config.json", "meta.json", "model.safetensors", "training_state.pt"]
    meta = json.loads((p4 / "meta.json").read_text())
    assert meta["step"] == 4 and {f["path"] for f in meta["files"]} == {
        "config.json", "model.safetensors", "training_state.pt"}
    assert find_resumable(root) == p4
    assert load_training_state(p4)["step"] == 4
    state = read_state(root)
    assert state["latest"] == "step_000004" and state["best"] == "step_000002"


def test_truncated_or_incomplete_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    p2 = _save(root, 2, 0.1)
    p4 = _save(root, 4, 0.2)
    blob = (p4 / "training_state.pt").read_bytes()
    (p4 / "training_state.pt").write_bytes(blob[: len(blob) // 2])  # truncated after COMPLETE
    warnings: list[str] = []
    assert find_resumable(root, warn=warnings.append) == p2
    assert "bytes" in warnings[0]
    with pytest.raises(CheckpointError):
        load_training_state(p4)
    # a crash while saving leaves a tmp dir (no COMPLETE): ignored
    (root / ".tmp-step_000006-1").mkdir()
    (root / ".tmp-step_000006-1" / "training_state.pt").write_bytes(b"partial")
    (p2 / "COMPLETE").unlink()
    assert verify_checkpoint(p2) and find_resumable(root) is None
    # same size, flipped bytes: the sha256 check catches it
    p8 = _save(root, 8, 0.3)
    data = bytearray((p8 / "model.safetensors").read_bytes())
    data[0] ^= 0xFF
    (p8 / "model.safetensors").write_bytes(bytes(data))
    assert find_resumable(root) is None
    assert find_resumable(root, check_hash=False) == p8


def test_keep_last_plus_best(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _save(root, 1, 0.9, keep_last=2)  # best by tau_sim
    for step, tau in [(2, 0.1), (3, 0.2), (4, 0.3)]:
        _save(root, step, tau, keep_last=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000001", "step_000003", "step_000004"]
    state = read_state(root)
    assert state["best"] == "step_000001" and state["best_metric"] == {"tau_sim": 0.9}
    _save(root, 5, 0.1, keep_last=1, select_best_by="loss")  # loss ties: keeps the previous best
    assert not list(root.glob(".tmp-*"))


def test_lr_schedule_shapes() -> None:
    cos = LRSchedule(kind="cosine", warmup=10, total=110, min_ratio=0.1)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    lin = LRSchedule(kind="linear", warmup=0, total=100, min_ratio=0.0)
    assert lin(50) == pytest.approx(0.5)
    assert LRSchedule(kind="constant", warmup=0, total=5, min_ratio=0.0)(4) == 1.0
    spec = tiny_spec(optim={"epochs": 3, "grad_accumulation": 2})
    assert total_steps(spec.optim, 5) == math.ceil(15 / 2)


def test_sinks_write_json_lines(tmp_path: Path) -> None:
    stream = io.StringIO()
    rec = RecordingSink()
    sink = MultiSink(JsonlSink(stream), JsonlSink(tmp_path / "p.jsonl"), rec, NullSink())
    sink.metric(3, 0.5, {"loss": 1.5, "bad": float("nan")})
    sink.event("checkpoint", step=3, dir="checkpoints/step_000003", files=[], is_best=True)
    sink.log("info", "hello")
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [x["type"] for x in lines] == ["metric", "event", "log"]
    assert lines[0]["values"] == {"loss": 1.5, "bad": None} and isinstance(lines[0]["time"], float)
    assert lines[1]["kind"] == "checkpoint" and lines[1]["is_best"] is True
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 3 and len(rec.records) == 3


def test_a_resumed_stream_starts_at_the_newest_complete_checkpoints_micro_batch(tmp_path):
    from peagle.pipeline import _resume_micro_batch

    run = tmp_path / "run"
    assert _resume_micro_batch(run, 4) == 0  # no checkpoint: from the start
    _save(run / "checkpoints", 3, 0.5)
    _save(run / "checkpoints", 6, 0.4)
    assert _resume_micro_batch(run, 4) == 24  # step 6 with grad_accumulation 4
    (run / "checkpoints" / "step_000006" / "training_state.pt").write_bytes(b"cut")  # truncated: step 3's
    assert _resume_micro_batch(run, 1) == 3
