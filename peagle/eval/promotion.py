"""Promotion by measurement: does a retrained draft beat the current one? Pure and torch-free.

A retrain child (`POST /v1/jobs/{id}/retrain`) is measured beside the owner's current draft for its
target (its parent when there is none) in one comparison (`peagle.eval.compare`). Each side's numbers
are `{"acceptance_length", "per_position", "serving": {"table": [row, ...]}}`, the rows those of
`peagle.eval.speedup.summarize_speedup` (one per K and batch size, `speedup` the median paired ratio of
tokens/s against the verifier alone).

The child BEATS the current draft when, at EVERY batch size the owner named:

    speedup(child, b) > speedup(current, b) * (1 + min_gain)     (each side's best K at b)
    and in every round r: ratio_r(child, b) > ratio_r(current, b)   (when both sides have the same rounds)

(the rounds pair up: in round r both drafts ran back to back, so a gain must hold in each pair, not only
in the medians: as `peagle.eval.speedup` recommends a K only where it was faster in every round, one
disturbed round cannot promote a draft)

and the child's AL (first prompt set) is not lower than the current's beyond noise:

    AL(child) >= AL(current) * (1 - al_tolerance)

Worked example (min_gain 0, al_tolerance 0.02, batch sizes [1, 8]): child 1.30x at batch 1 (K 3) and
1.05x at batch 8 (K 2), AL 2.41; current 1.22x and 1.01x, AL 2.45 (one round each): 1.30 > 1.22,
1.05 > 1.01 and 2.41 >= 2.45 * 0.98 = 2.401, so the child is promoted. With the child at 0.99x at batch 8 it is declined
("batch 8: 0.99x, the current draft 1.01x").

A batch size either side lacks, or a side with no numbers at all, makes the decision `not_measured`
(nothing changes): promotion is by measurement only, unless the owner forces it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["AL_TOLERANCE", "DECISIONS", "Decision", "best_speedup", "decide"]

#: What a decision can be: the three of measurement (`decide`) and the owner's two actions.
DECISIONS = ("promoted", "declined", "not_measured", "forced", "undone")
#: The AL the child may lose against the current draft and still count as "not lower" (greedy decoding on
#: the same prompts repeats its AL exactly; this covers a different K's and a different engine build's drift).
AL_TOLERANCE = 0.02


@dataclass(frozen=True)
class Decision:
    """`decision` (promoted / declined / not_measured), the `reason` in words, and per named batch size
    the `rows` compared (`{"batch_size", "child", "current"}`: each side's best speedup and its K)."""

    decision: Literal["promoted", "declined", "not_measured"]
    reason: str
    rows: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "reason": self.reason, "rows": list(self.rows)}


def best_speedup(numbers: Mapping[str, Any] | None, batch_size: int) -> dict[str, Any] | None:
    """The fastest K's row at `batch_size` in `numbers["serving"]["table"]` as `{"speedup", "k",
    "per_round"}`; None when that batch size was not measured."""
    table = ((numbers or {}).get("serving") or {}).get("table") or []
    rows = [r for r in table if int(r.get("batch_size", -1)) == int(batch_size) and r.get("speedup") is not None]
    if not rows:
        return None
    best = max(rows, key=lambda r: (float(r["speedup"]), -int(r["num_speculative_tokens"])))
    per_round = [float(x) for x in best.get("speedup_per_round") or [best["speedup"]]]
    return {"speedup": float(best["speedup"]), "k": int(best["num_speculative_tokens"]), "per_round": per_round}


def decide(child: Mapping[str, Any] | None, current: Mapping[str, Any] | None, batch_sizes: Sequence[int], *,
           min_gain: float = 0.0, al_tolerance: float = AL_TOLERANCE) -> Decision:
    """Whether `child` beats `current` (module docstring).

    Args:
        child, current: each side's numbers (None: that side was not measured).
        batch_sizes: the batch sizes the owner named (at least one).
        min_gain: the relative speedup margin the child must clear at each batch size.
        al_tolerance: the relative AL loss still counted as "not lower".

    Raises:
        ValueError: no batch size named.
    """
    if not batch_sizes:
        raise ValueError("batch_sizes: name at least one batch size to compare at")
    if not child or not current:
        missing = "the child" if not child else "the current draft"
        return Decision("not_measured", f"{missing} was not measured")
    rows: list[dict[str, Any]] = []
    losses: list[str] = []
    for b in sorted({int(x) for x in batch_sizes}):
        c, cur = best_speedup(child, b), best_speedup(current, b)
        rows.append({"batch_size": b, "child": c, "current": cur})
        if c is None or cur is None:
            return Decision("not_measured", f"batch {b} was not measured for "
                            f"{'the child' if c is None else 'the current draft'}", rows)
        if not c["speedup"] > cur["speedup"] * (1.0 + min_gain):
            losses.append(f"batch {b}: {c['speedup']:.2f}x, the current draft {cur['speedup']:.2f}x")
        elif len(c["per_round"]) == len(cur["per_round"]) and not all(
                x > y for x, y in zip(c["per_round"], cur["per_round"], strict=True)):
            lost = sum(1 for x, y in zip(c["per_round"], cur["per_round"], strict=True) if x <= y)
            losses.append(f"batch {b}: {c['speedup']:.2f}x vs the current draft's {cur['speedup']:.2f}x, but not "
                          f"faster in {lost} of {len(c['per_round'])} rounds (within the noise)")
    al_c, al_cur = child.get("acceptance_length"), current.get("acceptance_length")
    if not isinstance(al_c, int | float) or not isinstance(al_cur, int | float):
        return Decision("not_measured", "acceptance length not measured for both drafts", rows)
    if al_c < al_cur * (1.0 - al_tolerance):
        losses.append(f"AL {al_c:.2f} is lower than the current draft's {al_cur:.2f} "
                      f"(beyond {al_tolerance:.0%})")
    if losses:
        return Decision("declined", "; ".join(losses), rows)
    wins = ", ".join(f"batch {r['batch_size']} {r['child']['speedup']:.2f}x vs {r['current']['speedup']:.2f}x"
                     for r in rows)
    return Decision("promoted", f"faster at every named batch size ({wins}); AL {al_c:.2f} vs {al_cur:.2f}", rows)
