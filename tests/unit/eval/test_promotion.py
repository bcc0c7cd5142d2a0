"""The promotion rule (`peagle.eval.promotion.decide`) on synthetic numbers."""

from __future__ import annotations

from typing import Any

import pytest

from peagle.eval.promotion import best_speedup, decide


def numbers(al: float, speedups: dict[tuple[int, int], float | list[float]]) -> dict[str, Any]:
    """A side's numbers: AL and a serving table with one row per (K, batch size) (a list: one ratio per
    round, the speedup their median)."""
    def row(k: int, b: int, s: float | list[float]) -> dict[str, Any]:
        rounds = s if isinstance(s, list) else [s]
        return {"num_speculative_tokens": k, "batch_size": b, "speedup": sorted(rounds)[len(rounds) // 2],
                "speedup_per_round": rounds}

    return {"acceptance_length": al, "serving": {"table": [row(k, b, s) for (k, b), s in speedups.items()]}}


def test_the_docstrings_example_is_promoted_and_the_slower_child_declined() -> None:
    child = numbers(2.41, {(3, 1): 1.30, (2, 1): 1.10, (2, 8): 1.05, (3, 8): 0.9})
    current = numbers(2.45, {(3, 1): 1.22, (3, 8): 1.01})
    d = decide(child, current, [8, 1])
    assert d.decision == "promoted", d.reason
    assert [(r["batch_size"], r["child"]["k"], r["current"]["speedup"]) for r in d.rows] == [(1, 3, 1.22), (8, 2, 1.01)]
    slower = numbers(2.41, {(3, 1): 1.30, (2, 8): 0.99})
    d = decide(slower, current, [1, 8])
    assert d.decision == "declined" and "batch 8: 0.99x, the current draft 1.01x" in d.reason


def test_faster_at_some_batch_sizes_only_counts_only_the_named_ones() -> None:
    child = numbers(2.0, {(2, 1): 1.2, (2, 16): 0.8})
    current = numbers(2.0, {(2, 1): 1.1, (2, 16): 0.9})
    assert decide(child, current, [1]).decision == "promoted"
    assert decide(child, current, [1, 16]).decision == "declined"


def test_a_lower_al_beyond_the_tolerance_declines_a_faster_child() -> None:
    current = numbers(2.0, {(2, 1): 1.0})
    assert decide(numbers(1.97, {(2, 1): 1.2}), current, [1]).decision == "promoted"  # within 2%
    d = decide(numbers(1.90, {(2, 1): 1.2}), current, [1])
    assert d.decision == "declined" and "AL 1.90 is lower" in d.reason


def test_equal_speed_is_not_a_win_and_min_gain_raises_the_bar() -> None:
    current = numbers(2.0, {(2, 1): 1.10})
    assert decide(numbers(2.0, {(2, 1): 1.10}), current, [1]).decision == "declined"
    assert decide(numbers(2.0, {(2, 1): 1.12}), current, [1], min_gain=0.05).decision == "declined"
    assert decide(numbers(2.0, {(2, 1): 1.20}), current, [1], min_gain=0.05).decision == "promoted"


def test_a_win_of_the_medians_that_one_round_contradicts_is_noise() -> None:
    current = numbers(2.0, {(2, 1): [1.00, 1.10, 1.05]})
    d = decide(numbers(2.0, {(2, 1): [1.20, 1.02, 1.15]}), current, [1])  # median 1.15 > 1.05, round 2 lost
    assert d.decision == "declined" and "not faster in 1 of 3 rounds" in d.reason
    assert decide(numbers(2.0, {(2, 1): [1.20, 1.12, 1.15]}), current, [1]).decision == "promoted"


def test_what_was_not_measured_decides_nothing() -> None:
    current = numbers(2.0, {(2, 1): 1.0})
    assert decide(None, current, [1]).decision == "not_measured"
    assert decide(numbers(2.0, {(2, 1): 1.5}), None, [1]).decision == "not_measured"
    d = decide(numbers(2.0, {(2, 1): 1.5}), current, [1, 8])
    assert d.decision == "not_measured" and "batch 8" in d.reason
    with pytest.raises(ValueError, match="batch_sizes"):
        decide(current, current, [])


def test_best_speedup_takes_the_fastest_k_and_the_smaller_k_on_a_tie() -> None:
    n = numbers(2.0, {(1, 4): 1.1, (2, 4): 1.3, (3, 4): 1.3})
    assert best_speedup(n, 4) == {"speedup": 1.3, "k": 2, "per_round": [1.3]}
    assert best_speedup(n, 1) is None
