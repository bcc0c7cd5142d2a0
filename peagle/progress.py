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
  it; `eta` from the rate of the steps run since the first line of this process).

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
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from peagle.spec.metrics import LOSS, TAU_SIM, TOKENS_PER_S

__all__ = ["LOG_EVERY_S", "ConsoleSink", "JsonlSink", "MultiSink", "NullSink", "ProgressLog", "ProgressSink", "RecordingSink",
           "format_duration"]


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
        self._origin: tuple[float, int] | None = None  # (clock, step) of the first step seen
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
        if self._origin is None:
            self._origin = (now, step)
            due = True
        else:
            due = step >= total or self._last_line is None or now - self._last_line >= self.every_s
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
        t0, s0 = self._origin or (now, step)
        if step < total and step > s0 and now > t0:
            parts.append(f"eta {format_duration((total - step) * (now - t0) / (step - s0))}")
        return " ".join(parts)


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
        if not isinstance(step, int) or not isinstance(total, int):
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
