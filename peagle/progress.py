"""Progress reporting: the `ProgressSink` protocol, its JSON-lines implementations and the progress log.

Every library stage (data preparation and regeneration, the target, training, evaluation) reports through
a sink; this module stands below all of them (it imports only `peagle.spec`).

Every record is one JSON object per line with `"type"` (`metric`, `event`, `log`) and `"time"` (unix
seconds). The trainer only talks to a sink; the worker reads the JSON lines from the trainer's stdout
(`--progress-jsonl -`) and RUN/progress.jsonl keeps the same records. `peagle` never knows who listens.

    >>> sink = MultiSink(JsonlSink(sys.stdout), JsonlSink(run / "progress.jsonl"))
    >>> sink.metric(12, 0.4, {"loss": 2.1, "acc_0": 0.5})
    >>> sink.event("checkpoint", step=100, dir="checkpoints/step_000100", is_best=True)
    >>> sink.log("info", "resumed from step 100")

Progress in the job log: metrics and events go to charts and the events table; someone following the log
(`peagle jobs logs JOB --follow`, the dashboard's Logs panel) should still see a living job. `ProgressLog`
forwards every record unchanged and adds an `info` log line

- on every `phase` event: `phase training: training 240 steps from step 0`;
- on `progress` events (after an optimizer step), at most one line every `every_s` seconds, plus the first
  step this process runs and the last step of the run:
  `step 12/240 (5%) loss 2.134 tau_sim 1.231 tokens/s 910 eta 4m10s` (`tau_sim` when the step reported
  it; `eta` is `smoothed_eta` of the steps run since the first step of this process, once 3 steps ran).

    sink = ProgressLog(MultiSink(JsonlSink(sys.stdout), ...))   # what `run_pipeline` does

Progress for a person (`peagle train`, `peagle eval`): `ConsoleSink` writes the log lines to stderr, plain
when it is piped, and on a terminal also draws a tqdm bar for every phase that reports `progress` events
(training steps, regenerated conversations, evaluated prompt sets).

    sink = MultiSink(JsonlSink(run / "progress.jsonl"), ConsoleSink(sys.stderr, bar=sys.stderr.isatty()))
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from peagle.spec.metrics import LOSS, TAU_SIM, TOKENS_PER_S

__all__ = ["ETA_HALF_LIFE_S", "ETA_MIN_SAMPLES", "LOG_EVERY_S", "ConsoleSink", "JsonlSink", "MultiSink", "NullSink",
           "ProgressLog", "ProgressSink", "RateHistory", "RecordingSink", "format_duration", "smoothed_eta"]


@runtime_checkable
class ProgressSink(Protocol):
    """Where the trainer reports metrics, events and log lines."""

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None: ...

    def event(self, kind: str, **fields: Any) -> None: ...

    def log(self, level: str, message: str) -> None: ...


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf floats become None (JSON has no NaN), tensors/numpy scalars become floats."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _RecordSink:
    """Builds the records; subclasses decide where they go (`_emit`)."""

    def _emit(self, record: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        """A `metric` record: `{"type":"metric","step":..,"epoch":..,"values":{..}}`."""
        self._emit({"type": "metric", "time": time.time(), "step": int(step), "epoch": float(epoch),
                    "values": _clean(values)})

    def event(self, kind: str, **fields: Any) -> None:
        """An `event` record of `kind` (phase, progress, checkpoint, eval, warning, resumed, export, error)."""
        self._emit({"type": "event", "time": time.time(), "kind": kind, **_clean(fields)})

    def log(self, level: str, message: str) -> None:
        """A `log` record (`info`, `warning`, `error`, `debug`)."""
        self._emit({"type": "log", "time": time.time(), "level": level, "message": message})


class JsonlSink(_RecordSink):
    """Writes one JSON line per record to a text stream or (appending) to a file path; flushes each line."""

    def __init__(self, target: IO[str] | str | Path) -> None:
        if isinstance(target, str | Path):
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            self._stream: IO[str] = Path(target).open("a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._owned = True
        else:
            self._stream = target
            self._owned = False

    def _emit(self, record: dict[str, Any]) -> None:
        self._stream.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Close the file if this sink opened it."""
        if self._owned:
            self._stream.close()


class RecordingSink(_RecordSink):
    """Keeps records in `.records` (tests, and callers that want the last metrics)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def _emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)


class MultiSink:
    """Fans every record out to several sinks."""

    def __init__(self, *sinks: ProgressSink) -> None:
        self.sinks = list(sinks)

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        for s in self.sinks:
            s.metric(step, epoch, values)

    def event(self, kind: str, **fields: Any) -> None:
        for s in self.sinks:
            s.event(kind, **fields)

    def log(self, level: str, message: str) -> None:
        for s in self.sinks:
            s.log(level, message)


class NullSink:
    """Discards everything (the default when nobody listens)."""

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        pass

    def event(self, kind: str, **fields: Any) -> None:
        pass

    def log(self, level: str, message: str) -> None:
        pass


# --------------------------------------------------------------------------------------------------
# The smoothed ETA
# --------------------------------------------------------------------------------------------------

#: Half-life of the ETA's rate: an interval of progress this many seconds older than the latest sample
#: counts half as much.
ETA_HALF_LIFE_S = 600.0
#: Intervals that made progress before there is an ETA at all.
ETA_MIN_SAMPLES = 3


def smoothed_eta(samples: Sequence[tuple[float, float]], total: float, *, now: float | None = None,
                 half_life_s: float = ETA_HALF_LIFE_S, min_samples: int = ETA_MIN_SAMPLES) -> float | None:
    """Seconds left until `total` units are done, from an exponentially weighted rate of progress.

    The ETA of training steps (`ProgressLog`, the worker's job summary) and of regeneration
    (`peagle.data.regen_progress`). The rate is ``sum(w_i * dd_i) / sum(w_i * dt_i)`` over the intervals
    between consecutive samples, each weighted ``w_i = 2 ** (-age_i / half_life_s)`` where ``age_i`` is the
    seconds from the interval's end to the last sample (or `now`): recent progress decides the rate, a slow
    start or a pause fades out, and bursts (a batch finishing at once) are averaged over the window instead
    of swinging the ETA. The first sample is the origin: pass the first progress, not the start of a warm-up
    (an engine start or the first step's compilation would otherwise weigh on every early estimate).

    Example: a batch of 8 every 60 s after a 10-minute first batch: samples (600, 8), (660, 16), (720, 24),
    (780, 32) of 200 give 8/60 units/s and 1260 s left; with the start (0, 0) as the origin it reads 3807 s (the
    plain average since the start: 4095 s).

    Args:
        samples: (clock seconds, units done) pairs, oldest first; times and counts never decrease.
        total: units in all.
        now: the clock now; past the last sample, the time without progress counts as a slower interval.
        half_life_s: the rate's half-life.
        min_samples: intervals that made progress needed before an estimate.

    Returns:
        Seconds left (0 when done), or None while fewer than `min_samples` intervals made progress or the
        weighted rate is 0.
    """
    if len(samples) < 2:
        return None
    t_last, d_last = samples[-1]
    if d_last >= total:
        return 0.0
    points = list(samples)
    if now is not None and now > t_last:
        points.append((now, d_last))
        t_last = now
    moved = weighted_units = weighted_time = 0.0
    for (t0, d0), (t1, d1) in pairwise(points):
        w = 0.5 ** ((t_last - t1) / half_life_s)
        weighted_units += w * (d1 - d0)
        weighted_time += w * (t1 - t0)
        moved += d1 > d0
    if moved < min_samples or weighted_units <= 0 or weighted_time <= 0:
        return None
    return (total - d_last) * weighted_time / weighted_units


class RateHistory:
    """The samples `smoothed_eta` reads: (clock, done) when `done` moves, dropping those older than 10
    half-lives (their weight is under 0.1%) while `min_samples` intervals remain.

        history = RateHistory()
        history.add(clock(), done)           # on every progress
        history.eta(total, now=clock())      # seconds left, or None
    """

    def __init__(self, *, half_life_s: float = ETA_HALF_LIFE_S, min_samples: int = ETA_MIN_SAMPLES) -> None:
        self.half_life_s, self.min_samples = half_life_s, min_samples
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, done: float) -> None:
        """A progress sample; one that did not move (or went back: a new origin) replaces nothing."""
        if self.samples and done < self.samples[-1][1]:
            self.samples.clear()
        if self.samples and done == self.samples[-1][1]:
            return
        self.samples.append((now, done))
        while len(self.samples) > self.min_samples + 2 and now - self.samples[1][0] > 10 * self.half_life_s:
            self.samples.popleft()

    def eta(self, total: float, *, now: float | None = None) -> float | None:
        """`smoothed_eta` of the samples."""
        return smoothed_eta(self.samples, total, now=now, half_life_s=self.half_life_s, min_samples=self.min_samples)


# --------------------------------------------------------------------------------------------------
# The progress log
# --------------------------------------------------------------------------------------------------


#: Seconds between two progress lines in the log (the first and last step always get one).
LOG_EVERY_S = 15.0


def format_duration(seconds: float) -> str:
    """`75` -> `1m15s`, `3725` -> `1h02m`, `9` -> `9s`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(float(value)) else None


class ProgressLog:
    """Forwards to `sink`; adds phase and rate-limited step lines as `log` records (module docstring).

    Args:
        sink: where every record goes.
        every_s: least seconds between two step lines.
        clock: monotonic seconds (injected by tests).
    """

    def __init__(self, sink: ProgressSink, *, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sink, self.every_s, self.clock = sink, every_s, clock
        self._values: dict[str, float] = {}
        self._rate = RateHistory()  # (clock, step) since the first step seen
        self._last_line: float | None = None

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        self.sink.metric(step, epoch, values)
        if LOSS in values:  # a training step's record (eval and AL records carry other keys)
            self._values = dict(values)

    def event(self, kind: str, **fields: Any) -> None:
        self.sink.event(kind, **fields)
        if kind == "phase":
            message = fields.get("message")
            self.sink.log("info", f"phase {fields.get('phase')}" + (f": {message}" if message else ""))
        elif kind == "progress" and "phase" not in fields:  # training steps (regeneration logs its own lines)
            self._progress(fields)

    def log(self, level: str, message: str) -> None:
        self.sink.log(level, message)

    def _progress(self, fields: dict[str, Any]) -> None:
        step, total = fields.get("step"), fields.get("total_steps")
        if not isinstance(step, int) or not isinstance(total, int):
            return
        now = self.clock()
        first = not self._rate.samples
        self._rate.add(now, step)
        due = first or step >= total or self._last_line is None or now - self._last_line >= self.every_s
        if due:
            self._last_line = now
            self.sink.log("info", self.line(step, total, now))

    def line(self, step: int, total: int, now: float) -> str:
        """The step line for `step` of `total` at clock `now`."""
        parts = [f"step {step}/{total} ({100 * step // max(total, 1)}%)"]
        for key, label, fmt in ((LOSS, "loss", "{:.4g}"), (TAU_SIM, "tau_sim", "{:.3f}"),
                                (TOKENS_PER_S, "tokens/s", "{:.0f}")):
            value = _num(self._values.get(key))
            if value is not None:
                parts.append(f"{label} {fmt.format(value)}")
        eta = self.eta(total, now) if step < total else None
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        return " ".join(parts)

    def eta(self, total: int, now: float) -> float | None:
        """Seconds left to step `total`: `smoothed_eta` of the steps seen since this process's first one."""
        return self._rate.eta(total, now=now)


# --------------------------------------------------------------------------------------------------
# Progress on a console
# --------------------------------------------------------------------------------------------------


class ConsoleSink:
    """Log lines on `stream` (stderr), and on a terminal a progress bar per phase (tqdm).

    Plain (`bar=False`, stderr piped): every `info`/`warning` log record is one line (`ProgressLog` makes
    them: phase changes, a step line every `LOG_EVERY_S` seconds; regeneration and evaluation log their
    own), and `warning` events too. With `bar=True` the same lines are printed above a tqdm bar that
    follows the `progress` events (`step`/`total_steps`, `phase` when not training).
    `error` events are not shown: the CLI ends with its own `error:` line.
    """

    def __init__(self, stream: IO[str], *, bar: bool) -> None:
        self.stream, self.bar = stream, bar
        self._bar: Any = None  # the open tqdm bar
        self._bar_phase: str | None = None
        self._loss: float | None = None

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        self._loss = _num(values.get(LOSS, self._loss))

    def event(self, kind: str, **fields: Any) -> None:
        if kind == "phase":
            self.close()
        elif kind == "progress" and self.bar:
            self._progress(str(fields.get("phase") or "training"), fields.get("step"), fields.get("total_steps"))
        elif kind == "warning":
            self._line(f"warning: {fields.get('message', '')}")

    def log(self, level: str, message: str) -> None:
        if level in ("info", "warning"):
            self._line(message if level == "info" else f"warning: {message}")
        elif level == "error":
            self._line(f"error: {message}")

    def close(self) -> None:
        """Close the open bar (a new phase, or the end)."""
        if self._bar is not None:
            self._bar.close()
            self._bar, self._bar_phase = None, None

    def _line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self.stream)  # above the bar, which is redrawn under it
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def _progress(self, phase: str, step: Any, total: Any) -> None:
        if not isinstance(step, int) or not isinstance(total, int) or total <= 0:  # (0: all from a cache)
            return
        from tqdm import tqdm  # a dependency of transformers and huggingface_hub

        if self._bar is None or self._bar_phase != phase:
            self.close()
            unit = {"training": "step", "regenerating": "conv"}.get(phase, "it")
            self._bar = tqdm(total=total, initial=step, desc=phase, unit=unit, file=self.stream,
                             dynamic_ncols=True, leave=True)
            self._bar_phase = phase
        self._bar.total = total
        if self._loss is not None and phase == "training":
            self._bar.set_postfix(loss=f"{self._loss:.4g}", refresh=False)
        self._bar.update(step - self._bar.n)
