"""Progress reporting: the `ProgressSink` protocol and its JSON-lines implementations.

Every record is one JSON object per line with `"type"` (`metric`, `event`, `log`) and `"time"` (unix
seconds). The trainer only talks to a sink; the worker reads the JSON lines from the trainer's stdout
(`--progress-jsonl -`) and RUN/progress.jsonl keeps the same records. `peagle` never knows who listens.

    >>> sink = MultiSink(JsonlSink(sys.stdout), JsonlSink(run / "progress.jsonl"))
    >>> sink.metric(12, 0.4, {"loss": 2.1, "acc_0": 0.5})
    >>> sink.event("checkpoint", step=100, dir="checkpoints/step_000100", is_best=True)
    >>> sink.log("info", "resumed from step 100")
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

__all__ = ["JsonlSink", "MultiSink", "NullSink", "ProgressSink", "RecordingSink"]


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
