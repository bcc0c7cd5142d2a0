"""Pooling the rounds of a promotion comparison (`peagle.eval.compare.merge_rounds`), synthetic tables."""

from __future__ import annotations

from typing import Any

from peagle.eval.compare import merge_rounds


def row(k: int, b: int, ratios: list[float], base: float = 10.0) -> dict[str, Any]:
    return {"num_speculative_tokens": k, "batch_size": b, "speedup": sorted(ratios)[len(ratios) // 2],
            "speedup_per_round": ratios, "base_tokens_per_s": base, "spec_tokens_per_s": base * ratios[0],
            "acceptance_length": 1.5, "per_position": [0.5]}


def test_every_rounds_ratios_are_pooled_per_k_and_batch_size() -> None:
    # round 1 was disturbed at batch 4 (0.5); pooled with round 2's two ratios the median ignores it
    merged = merge_rounds([[row(2, 1, [1.1]), row(2, 4, [0.5])], [row(2, 4, [1.2, 1.3]), row(2, 1, [1.3])]])
    assert [(r["num_speculative_tokens"], r["batch_size"]) for r in merged] == [(2, 1), (2, 4)]
    b1, b4 = merged
    assert b1["speedup_per_round"] == [1.1, 1.3] and abs(b1["speedup"] - 1.2) < 1e-9
    assert b4["speedup_per_round"] == [0.5, 1.2, 1.3] and b4["speedup"] == 1.2 and b4["rounds"] == 3
    assert b4["speedup_text"] == "1.20x faster" and b4["acceptance_length"] == 1.5


def test_a_k_measured_in_one_round_only_keeps_its_own_ratios() -> None:
    merged = merge_rounds([[row(1, 1, [0.9])], [row(2, 1, [1.4])]])
    assert [(r["num_speculative_tokens"], r["speedup"]) for r in merged] == [(1, 0.9), (2, 1.4)]
    assert merge_rounds([]) == []
