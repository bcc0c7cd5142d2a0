"""Acceptance length, counted the way vLLM counts it: the one definition for every engine and report.

Both decoders (`peagle.eval.reference` and vLLM through the probe, `peagle.engine.probe`) hand over the same
raw facts, one acceptance histogram per request: `h[j]` = verification steps of that request whose
draft had exactly `j` tokens accepted, `j = 0..K` (vLLM's own per-request `acceptance_histogram`,
`RequestSpecDecodeMetrics`). From them, as vLLM's spec-decode counters and its log line do:

    drafts        = sum_r sum_j h_r[j]                   (vllm:spec_decode_num_drafts)
    accepted      = sum_r sum_j j * h_r[j]               (vllm:spec_decode_num_accepted_tokens)
    accepted_at_k = sum_r sum_{j>k} h_r[j]               (vllm:spec_decode_num_accepted_tokens_per_pos[k])
    AL            = 1 + accepted / drafts                (pooled over requests, not a mean of per-request ALs)
    rate_k        = accepted_at_k / drafts

Worked example, K = 2, two requests: h_0 = [1, 0, 1] (one draft rejected, one fully accepted) and
h_1 = [0, 2, 0]: drafts 4, accepted 0+2+2 = 4, AL = 1 + 4/4 = 2.0; accepted_at = [3, 1], rates
[0.75, 0.25]; per request AL_0 = AL_1 = 2.0. Pooled and averaged differ as soon as requests draft
unequally often: h_0 = [9, 0, 1], h_1 = [0, 1, 0] gives pooled 1 + 3/11 = 1.27 but a mean of per-request
ALs (1.2 + 2.0) / 2 = 1.6. The two can rank drafts differently, so only the pooled value is reported as
AL, and the per-request values only as their spread.

No drafts at all (every request ended at prefill, e.g. one new token): AL is undefined, `None`, in
every engine (vLLM logs no AL then either); per-position rates are an empty list.

Torch-free and pure: the vLLM venv never imports it, the project side computes every number from the
probe's raw histograms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Acceptance", "compute_acceptance", "histogram_of", "quantile", "spread"]


def histogram_of(accepted: Sequence[int], num_speculative_tokens: int) -> list[int]:
    """One request's histogram from its accepted count per verification step.

    Example: `histogram_of([0, 2, 1, 2], 2) == [1, 1, 2]`.

    Raises:
        ValueError: a count outside [0, K].
    """
    k = int(num_speculative_tokens)
    h = [0] * (k + 1)
    for n in accepted:
        if not 0 <= int(n) <= k:
            raise ValueError(f"accepted count {n} outside [0, {k}]")
        h[int(n)] += 1
    return h


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of a non-empty sequence, `q` in [0, 1]."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("quantile of an empty sequence")
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """`{min, p25, median, p75, max, mean}` of per-request values; None when there are none."""
    if not values:
        return None
    return {
        "min": min(values), "p25": quantile(values, 0.25), "median": quantile(values, 0.5),
        "p75": quantile(values, 0.75), "max": max(values), "mean": sum(values) / len(values),
    }  # fmt: skip


@dataclass(frozen=True)
class Acceptance:
    """Pooled acceptance over a set of requests (module docstring), plus the per-request spread."""

    acceptance_length: float | None
    per_position: list[float]
    num_drafts: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]
    num_requests: int
    per_request: list[float | None] = field(default_factory=list)  # AL of each request, None: no draft

    @property
    def requests_without_drafts(self) -> int:
        """Requests that never drafted (finished at prefill)."""
        return sum(1 for a in self.per_request if a is None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: the pooled numbers, `per_request` and its `per_request_spread`."""
        measured = [a for a in self.per_request if a is not None]
        return {
            "acceptance_length": self.acceptance_length,
            "per_position": list(self.per_position),
            "num_drafts": self.num_drafts,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "num_requests": self.num_requests,
            "per_request": list(self.per_request),
            "per_request_spread": spread(measured),
            "requests_without_drafts": self.requests_without_drafts,
        }


def compute_acceptance(histograms: Sequence[Sequence[int]]) -> Acceptance:
    """Pooled AL, per-position rates and per-request ALs of per-request acceptance histograms.

    Args:
        histograms: one list per request, `h[j]` = steps with `j` accepted draft tokens, `j = 0..K`
            (lists may differ in length; shorter ones count as zero beyond their end).

    Returns:
        `Acceptance` (AL None and no per-position rates when no request drafted).
    """
    k = max((len(h) - 1 for h in histograms), default=0)
    accepted_per_pos = [0] * k
    drafts = accepted = 0
    per_request: list[float | None] = []
    for h in histograms:
        d = sum(int(c) for c in h)
        a = sum(j * int(c) for j, c in enumerate(h))
        for j, c in enumerate(h):
            for pos in range(j):
                accepted_per_pos[pos] += int(c)
        drafts += d
        accepted += a
        per_request.append(1.0 + a / d if d else None)
    return Acceptance(
        acceptance_length=1.0 + accepted / drafts if drafts else None,
        per_position=[n / drafts for n in accepted_per_pos] if drafts else [],
        num_drafts=drafts,
        num_accepted_tokens=accepted,
        accepted_per_pos=accepted_per_pos,
        num_requests=len(histograms),
        per_request=per_request,
    )
