"""Regeneration progress (`peagle.data.regenerate`): rate-limited `progress` events with ``phase:
regenerating`` and log lines to a `ProgressSink`.

Only the work that remains is measured: conversations answered from the cache (or with nothing to ask the
engine) are reported as done at once, before the engine starts, and never enter a rate. The record's
``step``/``total_steps`` (the bar, the job's percent) count the conversations that need generation;
`REGEN_CONVERSATIONS` / `REGEN_CONVERSATIONS_TOTAL` count all of them, cached ones included.

* tokens/s counts each answer's tokens when it comes back (a conversation has several), over the seconds
  since the engine was up: it is not 0 while the engine works;
* the ETA (`REGEN_SECONDS_REMAINING`) is `peagle.progress.smoothed_eta` over answer slots (the assistant
  turns of the conversations left; a conversation that stops early gives back the rest of its slots), from
  the first answer on: the engine's start and the first answers' latency are not a rate, and a batch that
  finishes at once does not swing it.

    progress = RegenProgress(sink, len(conversations), todo, every_s, clock)
    progress.begin("vllm")        # at once: N to generate, M from the cache
    progress.start()              # the engine is up
    progress.answered(tokens)     # every answer
    progress.add(run)             # every finished conversation
    progress.tick()               # a heartbeat while nothing comes back
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from peagle.progress import ProgressSink, RateHistory, format_duration
from peagle.spec.metrics import (
    REGEN_CONVERSATIONS,
    REGEN_CONVERSATIONS_TOTAL,
    REGEN_SECONDS_REMAINING,
    REGEN_TOKENS,
    REGEN_TOKENS_PER_S,
)

__all__ = ["RegenProgress", "answer_slots"]


class _Run(Protocol):
    """What progress reads of a `peagle.data.regenerate.ConversationRun`."""

    source: list[dict[str, str]]
    finish: list[str]
    tokens: int


def answer_slots(messages: Sequence[dict[str, str]]) -> int:
    """Answers a conversation can ask the engine for: its assistant turns after the first other turn."""
    slots, seen_prompt = 0, False
    for m in messages:
        if m["role"] != "assistant":
            seen_prompt = True
        elif seen_prompt:
            slots += 1
    return slots


class RegenProgress:
    """Rate-limited progress records of a regeneration (module docstring).

    Args:
        sink: where records go (None: nowhere).
        total: conversations in all.
        todo: the conversations left to generate (`ConversationRun`s); the others count as done at once.
        every_s: least seconds between two records (the first and last always go out).
        clock: monotonic seconds.
    """

    def __init__(self, sink: ProgressSink | None, total: int, todo: Sequence[_Run], every_s: float,
                 clock: Callable[[], float]) -> None:
        self.sink, self.total, self.every_s, self.clock = sink, total, every_s, clock
        self.todo = len(todo)
        self.done = total - self.todo  # cached, or nothing to generate
        self.generated = 0
        self.answers = 0
        self.tokens = 0
        self.slots_total = sum(answer_slots(r.source) for r in todo)
        self.slots_done = 0
        self.history = RateHistory()  # (clock, answer slots done) from the first answer
        self.t0: float | None = None
        self.last: float | None = None

    def begin(self, engine: str) -> None:
        """At once, before the engine starts (it takes seconds to minutes): what is left, what the cache had."""
        if self.sink is None:
            return
        self.sink.event("progress", **self._fields(None, None))
        cached = self.total - self.todo
        if self.todo:
            self.sink.log("info", f"regenerating {self.todo} conversations ({cached} of {self.total} from the "
                                  f"cache): starting the {engine} engine")
        else:
            self.sink.log("info", f"regenerating: all {self.total} conversations from the cache")

    def start(self) -> None:
        """The engine is up: the tokens/s clock starts, and a 0-done record goes out."""
        self.t0 = self.clock()
        self.last = self.t0
        self.emit(self.t0)

    def answered(self, tokens: int = 0) -> None:
        """One more answer came back with `tokens` generated tokens (a conversation can have several); the
        next record (`add`, `tick`) shows it."""
        self.answers += 1
        self.tokens += tokens
        self.slots_done += 1
        self.history.add(self.clock(), self.slots_done)

    def add(self, run: _Run) -> None:
        """A conversation finished (its answers were counted by `answered`): it frees its unused slots."""
        self.done += 1
        self.generated += 1
        self.slots_done += max(0, answer_slots(run.source) - len(run.finish))
        now = self.clock()
        self.history.add(now, self.slots_done)
        self._due(now, final=self.generated in (1, self.todo))  # the first and the last always get a record

    def tick(self) -> None:
        """Every `every_s` while conversations are in flight (the concurrent driver's ticker, the lockstep
        driver after each batch call): a record with the answers back so far, even when no conversation
        finished (a first answer of a long batch can take minutes on a CPU)."""
        self._due(self.clock())

    def _due(self, now: float, *, final: bool = False) -> None:
        if final or self.last is None or now - self.last >= self.every_s:
            self.last = now
            self.emit(now)

    def rate(self, now: float) -> float | None:
        """Generated tokens per second since the engine was up; None before the first answer."""
        return self.tokens / (now - self.t0) if self.t0 is not None and now > self.t0 and self.answers else None

    def eta(self, now: float) -> float | None:
        """Seconds left (`smoothed_eta` over answer slots), 0 when done, None until it has enough answers."""
        if self.generated >= self.todo:
            return 0.0
        return self.history.eta(max(self.slots_total, self.slots_done), now=now)

    def _fields(self, tps: float | None, eta: float | None) -> dict[str, Any]:
        return {"phase": "regenerating", "step": self.generated, "total_steps": self.todo,
                REGEN_CONVERSATIONS: self.done, REGEN_CONVERSATIONS_TOTAL: self.total, REGEN_TOKENS: self.tokens,
                REGEN_TOKENS_PER_S: None if tps is None else round(tps, 1),
                REGEN_SECONDS_REMAINING: None if eta is None else round(eta, 1)}

    def emit(self, now: float) -> None:
        """A `progress` event and its log line, now."""
        if self.sink is None:
            return
        tps, eta = self.rate(now), self.eta(now)
        self.sink.event("progress", **self._fields(tps, eta))
        pct = 100 * self.generated // max(self.todo, 1)
        line = f"regenerating {self.generated}/{self.todo} conversations ({pct}%)"
        if self.answers and not self.generated:  # a heartbeat before the first conversation is done
            line += f" {self.answers} answers back"
        if tps is not None:
            line += f" tokens/s {tps:.0f}"
        if eta is not None and self.generated < self.todo:
            line += f" eta {format_duration(eta)}"
        elif self.t0 is not None and self.generated < self.todo and now > self.t0:
            line += f", generating for {format_duration(now - self.t0)}"
        self.sink.log("info", line)
