"""Issue 39: regeneration progress counts only the work that remains. Cached conversations are done at
once and never in a rate; the percent and ETA are over the conversations that need generation; tokens/s
counts every answer as it comes back; the ETA is the smoothed one (`peagle.progress.smoothed_eta`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from peagle.data.regen_progress import RegenProgress, answer_slots
from peagle.progress import RecordingSink
from peagle.spec.metrics import (
    REGEN_CONVERSATIONS,
    REGEN_CONVERSATIONS_TOTAL,
    REGEN_SECONDS_REMAINING,
    REGEN_TOKENS_PER_S,
)
from tests.unit.data.test_regenerate import CONVS, Scripted, _conv, _run, _settings


@dataclass
class Run:
    source: list[dict[str, str]]
    finish: list[str] = field(default_factory=list)
    tokens: int = 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _events(sink: RecordingSink) -> list[dict]:
    return [r for r in sink.records if r["type"] == "event" and r["kind"] == "progress"]


def _lines(sink: RecordingSink) -> list[str]:
    return [r["message"] for r in sink.records if r["type"] == "log"]


def test_answer_slots() -> None:
    assert answer_slots(CONVS[0]) == 2 and answer_slots(CONVS[1]) == 1
    assert answer_slots(_conv(("assistant", "no prompt"), ("user", "q"), ("assistant", "a"))) == 1


def test_cached_conversations_are_done_at_once_and_not_in_the_percent_or_rate() -> None:
    """1,920 conversations, 1,600 from the cache: 1 generated of 320 is 0%, not 83%."""
    sink, clock = RecordingSink(), Clock()
    todo = [Run(_conv(("user", f"q{i}"), ("assistant", "old"))) for i in range(320)]
    p = RegenProgress(sink, 1920, todo, 5.0, clock)
    p.begin("vllm")  # before the engine starts
    first = _events(sink)[0]
    assert (first["step"], first["total_steps"], first[REGEN_CONVERSATIONS], first[REGEN_CONVERSATIONS_TOTAL]) \
        == (0, 320, 1600, 1920)
    assert _lines(sink)[0] == "regenerating 320 conversations (1600 of 1920 from the cache): starting the vllm engine"
    clock.now = 120.0  # the engine took two minutes to start: not a rate
    p.start()
    for i in range(4):  # a conversation of one answer every 10 s
        clock.now += 10.0
        p.answered(20)
        todo[i].finish.append("stop")
        p.add(todo[i])
    clock.now += 5.0
    p.tick()
    last = _events(sink)[-1]
    assert last["step"] == 4 and last["total_steps"] == 320 and last[REGEN_CONVERSATIONS] == 1604
    assert _lines(sink)[-1].startswith("regenerating 4/320 conversations (1%) tokens/s 2 eta ")
    # the ETA is over the 316 left at the measured pace (10 s each), not over 1,920 nor from the engine start
    assert last[REGEN_SECONDS_REMAINING] == pytest.approx(316 * 10.0, rel=0.25)


def test_tokens_per_s_counts_answers_before_any_conversation_finishes() -> None:
    """Long multi-turn conversations in flight: tokens/s and the ETA come from answers, not 0 / None."""
    sink, clock = RecordingSink(), Clock()
    todo = [Run(_conv(*[("user", "q"), ("assistant", "a")] * 4)) for _ in range(8)]  # 4 answers each
    p = RegenProgress(sink, 8, todo, 5.0, clock)
    p.begin("vllm")
    p.start()
    for _ in range(6):  # 6 answers of 100 tokens, one every 5 s; no conversation done yet
        clock.now += 5.0
        p.answered(100)
        p.tick()
    last = _events(sink)[-1]
    assert last["step"] == 0 and last[REGEN_TOKENS_PER_S] == pytest.approx(20.0)
    assert last[REGEN_SECONDS_REMAINING] == pytest.approx((32 - 6) * 5.0, rel=0.01)
    assert _lines(sink)[-1] == "regenerating 0/8 conversations (0%) 6 answers back tokens/s 20 eta 2m10s"
    # a conversation that stops early gives its unused answer slots back
    todo[0].finish = ["stop"]
    p.add(todo[0])
    assert p.slots_done == 6 + 3


def test_a_heartbeat_says_how_long_it_has_generated_before_any_answer() -> None:
    sink, clock = RecordingSink(), Clock()
    p = RegenProgress(sink, 2, [Run(_conv(("user", "q"), ("assistant", "a")))] * 2, 5.0, clock)
    p.start()
    clock.now = 95.0
    p.tick()
    assert _lines(sink)[-1] == "regenerating 0/2 conversations (0%), generating for 1m35s"
    assert _events(sink)[-1][REGEN_TOKENS_PER_S] is None  # unknown, not 0


def test_all_cached_is_reported_at_once(smollm2_tokenizer, tmp_path) -> None:
    """Through the driver: a second run over the same conversations (and two new ones) counts only the new."""
    eng = Scripted(smollm2_tokenizer, concurrent=True)
    _run(smollm2_tokenizer, CONVS, _settings(), eng, tmp_path)
    sink = RecordingSink()
    _run(smollm2_tokenizer, CONVS, _settings(), Scripted(smollm2_tokenizer, concurrent=True), tmp_path, sink=sink)
    assert _lines(sink) == [f"regenerating: all {len(CONVS)} conversations from the cache"]
    assert [(e["step"], e["total_steps"], e[REGEN_CONVERSATIONS]) for e in _events(sink)] == [(0, 0, len(CONVS))]
    more = [*CONVS, _conv(("user", "new one"), ("assistant", "x")), _conv(("user", "new two"), ("assistant", "y"))]
    sink = RecordingSink()
    _run(smollm2_tokenizer, more, _settings(), Scripted(smollm2_tokenizer, concurrent=True), tmp_path, sink=sink)
    events = _events(sink)
    assert events[0]["total_steps"] == 2 and events[0][REGEN_CONVERSATIONS] == len(CONVS)
    assert events[-1]["step"] == events[-1]["total_steps"] == 2 and events[-1][REGEN_SECONDS_REMAINING] == 0
    assert _lines(sink)[0].startswith(f"regenerating 2 conversations ({len(CONVS)} of {len(more)} from the cache)")


def test_on_a_terminal_the_bar_counts_what_is_left() -> None:
    """`ConsoleSink` (peagle train on a terminal): the bar's total is the conversations to generate; all
    from the cache draws no bar, only the line."""
    import io

    from peagle.progress import ConsoleSink

    out = io.StringIO()
    console = ConsoleSink(out, bar=True)
    RegenProgress(console, 5, [], 5.0, Clock()).begin("vllm")
    assert console._bar is None and out.getvalue() == "regenerating: all 5 conversations from the cache\n"
    p = RegenProgress(console, 5, [Run(_conv(("user", "q"), ("assistant", "a")))] * 2, 5.0, Clock())
    p.begin("vllm")
    assert console._bar is not None and console._bar.total == 2 and console._bar.n == 0
    console.close()
