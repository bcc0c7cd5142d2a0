"""Write job progress into the database exactly as the worker does (claim, ingest, finish).

The browser tests use this to make a job produce live metrics, events, logs and checkpoints without a
GPU or a trainer process: `service.db.lease` is the worker's own write path, so the API and the dashboard
see the same rows a real run produces. Checkpoint files are real files under the job's artifact dir.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from service.db import lease as lease_db
from service.db import progress as progress_db
from service.db.session import make_engine, make_session_factory, session_scope

__all__ = ["Feeder", "metric_values"]


def metric_values(step: int, depths: int = 3, *, speed: float = 1.0) -> dict[str, float]:
    """Plausible training metrics at `step` (loss falls, accuracies rise with depth decay).

    `speed` scales how fast the run learns (lets compared jobs differ). Every 5th step carries the
    evaluation keys too (eval_loss, eval_tau_sim, eval_acc_d, acceptance_length, al_pos_k).
    """
    x = step * speed
    accs = {f"acc_{d}": round(0.2 + 0.6 * (1 - math.exp(-x / 40)) * 0.8**d, 5) for d in range(depths)}
    tau, prod = 0.0, 1.0
    for d in range(depths):
        prod *= accs[f"acc_{d}"]
        tau += prod
    values = {
        "loss": round(4.0 * math.exp(-x / 60) + 0.5 + 0.05 * math.sin(step), 5),
        **accs,
        "full_acc": round(sum(accs.values()) / depths, 5),
        "tau_sim": round(tau, 5),
        "lr": 1e-3 * min(1.0, step / 10) * (0.5 + 0.5 * math.cos(math.pi * min(step, 1000) / 1000)),
        "grad_norm": 1.0 + 0.1 * math.cos(step),
        "tokens_per_s": 1800.0 + 50 * math.sin(step / 7),
        "time_fetch": 0.01,
        "time_forward": 0.05,
        "time_backward": 0.09,
        "time_optimizer": 0.004,
    }
    if step % 5 == 0:
        values.update({"eval_loss": values["loss"] + 0.2, "eval_tau_sim": round(tau * 0.95, 5),
                       "acceptance_length": round(1.0 + tau * 0.9, 5),
                       **{f"eval_acc_{d}": accs[f"acc_{d}"] * 0.95 for d in range(depths)},
                       **{f"al_pos_{d}": round(accs[f"acc_{d}"] * 0.9, 5) for d in range(depths)}})
    return values


class Feeder:
    """Plays the worker for one database: claim a queued job, then ingest progress batches."""

    def __init__(self, database_url: str, artifact_root: Path) -> None:
        self.engine = make_engine(database_url)
        self.sessions = make_session_factory(self.engine)
        self.artifact_root = artifact_root
        self.leases: dict[str, lease_db.Lease] = {}

    def close(self) -> None:
        self.engine.dispose()

    def claim(self, job_id: str) -> Path:
        """`queued -> running` under a lease; returns the job's artifact dir."""
        run_dir = self.artifact_root / job_id
        run_dir.mkdir(parents=True, exist_ok=True)
        with session_scope(self.sessions) as s:
            lease = lease_db.claim_job(s, job_id, owner="e2e-feeder", lease_seconds=3600, artifact_dir=str(run_dir))
        assert lease is not None, f"job {job_id} is not claimable"
        self.leases[job_id] = lease
        return run_dir

    def ingest(self, job_id: str, **batch: Any) -> None:
        """Write one batch (`metrics=[...]`, `events=[...]`, `logs=[...]`, `checkpoints=[...]`, `progress=`, `phase=`)."""
        with session_scope(self.sessions) as s:
            progress_db.ingest(s, self.leases[job_id], progress_db.Batch(**batch))

    def replay(self, job_id: str, lines: list[str]) -> None:
        """Ingest a trainer's progress lines (`RUN/progress.jsonl`) as the worker's collector files them."""
        from worker.progress import ProgressCollector

        collector = ProgressCollector()
        for line in lines:
            collector.add_line(line)
        with session_scope(self.sessions) as s:
            progress_db.ingest(s, self.leases[job_id], collector.take())

    def phase(self, job_id: str, phase: str) -> None:
        self.ingest(job_id, phase=phase, events=[{"kind": "phase", "phase": phase, "message": f"phase {phase}"}])

    def metrics(self, job_id: str, steps: range, *, total_steps: int, depths: int = 3, t0: float | None = None,
                dt: float = 1.0, speed: float = 1.0) -> None:
        """Metric records for `steps` (+ the job's progress), in one batch."""
        t0 = time.time() - dt * len(steps) if t0 is None else t0
        from datetime import UTC, datetime

        rows = [
            {"step": s, "epoch": s / total_steps, "values": metric_values(s, depths, speed=speed),
             "time": datetime.fromtimestamp(t0 + i * dt, UTC)}
            for i, s in enumerate(steps)
        ]
        last = steps[-1]
        progress = {"step": last, "total_steps": total_steps, "epoch": last / total_steps,
                    "percent": 100.0 * last / total_steps, "seconds_remaining": (total_steps - last) * dt}
        self.ingest(job_id, metrics=rows, progress=progress,
                    logs=[{"level": "info", "message": f"step {last}/{total_steps} loss {rows[-1]['values']['loss']:.4f}"}])

    def checkpoint(self, job_id: str, step: int, *, is_best: bool = True) -> dict[str, Any]:
        """Write a real, complete checkpoint directory and record it; returns its record."""
        run_dir = self.artifact_root / job_id
        rel = f"checkpoints/step_{step:06d}"
        ck_dir = run_dir / rel
        ck_dir.mkdir(parents=True, exist_ok=True)
        blobs = {
            "config.json": json.dumps({"speculators_model_type": "peagle", "step": step}).encode(),
            "model.safetensors": os.urandom(4096 + step),
        }
        files = []
        for name, data in blobs.items():
            (ck_dir / name).write_bytes(data)
            files.append({"path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        metrics = {"tau_sim": 1.5 + step / 100, "acceptance_length": 1.8 + step / 200, "loss": 1.0}
        (ck_dir / "meta.json").write_text(json.dumps({"step": step, "metrics": metrics, "files": files}))
        (ck_dir / "COMPLETE").write_text("")
        state = {"latest": f"step_{step:06d}", "best": f"step_{step:06d}" if is_best else None}
        (run_dir / "checkpoints" / "state.json").write_text(json.dumps(state))
        record = {"step": step, "dir": rel, "files": files, "metrics": metrics, "is_best": is_best}
        self.ingest(job_id, checkpoints=[record],
                    events=[{"kind": "checkpoint", "message": f"checkpoint at step {step}", "data": record}])
        return record

    def finish(self, job_id: str, status: str = "succeeded") -> None:
        with session_scope(self.sessions) as s:
            lease_db.finish(s, self.leases[job_id], status=status, event=("status", f"job {status}"))
