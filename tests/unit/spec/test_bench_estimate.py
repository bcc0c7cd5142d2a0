"""`bench.bench_estimate`: the estimate of a finished run's spec against its measured phases (issue 20)."""

from __future__ import annotations

import json
from pathlib import Path

from api.estimate import estimate
from bench.bench_estimate import measure
from peagle.spec import preset

ORDER = ("validating", "preparing_data", "capturing", "training", "evaluating", "exporting")


def _run(tmp_path: Path, slow: float) -> Path:
    spec = preset("demo")
    est = estimate(spec, dataset_rows={}, queue="bench", queue_position=0)["phase_seconds"]
    secs = {"validating": 0.0, **{p: est[p] * slow for p in est}}
    t, lines = 1000.0, []
    for phase in (*ORDER, "done"):
        lines.append(json.dumps({"type": "event", "time": t, "kind": "phase", "phase": phase}))
        t += secs.get(phase, 0.0)
    (tmp_path / "progress.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "resolved_spec.json").write_text(json.dumps(spec.model_dump(mode="json")))
    return tmp_path


def test_estimate_of_a_run_that_took_what_the_model_says_passes(tmp_path: Path) -> None:
    rep = measure(_run(tmp_path, 1.0))
    assert rep["estimate_over_measured_ratio"] == 1.0 and rep["pass"]
    assert rep["phases"]["training"]["ratio"] == 1.0


def test_a_run_twice_as_slow_misses(tmp_path: Path) -> None:
    rep = measure(_run(tmp_path, 2.0))
    assert rep["estimate_over_measured_ratio"] == 0.5 and not rep["pass"]
