"""Serving speedup of a draft in vLLM, from the probe's timed passes (`peagle/engine/probe.py` step 4).

A pass is one side (`base`: the verifier alone; `spec`: verifier + draft with parallel drafting at K)
generating the same prompts greedily at one batch size, timed. Rounds alternate the order of the sides,
so drift in the machine's load hits both. For every (K, batch size):

    tokens/s of a pass = generated tokens / seconds
    ratio_r            = spec tokens/s / base tokens/s of round r        (paired within the round)
    speedup            = median over rounds of ratio_r
    AL                 = `compute_acceptance` of every spec request's histogram over those rounds

Worked example: three rounds, base 30, 20, 29 tokens/s (round 2 disturbed by another process) and spec
33, 22, 29: ratios 1.10, 1.10, 1.00, speedup 1.10. The ratio of the medians (29 / 29 = 1.00) would let
the disturbed round decide; the pairing does not.

Recommendation per batch size: among the K faster than the verifier alone in EVERY round (median and
slowest round above 1: a gain the noise of one round cannot make), the one with the highest speedup (the
smaller K on a tie); when there is none, the draft is not recommended at that batch size
(`num_speculative_tokens: 0`). A speedup below 1 is a slowdown and is said so (`speedup_text`).

The K schedule (`k_schedule`, served through vLLM's `num_speculative_tokens_per_batch_size`: inclusive
`[first batch size, last batch size, K]` ranges, the first from 1; vLLM carries a range's K through a gap
and past the last range, and takes the batch size as the requests in the step). vLLM 0.32 runs a
parallel-drafting draft at its configured K or at K 0 only: at a K in between, the drafter's K slots per
request are read as fewer and the engine dies (`shape '[-1, 2]' is invalid for input of size 3`; open fix:
vllm-project/vllm#45695). So the schedule has ONE K, K* = the K recommended at the smallest batch size
that gains (latency first), and each measured batch size b gets K* where K* was faster in every round at
b (`faster_ks`), else 0. b's K holds from b up to the next measured batch size (the first from 1).
Worked example: batch 1 gains at K 2 and 3 (K 2 fastest), batch 4 at K 3 only, batch 8 at none:
K* = 2, batch 1 -> 2, batch 4 -> 0 (K 2 not a gain there), batch 8 -> 0: `[[1, 3, 2], [4, 8, 0]]`.

Pure and torch-free (the API and the bench import it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

from peagle.eval.acceptance import compute_acceptance

__all__ = [
    "SpeedupPlan", "k_schedule", "plan_speedup", "recommend", "speculative_config", "speedup_text",
    "summarize_speedup",
]


@dataclass(frozen=True)
class SpeedupPlan:
    """What to measure: every K of `ks` at every batch size, `rounds` rounds, on the first `num_prompts`
    prompts (None = all given); `engines` as the probe takes it (`auto`, `both`, `alternate`); `calibrate`
    measures the verifier against itself instead (every speedup should then be 1)."""

    ks: list[int]
    batch_sizes: list[int]
    rounds: int = 3
    num_prompts: int | None = None
    engines: str = "auto"
    #: A/A calibration: both sides are the verifier alone (the method's own bias and noise on a machine)
    calibrate: bool = False

    def for_probe(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict[str, Any]:
        """The probe plan's `speedup` part."""
        chosen = [list(map(int, p)) for p in prompts][: self.num_prompts]
        return {"prompts": chosen, "max_new_tokens": int(max_new_tokens), "ks": list(self.ks),
                "batch_sizes": list(self.batch_sizes), "rounds": int(self.rounds), "engines": self.engines}


def plan_speedup(
    trained_k: int, num_prompts: int, *, sweep: bool = True, batch_sizes: Sequence[int] = (), rounds: int = 3,
    engines: str = "auto",
) -> SpeedupPlan:
    """K = 1..trained_k (`sweep`) or the trained K alone; batch 1, a batch of all `num_prompts` prompts and
    the user's `batch_sizes`."""
    ks = list(range(1, int(trained_k) + 1)) if sweep else [int(trained_k)]
    sizes = sorted({1, int(num_prompts), *(int(b) for b in batch_sizes)})
    return SpeedupPlan(ks=ks, batch_sizes=sizes, rounds=int(rounds), num_prompts=int(num_prompts), engines=engines)


def speedup_text(speedup: float | None) -> str:
    """`1.07x faster`, `0.45x (2.22x slower)`, `1.00x (no change)`; `not measured` for None."""
    if speedup is None:
        return "not measured"
    if round(speedup, 2) == 1.0:
        return f"{speedup:.2f}x (no change)"
    if speedup > 1.0:
        return f"{speedup:.2f}x faster"
    return f"{speedup:.2f}x ({1.0 / speedup:.2f}x slower)"


def _tps(p: Mapping[str, Any], key: str = "seconds") -> float:
    secs = float(p.get(key) or 0.0)
    return float(p["tokens"]) / secs if secs > 0 else 0.0


def summarize_speedup(passes: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (K, batch size), sorted by K then batch size (module docstring).

    Args:
        passes: `{"k", "batch_size", "round", "side": "base" | "spec", "seconds", "tokens", "requests"}`
            (`requests[i]["histogram"]`: the spec side's per-request acceptance histograms).

    Returns:
        Rows `{"num_speculative_tokens", "batch_size", "rounds", "speedup", "speedup_text", "speedup_per_round",
        "base_tokens_per_s", "spec_tokens_per_s" (medians over rounds), "acceptance_length",
        "per_position", "base_tokens", "spec_tokens", "speedup_cpu_time" (the median paired ratio of tokens
        per CPU-second of the engine processes, None without CPU times)}`; a (K, batch) whose rounds lack a
        side is left out.
    """
    cells: dict[tuple[int, int], dict[int, dict[str, Mapping[str, Any]]]] = {}
    for p in passes:
        cells.setdefault((int(p["k"]), int(p["batch_size"])), {}).setdefault(int(p["round"]), {})[str(p["side"])] = p
    rows = []
    for (k, b), by_round in sorted(cells.items()):
        paired = [(r, s["base"], s["spec"]) for r, s in sorted(by_round.items()) if "base" in s and "spec" in s]
        if not paired:
            continue
        ratios = [_tps(spec) / _tps(base) if _tps(base) > 0 else 0.0 for _, base, spec in paired]
        hists = [q["histogram"] for _, _, spec in paired for q in spec.get("requests") or []
                 if q.get("histogram") is not None]  # fmt: skip
        acc = compute_acceptance(hists)
        # the same ratio by CPU time of the engine processes: steadier than wall time on a shared machine
        # (it leaves out time waiting for other work), meaningless on a GPU (the CPU waits for the device)
        cpu = [_tps(spec, "cpu_seconds") / _tps(base, "cpu_seconds") for _, base, spec in paired
               if _tps(base, "cpu_seconds") > 0 and _tps(spec, "cpu_seconds") > 0]
        rows.append({
            "num_speculative_tokens": k, "batch_size": b, "rounds": len(paired),
            "speedup": median(ratios), "speedup_text": speedup_text(median(ratios)), "speedup_per_round": ratios,
            "base_tokens_per_s": median(_tps(base) for _, base, _ in paired),
            "spec_tokens_per_s": median(_tps(spec) for _, _, spec in paired),
            "base_tokens": sum(int(base["tokens"]) for _, base, _ in paired),
            "spec_tokens": sum(int(spec["tokens"]) for _, _, spec in paired),
            "acceptance_length": acc.acceptance_length, "per_position": acc.per_position,
            "speedup_cpu_time": median(cpu) if cpu else None,
        })  # fmt: skip
    return rows


def _gains(row: Mapping[str, Any]) -> bool:
    """Faster than the verifier alone in every round (so not by the noise of one): the median and the
    slowest round above 1."""
    per_round = [float(x) for x in row.get("speedup_per_round") or [row["speedup"]]]
    return float(row["speedup"]) > 1.0 and min(per_round) > 1.0


def recommend(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Best K per batch size: `{"batch_size", "num_speculative_tokens" (0 = serve without the draft),
    "speedup" (of that K; of the best measured one when 0), "best_measured_k", "faster_ks" (every K faster
    in every round there, ascending)}`, by batch size. Only a K faster in every round counts (`_gains`);
    the fastest of those (by median) is recommended."""
    out = []
    for b in sorted({int(r["batch_size"]) for r in rows}):
        cands = sorted((r for r in rows if int(r["batch_size"]) == b),
                       key=lambda r: (-float(r["speedup"]), int(r["num_speculative_tokens"])))  # fmt: skip
        best = cands[0]
        gaining = [r for r in cands if _gains(r)]
        pick = gaining[0] if gaining else best
        out.append({"batch_size": b, "num_speculative_tokens": int(pick["num_speculative_tokens"]) if gaining else 0,
                    "speedup": float(pick["speedup"]), "best_measured_k": int(best["num_speculative_tokens"]),
                    "faster_ks": sorted(int(r["num_speculative_tokens"]) for r in gaining)})
    return out


def _faster_ks(rec: Mapping[str, Any]) -> set[int]:
    """The K faster in every round at a recommendation's batch size (a report stored before `faster_ks`
    was kept: its recommended K alone)."""
    if "faster_ks" in rec:
        return {int(k) for k in rec["faster_ks"]}
    k = int(rec["num_speculative_tokens"])
    return {k} if k else set()


def k_schedule(recommended: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """The K per batch size vLLM 0.32 can serve with a parallel-drafting draft (module docstring): one K
    (the K recommended at the smallest batch size that gains) where it was a gain, 0 elsewhere.

    Args:
        recommended: `recommend`'s entries (any order).

    Returns:
        `[[first, last, K], ...]` (vLLM's `num_speculative_tokens_per_batch_size`): contiguous inclusive
        ranges from batch size 1, neighbours of equal K merged, the last ending at the largest measured
        batch size (vLLM carries its K beyond); `[]` when nothing was measured or no K gains anywhere.
    """
    recs = sorted(recommended, key=lambda r: int(r["batch_size"]))
    k_star = next((int(r["num_speculative_tokens"]) for r in recs if int(r["num_speculative_tokens"])), 0)
    if not k_star:
        return []
    sizes = [int(r["batch_size"]) for r in recs]
    ks = [k_star if k_star in _faster_ks(r) else 0 for r in recs]
    ranges: list[list[int]] = []
    for i, k in enumerate(ks):
        first = 1 if i == 0 else sizes[i]
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else sizes[i]
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = last  # same K as the range before: one range
        else:
            ranges.append([first, last, k])
    return ranges


def speculative_config(model: str, recommended: Sequence[Mapping[str, Any]], default_k: int) -> dict[str, Any] | None:
    """The `--speculative-config` to serve with: `num_speculative_tokens` = the K of `k_schedule`, plus the
    schedule as `num_speculative_tokens_per_batch_size` where it turns the draft off at some batch size
    (one range of one K is the plain config); `default_k` alone when nothing was measured; None when the
    draft gains at no batch size."""
    cfg: dict[str, Any] = {"model": model, "method": "eagle3", "num_speculative_tokens": int(default_k),
                           "parallel_drafting": True}
    if not recommended:
        return cfg
    schedule = k_schedule(recommended)
    if not schedule:
        return None
    cfg["num_speculative_tokens"] = max(k for _, _, k in schedule)
    if len(schedule) > 1:
        cfg["num_speculative_tokens_per_batch_size"] = schedule
    return cfg
