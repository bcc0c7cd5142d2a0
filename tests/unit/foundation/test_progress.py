"""Issue 20: the trainer's progress reaches the job log (phase lines, rate-limited step lines)."""

from __future__ import annotations

from typing import Any

from peagle.progress import LOG_EVERY_S, ProgressLog, RecordingSink, format_duration


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _logs(rec: RecordingSink) -> list[str]:
    return [r["message"] for r in rec.records if r["type"] == "log"]


def _step(sink: ProgressLog, step: int, total: int, **values: Any) -> None:
    sink.metric(step, step / total, {"loss": 2.0 - step / 100, "tokens_per_s": 900.0, **values})
    sink.event("progress", step=step, total_steps=total, epoch=step / total)


def test_phase_changes_are_log_lines_and_records_pass_through() -> None:
    rec = RecordingSink()
    sink = ProgressLog(rec, clock=Clock())
    sink.event("phase", phase="preparing_data", message="reading, templating and packing the data")
    sink.event("phase", phase="done", message="")
    sink.log("warning", "as is")
    assert _logs(rec) == ["phase preparing_data: reading, templating and packing the data", "phase done", "as is"]
    assert [r["phase"] for r in rec.records if r["type"] == "event"] == ["preparing_data", "done"]


def test_step_lines_are_rate_limited_with_first_and_last_step() -> None:
    rec = RecordingSink()
    clock = Clock()
    sink = ProgressLog(rec, clock=clock)
    for step in range(1, 101):  # one step a second
        clock.now += 1.0
        _step(sink, step, 100, tau_sim=1.5)
    lines = _logs(rec)
    every = int(LOG_EVERY_S)
    assert [int(m.split()[1].split("/")[0]) for m in lines] == [1, *range(1 + every, 100, every), 100]
    assert lines[0] == "step 1/100 (1%) loss 1.99 tau_sim 1.500 tokens/s 900"  # no rate yet: no eta
    assert lines[1] == f"step {1 + every}/100 ({1 + every}%) loss {2.0 - (1 + every) / 100:.4g} tau_sim 1.500 " \
                       f"tokens/s 900 eta {format_duration(100 - 1 - every)}"
    assert "eta" not in lines[-1] and lines[-1].startswith("step 100/100 (100%) loss 1 ")
    assert sum(r["type"] == "metric" for r in rec.records) == 100  # every record still goes through


def test_slow_steps_get_a_line_each_and_resumed_runs_start_at_their_step() -> None:
    rec = RecordingSink()
    clock = Clock()
    sink = ProgressLog(rec, clock=clock)
    for step in range(41, 45):  # resumed at 40; a step takes longer than the interval
        clock.now += LOG_EVERY_S * 3
        _step(sink, step, 240)
    lines = _logs(rec)
    assert [m.split()[1] for m in lines] == ["41/240", "42/240", "43/240", "44/240"]
    assert "tau_sim" not in lines[0]  # not reported by these steps: not shown
    assert "eta" not in lines[2]  # the smoothed ETA needs 3 steps past the first (peagle.progress.smoothed_eta)
    assert lines[3].endswith(f"eta {format_duration((240 - 44) * LOG_EVERY_S * 3)}")


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 9.4, 75, 3725, -3)] == ["0s", "9s", "1m15s", "1h02m", "0s"]
