"""Turn the trainer's JSON-lines progress stream into database batches (`service.db.progress.Batch`).

The trainer prints one JSON object per line (docs/progress.md): metrics, events (phase,
progress, checkpoint, eval, warning, resumed, export, error) and logs. `ProgressCollector.add` files each
record into the pending batch; `take()` hands the batch over and starts a new one. Progress events update
only the job row (one value, not a history); every other event becomes a `job_event` row.

The evaluations after training (`FINAL_PHASES`) print their numbers twice: the final AL as a metric record,
then the whole evaluation as an `eval` event. They become one metric record (stored once, in the batch of
its event), marked `final` with its phase, which the replay dedup keys on (`service.db.replay`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from peagle.progress import RateHistory
from peagle.run_folder import checkpoint_relpath
from peagle.spec.metrics import (
    ACCEPTANCE_LENGTH,
    LOSS,
    PER_POSITION,
    REGEN_SECONDS_REMAINING,
    TAU_SIM,
    VLLM_ACCEPTANCE_LENGTH,
    al_pos_values,
    eval_key,
    is_measured_al_key,
)
from service.db.lease import Lease
from service.db.progress import Batch, CheckpointMetrics, MetricRecord
from service.db.replay import FINAL_PHASES, PREVIEW, metric_kind

__all__ = ["ProgressCollector", "Recovered", "parse_line", "recover"]

_MAX_MESSAGE = 8000
#: The numbers an eval event's default message shows.
_EVAL_SUMMARY = (eval_key(LOSS), eval_key(TAU_SIM), TAU_SIM, ACCEPTANCE_LENGTH)


def parse_line(line: str) -> dict[str, Any] | None:
    """Parse one stdout line: a progress record (dict with `type`), or None for any other text."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("type"), str) else None


def _when(rec: dict[str, Any]) -> datetime:
    t = rec.get("time")
    if isinstance(t, int | float) and math.isfinite(t):
        return datetime.fromtimestamp(float(t), UTC)
    return datetime.now(UTC)


def _finite_values(values: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(values, dict):
        for k, v in values.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v)):
                out[str(k)] = float(v)
    return out


def _eval_values(metrics: dict[str, Any]) -> dict[str, float]:
    """An eval record's finite numbers, with its `per_position` list spread into `al_pos_{k}` keys."""
    values = _finite_values(metrics)
    per_pos = metrics.get(PER_POSITION)
    if isinstance(per_pos, list):
        values.update(_finite_values(al_pos_values(per_pos)))
    return values


class ProgressCollector:
    """Accumulates records into a `Batch`; remembers the phase, last error and checkpoints seen."""

    def __init__(self) -> None:
        self.batch = Batch()
        self.phase: str | None = None
        self.last_error: dict[str, Any] | None = None
        self.last_checkpoint_step: int | None = None
        self.checkpoints_seen = 0
        self.last_metric_step: int | None = None
        self._rate = RateHistory()  # (monotonic time, step) since the first progress of the phase
        self._rate_phase: str | None = None  # the phase those steps were counted in
        self._last_progress: dict[str, Any] = {}
        #: the numbers the jobs list shows beside the progress bar (docs/progress.md 5): the latest
        #: measured AL (reference decoder and vLLM) and the best checkpoint's held-out tau_sim
        self.summary: dict[str, float] = {}
        #: a final evaluation's metric record, held until its eval event (module docstring)
        self._held: MetricRecord | None = None

    def __len__(self) -> int:
        b = self.batch
        return len(b.metrics) + len(b.events) + len(b.logs) + len(b.checkpoints)

    def take(self) -> Batch:
        """The pending batch (possibly empty); a fresh one starts."""
        batch, self.batch = self.batch, Batch()
        return batch

    def discard_held(self) -> None:
        """Drop a held final metric record (the supervisor's recovery: its eval event was never printed)."""
        self._held = None

    def release(self) -> None:
        """File a held final metric record whose eval event never came (the trainer ended, or moved on)."""
        held, self._held = self._held, None
        if held is not None:
            self.batch.metrics.append(held)

    def log(self, level: str, message: str, when: datetime | None = None) -> None:
        """Append a log line (stderr, non-JSON stdout, supervisor notes)."""
        self.batch.logs.append(
            {"level": level, "message": message[:_MAX_MESSAGE], "time": when or datetime.now(UTC)}
        )

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        """Append a supervisor event (attempt started, stop requested, ...)."""
        self.batch.events.append({"kind": kind, "phase": self.phase, "message": message[:_MAX_MESSAGE],
                                  "data": data or {}, "time": datetime.now(UTC)})

    def add_line(self, line: str) -> None:
        """File one stdout line (a record, or plain text kept as an info log)."""
        rec = parse_line(line)
        if rec is None:
            text = line.rstrip("\n")
            if text.strip():
                self.log("info", text)
            return
        self.add(rec)

    def add(self, rec: dict[str, Any]) -> None:
        """File one parsed progress record."""
        kind = rec.get("type")
        when = _when(rec)
        if kind == "metric":
            step = rec.get("step")
            if not isinstance(step, int):
                return
            epoch = rec.get("epoch")
            record = MetricRecord(step=step, epoch=float(epoch) if isinstance(epoch, int | float) else None,
                                  values=_finite_values(rec.get("values")), time=when)
            self.last_metric_step = step
            if self.phase in FINAL_PHASES and self.phase is not None:  # its numbers come again in its eval event
                self.release()
                record["final"] = self.phase
                self._held = record
                return
            self.batch.metrics.append(record)
        elif kind == "log":
            self.log(str(rec.get("level") or "info"), str(rec.get("message") or ""), when)
        elif kind == "event":
            self._event(rec, when)

    def _event(self, rec: dict[str, Any], when: datetime) -> None:
        kind = str(rec.get("kind") or "event")
        data = {k: v for k, v in rec.items() if k not in ("type", "time", "kind", "message")}
        message = str(rec.get("message") or "")
        if kind == "progress":
            self._last_progress = self._progress(rec)
            self.batch.progress = {**self._last_progress, **self.summary}
            return
        if kind == "phase":
            self.release()
            self.phase = str(rec.get("phase") or "") or None
            self.batch.phase = self.phase
            message = message or f"phase: {self.phase}"
        elif kind == "checkpoint":
            step = int(rec.get("step") or 0)
            self.batch.checkpoints.append({
                "step": step, "dir": str(rec.get("dir") or checkpoint_relpath(step)),
                "files": rec.get("files") or [], "metrics": _finite_values(rec.get("metrics")),
                "is_best": bool(rec.get("is_best")),
            })
            self.last_checkpoint_step = step
            self.checkpoints_seen += 1
            tau = _finite_values(rec.get("metrics")).get(TAU_SIM)
            if rec.get("is_best") and tau is not None:
                self._summarise({"best_tau_sim": tau})
            message = message or f"checkpoint saved at step {step}" + (" (best so far)" if rec.get("is_best") else "")
        elif kind == "error":
            self.last_error = {"code": rec.get("code"), "message": message}
        elif kind == "eval":
            self._eval_metrics(rec, when)
            raw = rec.get("metrics")
            found = _eval_values(raw if isinstance(raw, dict) else {})
            self._summarise({k: found[k] for k in (ACCEPTANCE_LENGTH, VLLM_ACCEPTANCE_LENGTH) if k in found})
            self._checkpoint_eval(rec)
            if not message:
                shown = {k: v for k, v in _finite_values(rec.get("metrics")).items()
                         if k in _EVAL_SUMMARY}
                at = f" at step {rec['step']}" if isinstance(rec.get("step"), int) else ""
                message = f"evaluation{at}: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
        self.batch.events.append({"kind": kind, "phase": self.phase, "message": message[:_MAX_MESSAGE],
                                  "data": data, "time": when})

    def _summarise(self, values: dict[str, float]) -> None:
        """Fold headline numbers into the job's `progress` (written with this batch)."""
        if values:
            self.summary.update(values)
            self.batch.progress = {**self._last_progress, **self.summary}

    def _checkpoint_eval(self, rec: dict[str, Any]) -> None:
        """An eval naming `checkpoint_step` (the pipeline's final AL of the best checkpoint, the serve
        check) is also recorded on that checkpoint: its measured AL keys into the checkpoint's metrics, its
        `evaluation` object (engine, AL per prompt set, serving speedup, hardware) into its evaluation, its
        `files` (the parity record written into the checkpoint's folder) into its files."""
        step = rec.get("checkpoint_step")
        raw = rec.get("metrics")
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(raw, dict):
            return
        values = {k: v for k, v in _eval_values(raw).items() if is_measured_al_key(k)}
        evaluation = rec.get("evaluation")
        entry = CheckpointMetrics(step=step, metrics=values)
        if isinstance(evaluation, dict) and evaluation:
            entry["evaluation"] = evaluation
        files = [f for f in rec.get("files") or [] if isinstance(f, dict) and isinstance(f.get("path"), str)]
        if files:  # written into its folder after the save (the parity record): its download carries them
            entry["files"] = files
        if values or "evaluation" in entry or "files" in entry:
            self.batch.checkpoint_metrics.append(entry)

    def _eval_metrics(self, rec: dict[str, Any], when: datetime) -> None:
        """Evaluation results are metric keys too (`eval_*`, `acceptance_length`, `al_pos_{k}`): store
        them as a metric record at the eval's step (the last training step when it names none). A final
        evaluation's event takes in the metric record held before it (one record, module docstring)."""
        raw = rec.get("metrics")
        values = _eval_values(raw if isinstance(raw, dict) else {})
        step = rec.get("step") if isinstance(rec.get("step"), int) else self.last_metric_step
        epoch: float | None = None
        held, self._held = self._held, None
        if held is not None and held["step"] == step:
            values, epoch = {**held["values"], **values}, held["epoch"]
        elif held is not None:
            self.batch.metrics.append(held)
        if values and step is not None:
            record = MetricRecord(step=step, epoch=epoch, values=values, time=when)
            if self.phase in FINAL_PHASES and self.phase is not None:
                record["final"] = self.phase
            self.batch.metrics.append(record)

    def _progress(self, rec: dict[str, Any]) -> dict[str, Any]:
        """The job's progress summary from a `progress` event. Training counts optimizer steps; a phase that
        reports its own progress (`phase: regenerating`: conversations done of total) counts its units, and
        the rate behind `seconds_remaining` restarts whenever that phase changes (the training ETA is
        never measured from the regeneration's start). Training's is `peagle.progress.smoothed_eta`, as in
        the trainer's step lines."""
        step = int(rec.get("step") or 0)
        total = rec.get("total_steps")
        total = int(total) if isinstance(total, int | float) and total > 0 else None
        phase = str(rec.get("phase") or "training")
        now = time.monotonic()
        if self._rate_phase != phase:
            self._rate, self._rate_phase = RateHistory(), phase
        self._rate.add(now, step)
        remaining = None
        own = rec.get(REGEN_SECONDS_REMAINING) if phase == "regenerating" else None
        if isinstance(own, int | float) and not isinstance(own, bool):
            remaining = round(float(own), 1)
        elif total is not None and phase != "regenerating":
            eta = self._rate.eta(total, now=now)
            remaining = None if eta is None else round(eta, 1)
        return {
            "phase": phase, "step": step, "total_steps": total, "epoch": rec.get("epoch"),
            "percent": round(100.0 * step / total, 2) if total else None,
            "seconds_remaining": remaining,
        }


@dataclass(frozen=True)
class Recovered:
    """What `recover` filed: the floors and stored final evaluations the attempt continues with."""

    metric_floor: int | None
    eval_floor: int | None
    final_evaluations: frozenset[str]
    records: int


def recover(*, path: Path, lease: Lease, collector: ProgressCollector, redact: Callable[[Any], Any]
            ) -> Recovered | None:
    """File into `collector` what a killed attempt printed to RUN/progress.jsonl (`path`) but never stored.

    A trainer killed between printing a record and the supervisor's next flush leaves a newer checkpoint
    on disk than metrics in the database; the resumed trainer restarts after that checkpoint, so those
    steps would be a gap. Metrics above the lease's floors and unknown checkpoints are filed (dedup on
    (step, kind)), and the floors rise to what was filed (the resumed trainer's replays are then dropped).
    An evaluation after training (`FINAL_PHASES`, e.g. a crash during `evaluating` after the final AL was
    printed) is filed once if its phase's evaluation is not stored yet. None when there is no file.

    Args:
        path: RUN/progress.jsonl (every attempt appends to it).
        lease: the new attempt's lease (its floors, latest checkpoint and stored final evaluations).
        collector: receives the records (redacted).
        redact: what a record becomes before it is filed (`Redactor.value`).
    """
    if not path.exists():
        return None
    floor, eval_floor = lease.metric_floor, lease.eval_floor
    seen: set[tuple[int, tuple[str, ...]]] = set()
    known = lease.latest_checkpoint_step
    top, top_eval = floor, eval_floor
    phase: str | None = None  # the phase each record was printed in
    finals: set[str] = set()
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            rec = parse_line(line)
            if rec is None:
                continue
            if rec["type"] == "event" and rec.get("kind") == "phase":
                phase = str(rec.get("phase") or "") or None
                continue
            if phase in FINAL_PHASES:
                if phase not in finals | lease.final_evaluations and (rec["type"] == "metric" or rec.get("kind") == "eval"):
                    collector.phase = phase  # the collector marks and merges what it files
                    collector.add(redact(rec))
                    if rec.get("kind") == "eval":
                        finals.add(str(phase))
                continue
            if rec["type"] == "metric" and metric_kind(rec.get("values") or {}) == PREVIEW:
                continue  # the preview's (its own steps, no floor): a lost one is not worth a duplicate
            if rec["type"] == "metric" and isinstance(rec.get("step"), int):
                key = (rec["step"], tuple(sorted((rec.get("values") or {}).keys())))
                if (floor is None or rec["step"] > floor) and key not in seen:
                    seen.add(key)
                    collector.add(redact(rec))
                    top = rec["step"] if top is None else max(top, rec["step"])
            elif rec["type"] == "event" and rec.get("kind") == "checkpoint" and int(rec.get("step") or 0) > (known or 0):
                collector.add(redact(rec))
            elif rec["type"] == "event" and rec.get("kind") == "eval" and isinstance(rec.get("step"), int) \
                    and (eval_floor is None or rec["step"] > eval_floor):
                key = (rec["step"], ("eval",))
                if key not in seen:
                    seen.add(key)
                    collector.add(redact(rec))
                    top_eval = rec["step"] if top_eval is None else max(top_eval, rec["step"])
    collector.phase = None
    collector.discard_held()  # a final record whose event was never printed: measured again
    count = len(seen) + len(finals)
    if count:
        collector.log("warning", f"recovered {count} metric record(s) of the previous attempt from progress.jsonl "
                                 f"(up to step {max(top or 0, top_eval or 0)})")
    return Recovered(metric_floor=top, eval_floor=top_eval, final_evaluations=lease.final_evaluations | frozenset(finals),
                     records=count)
