"""The preview's metric records (`preview_*`, steps from 1 again) beside the main run's: a kind of their own
for the replay dedup (never a floor, never a replay) and left out of the recovery from RUN/progress.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from service.db.lease import Lease
from service.db.replay import EVAL, PREVIEW, TRAIN, metric_kind, replayed
from worker.progress import ProgressCollector, recover


def test_preview_records_are_their_own_kind_and_never_a_replay() -> None:
    assert metric_kind({"preview_loss": 1.0, "preview_acc_0": 0.2}) == PREVIEW
    assert metric_kind({"loss": 1.0}) == TRAIN and metric_kind({"eval_loss": 1.0}) == EVAL
    # a main run's floor at step 30 drops its own replays, never a preview step below it
    assert replayed({"step": 12, "values": {"loss": 1.0}}, 30, 30)
    assert not replayed({"step": 12, "values": {"preview_loss": 1.0}}, 30, 30)


def test_recovery_leaves_the_preview_records_out(tmp_path: Path) -> None:
    lines = [
        {"type": "event", "kind": "phase", "phase": "preview"},
        *({"type": "metric", "step": s, "epoch": 1.0, "values": {"preview_loss": 3.0 - s / 10}} for s in (1, 2, 3)),
        {"type": "event", "kind": "phase", "phase": "training"},
        *({"type": "metric", "step": s, "epoch": 0.1, "values": {"loss": 2.0}} for s in (1, 2)),
    ]
    path = tmp_path / "progress.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    lease = Lease(job_id="job_x", owner="w", attempt=2, metric_floor=None, queue="cpu", spec={}, max_restarts=2,
                  latest_checkpoint_step=None)
    collector = ProgressCollector()
    found = recover(path=path, lease=lease, collector=collector, redact=lambda r: r)
    assert found is not None and found.metric_floor == 2
    assert [m["values"] for m in collector.take().metrics] == [{"loss": 2.0}, {"loss": 2.0}]
