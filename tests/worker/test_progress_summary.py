"""The worker folds the job's headline numbers (measured AL, best held-out tau_sim) into its progress."""

from __future__ import annotations

from worker.progress import ProgressCollector


def test_headline_numbers_follow_the_records_and_survive_later_progress() -> None:
    c = ProgressCollector()
    c.add({"type": "event", "kind": "progress", "step": 4, "total_steps": 8})
    assert "acceptance_length" not in (c.batch.progress or {})
    c.add({"type": "event", "kind": "checkpoint", "step": 4, "is_best": False, "metrics": {"tau_sim": 0.9}})
    assert "best_tau_sim" not in (c.batch.progress or {})  # not the best checkpoint
    c.add({"type": "event", "kind": "checkpoint", "step": 4, "is_best": True, "metrics": {"tau_sim": 0.31}})
    assert c.take().progress == {"phase": "training", "step": 4, "total_steps": 8, "epoch": None, "percent": 50.0,
                                 "seconds_remaining": None, "best_tau_sim": 0.31}
    c.add({"type": "event", "kind": "eval", "step": 8, "metrics": {"acceptance_length": 1.25}})
    assert c.take().progress["acceptance_length"] == 1.25
    c.add({"type": "event", "kind": "progress", "step": 8, "total_steps": 8})
    p = c.take().progress
    assert p["step"] == 8 and p["acceptance_length"] == 1.25 and p["best_tau_sim"] == 0.31
    c.add({"type": "event", "kind": "eval", "metrics": {"engine": "vllm", "vllm_acceptance_length": 1.2}})
    assert c.take().progress["vllm_acceptance_length"] == 1.2


def test_non_finite_al_is_not_a_headline() -> None:
    c = ProgressCollector()
    c.add({"type": "event", "kind": "eval", "metrics": {"acceptance_length": float("nan")}})
    assert c.batch.progress is None


def test_the_training_eta_is_not_measured_from_the_regeneration(monkeypatch) -> None:
    """Regeneration reports conversations with its own estimate; training's rate starts when training does."""
    clock = iter([0.0, 500.0, 600.0, 610.0, 620.0, 630.0])
    monkeypatch.setattr("worker.progress.time.monotonic", lambda: next(clock))
    c = ProgressCollector()
    c.add({"type": "event", "kind": "progress", "phase": "regenerating", "step": 10, "total_steps": 640,
           "regen_seconds_remaining": 900.0})
    p = c.take().progress
    assert (p["phase"], p["step"], p["total_steps"], p["seconds_remaining"]) == ("regenerating", 10, 640, 900.0)
    c.add({"type": "event", "kind": "progress", "phase": "regenerating", "step": 640, "total_steps": 640,
           "regen_seconds_remaining": 0.0})
    c.add({"type": "event", "kind": "progress", "step": 1, "total_steps": 240})  # training starts at t=600
    assert c.take().progress["seconds_remaining"] is None  # no rate yet: not 500 s per conversation
    for step in (2, 3, 4):  # 10 s per step; the smoothed ETA needs 3 steps past the first
        c.add({"type": "event", "kind": "progress", "step": step, "total_steps": 240})
    p = c.take().progress
    assert p["phase"] == "training" and p["seconds_remaining"] == 2360.0


def test_the_training_eta_is_the_smoothed_one(monkeypatch) -> None:
    """Issue 39: the job's time left (what the dashboard shows) is `smoothed_eta`, as in the step lines
    (tests/unit/foundation/test_eta.py holds its band tests)."""
    from peagle.progress import smoothed_eta

    times = [float(t) for t in range(1, 101)] + [400.0 + t for t in range(1, 11)]
    clock = iter(times)
    monkeypatch.setattr("worker.progress.time.monotonic", lambda: next(clock))
    c = ProgressCollector()
    for step in range(1, 111):
        c.add({"type": "event", "kind": "progress", "step": step, "total_steps": 1000})
    left = c.take().progress["seconds_remaining"]
    assert left == round(smoothed_eta(list(zip(times, map(float, range(1, 111)), strict=True)), 1000.0) or 0, 1)
    assert 890 < left < 890 * 6  # a 5-minute evaluation 10 s ago weighs, as it will again
