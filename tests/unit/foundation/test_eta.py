"""Issue 39: one smoothed ETA (`peagle.progress.smoothed_eta`) for training steps and regeneration. A slow
first batch, bursts and a rate that changes must not swing it the way a raw estimate swings."""

from __future__ import annotations

from itertools import pairwise

import pytest

from peagle.progress import ETA_MIN_SAMPLES, ProgressLog, RateHistory, RecordingSink, smoothed_eta


def _raw_eta(t0: float, now: float, done: float, total: float) -> float:
    """Today's estimate: the average rate since the start (what swung from 164 h to 20 h)."""
    return (total - done) * (now - t0) / done


def _bursty(total: int = 400, batch: int = 8, first_s: float = 900.0) -> list[tuple[float, float]]:
    """A slow first batch (engine warm-up: 15 minutes), then batches every 40 s or 80 s in turn (60 s mean)."""
    out, t, done = [], first_s, batch
    out.append((t, float(done)))
    while done < total:
        t += 40.0 if len(out) % 2 else 80.0
        done += batch
        out.append((t, float(done)))
    return out


def test_smoothed_eta_stays_in_a_band_where_the_raw_one_swings() -> None:
    samples = _bursty()
    total = samples[-1][1]
    end = samples[-1][0]
    raw_ratio, smooth_ratio = [], []
    for i in range(len(samples) - 1):
        now, done = samples[i]
        truth = end - now
        raw_ratio.append(_raw_eta(0.0, now, done, total) / truth)  # shown from the first batch on
        eta = smoothed_eta(samples[: i + 1], total)
        assert (eta is None) == (i < ETA_MIN_SAMPLES)
        if eta is not None:
            smooth_ratio.append(eta / truth)
    assert max(raw_ratio) > 10 and max(raw_ratio) / min(raw_ratio) > 5  # the reported swing: the raw ETA ...
    assert all(abs(r - 1) <= 0.25 for r, (t, _d) in zip(smooth_ratio, samples[ETA_MIN_SAMPLES:], strict=False)
               if end - t >= 600), smooth_ratio  # within 25% while 10 minutes or more are left
    # ... and the smoothed one moves little from one sample to the next while the raw one falls steadily
    etas = [smoothed_eta(samples[: i + 1], total) or 0.0 for i in range(ETA_MIN_SAMPLES, len(samples) - 1)]
    assert all(abs(b - (a - 60.0)) < 0.2 * a + 60 for a, b in pairwise(etas))


def test_smoothed_eta_follows_a_rate_change_and_counts_a_stall() -> None:
    samples = [(float(t), float(t)) for t in range(0, 601, 10)]  # 1 unit/s for 10 minutes
    samples += [(600.0 + 2 * k, 600.0 + k) for k in range(10, 1201, 10)]  # then 0.5 unit/s for 40 minutes
    total = 3000.0
    now, done = samples[-1]
    eta = smoothed_eta(samples, total)
    assert eta is not None and eta == pytest.approx((total - done) / 0.5, rel=0.05)
    # no progress for 10 minutes since the last sample: the ETA grows
    stalled = smoothed_eta(samples, total, now=now + 600)
    assert stalled is not None and stalled > 1.3 * eta


def test_smoothed_eta_needs_samples_and_is_zero_when_done() -> None:
    assert smoothed_eta([], 10) is None and smoothed_eta([(0.0, 1.0)], 10) is None
    assert smoothed_eta([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)], 10) is None  # two intervals: not yet
    assert smoothed_eta([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)], 10) == pytest.approx(6.0)
    assert smoothed_eta([(0.0, 1.0), (5.0, 10.0)], 10, min_samples=1) == 0.0


def test_rate_history_keeps_a_bounded_window() -> None:
    h = RateHistory(half_life_s=10.0)
    for t in range(10_000):
        h.add(float(t), float(t // 2))  # every other sample does not move: not kept
    assert len(h.samples) <= 10 * 10 // 2 + ETA_MIN_SAMPLES + 3
    assert h.eta(10_000.0) == pytest.approx((10_000 - 4999) * 2, rel=0.01)
    h.add(10_001.0, 0.0)  # progress went back (a new origin): the old samples go
    assert list(h.samples) == [(10_001.0, 0.0)]


def test_training_step_lines_use_the_smoothed_eta() -> None:
    """`ProgressLog`: steps after a pause for an evaluation do not make the ETA jump as a raw rate would."""
    now = [0.0]
    rec = RecordingSink()
    log = ProgressLog(rec, every_s=0.0, clock=lambda: now[0])
    samples: list[tuple[float, float]] = []
    for step in range(1, 201):
        now[0] += 1.0 if step != 150 else 300.0  # one step a second, one evaluation of 5 minutes
        log.event("progress", step=step, total_steps=1000)
        samples.append((now[0], float(step)))
    assert log.eta(1000, now[0]) == pytest.approx(smoothed_eta(samples, 1000.0), rel=1e-9)
    line = [r["message"] for r in rec.records if r["type"] == "log"][-1]
    assert line.startswith("step 200/1000") and " eta " in line
