"""Regeneration progress (`peagle.data.regenerate`): rate-limited `progress` events with ``phase:
regenerating`` and log lines (done/total conversations, generated tokens/s, ETA) to a `ProgressSink`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from peagle.progress import ProgressSink, format_duration
from peagle.spec.metrics import (
    REGEN_CONVERSATIONS,
    REGEN_CONVERSATIONS_TOTAL,
    REGEN_SECONDS_REMAINING,
    REGEN_TOKENS,
    REGEN_TOKENS_PER_S,
)


class RegenProgress:
    """Rate-limited progress records: done/total conversations, generated tokens/s, ETA."""

    def __init__(self, sink: ProgressSink | None, total: int, done: int, every_s: float, clock: Callable[[], float]) -> None:
        self.sink, self.total, self.done, self.every_s, self.clock = sink, total, done, every_s, clock
        self.generated = 0
        self.answers = 0
        self.tokens = 0
        self.t0: float | None = None
        self.last: float | None = None

    def start(self) -> None:
        self.t0 = self.clock()

    def add(self, tokens: int) -> None:
        self.done += 1
        self.generated += 1
        self.tokens += tokens
        now = self.clock()
        if self.last is None or self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            self.emit(now)

    def answered(self) -> None:
        """One more answer came back (a turn: a conversation can have several)."""
        self.answers += 1

    def tick(self) -> None:
        """While conversations are in flight and none finished for `every_s`: a line that says so (a first
        answer of a long batch can take minutes on a CPU)."""
        now = self.clock()
        if self.last is None or now - self.last >= self.every_s:
            self.last = now
            if self.sink is not None:
                t0 = self.t0 if self.t0 is not None else now
                self.sink.log("info", f"regenerating {self.done}/{self.total} conversations: {self.answers} answers "
                                      f"back, generating for {format_duration(now - t0)}")

    def rate(self, now: float) -> float:
        return self.tokens / (now - self.t0) if self.t0 is not None and now > self.t0 else 0.0

    def emit(self, now: float) -> None:
        if self.sink is None:
            return
        elapsed = now - (self.t0 if self.t0 is not None else now)
        eta = (self.total - self.done) * elapsed / self.generated if self.generated else None
        tps = self.rate(now)
        fields: dict[str, Any] = {REGEN_CONVERSATIONS: self.done, REGEN_CONVERSATIONS_TOTAL: self.total,
                                  REGEN_TOKENS: self.tokens, REGEN_TOKENS_PER_S: round(tps, 1),
                                  REGEN_SECONDS_REMAINING: None if eta is None else round(eta, 1)}
        self.sink.event("progress", phase="regenerating", step=self.done, total_steps=self.total, **fields)
        pct = 100 * self.done // max(self.total, 1)
        line = f"regenerating {self.done}/{self.total} conversations ({pct}%)"
        if self.generated:  # the first record (engine ready, nothing generated yet) has no rate
            line += f" tokens/s {tps:.0f}"
        if eta is not None and self.done < self.total:
            line += f" eta {format_duration(eta)}"
        self.sink.log("info", line)
