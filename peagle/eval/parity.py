"""The served-parity gate: does vLLM accept, position by position, what the same weights accepted in the
reference decoder under the training run's own settings? (docs/export.md 7)

    record = parity_record(report, prompt_set="humaneval", prompts=ids, num_speculative_tokens=4,
                           max_new_tokens=64, checkpoint="step_000240")      # written as RUN/export/parity.json
    result = check_parity(record, vllm_report)                                # vLLM on record["prompts"]
    if not result.ok: raise ServedParityError(result.message)

The record is measured once, when the checkpoint is evaluated (`peagle.eval.final.evaluate_run`), by the
reference decoder with the draft as it was trained: the weights, aux layer ids and mask embedding of the
trainer, not of the exported config. It travels with the export (`parity.json`), so a config broken on the
way to vLLM (aux layer ids off by one, `mask_hidden` zeroed, a norm flag that does not match training)
cannot move both sides alike.

The rule, per draft position k (rates as `peagle.eval.acceptance` counts them, `rate_k` = drafts with more
than k tokens accepted / drafts): with `p_r` over `n_r` reference drafts and `p_v` over `n_v` vLLM drafts,
the position disagrees when

    p_r - p_v > max(FLOOR, Z * sqrt(p * (1 - p) * (1 / n_r + 1 / n_v))),   p = (p_r n_r + p_v n_v) / (n_r + n_v)

i.e. vLLM accepts less than the reference by more than Z = 3 binomial standard errors of the difference, or
FLOOR = 0.05 (bf16 serving vs the fp32 reference flips a few argmaxes, and greedy outputs then diverge).
Only a drop fails (a mis-served draft never accepts more); a gain is reported. Worked example: p_r = 0.80
over 100 drafts, p_v = 0.60 over 110: p = 0.695, tolerance 3 * sqrt(0.695 * 0.305 * (1/100 + 1/110)) = 0.19,
the drop 0.20 fails; p_v = 0.65 passes. vLLM not drafting in parallel fails on its own.

The per-request rule, on the prompts both engines decoded alike (`same_path`): the same draft on the same
tokens accepts alike, draft by draft, so each such prompt's acceptance histogram (`histogram[j]` = drafts
with exactly j tokens accepted) should equal the reference's. A near-tie in the draft's logits (bf16 vs the
reference's kernels) can change one draft of a prompt, so a few differ even on a good export; a broken export
(aux ids shifted, `mask_hidden` zeroed) changes the proposals throughout while the aggregate rates may not
move. With at least MIN_REQUESTS alike prompts it fails when fewer than AGREEMENT of them match exactly
(`request_agreement`). Measured on the parity fixture in vLLM (5 alike prompts): good 4 of 5, aux ids + 1
2 of 5, mask_hidden zeroed 1 of 5, norm flag flipped 1 of 5. A record measured
with the target in float32 (vLLM serves bfloat16) is compared and reported, never enforced. Torch-free and pure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.eval.acceptance import compute_acceptance

__all__ = [
    "AGREEMENT",
    "FLOOR",
    "MIN_REQUESTS",
    "PARITY_FILE",
    "SERVED_DTYPE",
    "USUAL_CAUSES",
    "ParityResult",
    "PositionCheck",
    "Z",
    "agreement_holds",
    "check_parity",
    "parity_record",
    "parity_summary",
    "position_tolerance",
    "read_parity",
    "request_agreement",
    "same_path",
]

#: The record's file in an export folder.
PARITY_FILE = "parity.json"
#: Its format version.
PARITY_VERSION = 2
#: Standard errors of the rate difference a position may drop by.
Z = 3.0
#: The smallest tolerated drop (numerical differences between the engines).
FLOOR = 0.05
#: The smallest share of alike-decoded prompts whose acceptance histograms must equal the reference's.
AGREEMENT = 0.6
#: The fewest alike-decoded prompts the per-request rule is applied on (fewer: not applied).
MIN_REQUESTS = 4
#: The dtype vLLM serves the target and the draft in (`peagle.engine.probe`): a record measured with the
#: target in another dtype (a float32 job) follows other greedy paths, so its verdict is reported, not enforced.
SERVED_DTYPE = "bfloat16"
#: What has broken served acceptance in the field, most likely first (vLLM issues; docs/export.md 7).
USUAL_CAUSES = (
    "eagle_aux_hidden_state_layer_ids off by one (vLLM's input-of-layer convention vs output-of-layer)",
    "mask_hidden missing or zero (positions 1.. collapse, position 0 is unaffected)",
    "norm_before_fc (or another norm flag) in config.json not matching training",
    "vLLM fell back to sequential drafting (no parallel drafting: Model Runner V2, an eagle3 config without "
    "parallel_drafting)",
    "a different verifier than the one trained against",
)


def parity_record(
    report: Mapping[str, Any], *, prompt_set: str, prompts: Sequence[Sequence[int]], num_speculative_tokens: int,
    max_new_tokens: int, checkpoint: str | None = None, verifier: str | None = None, target_dtype: str | None = None,
) -> dict[str, Any]:
    """What the gate compares vLLM with: the reference decoder's acceptance on one prompt set and the
    settings it was measured under (greedy, temperature 0, as every AL here).

    Args:
        report: the reference decoder's `EvalReport.to_dict()` on `prompts`.
        target_dtype: the target's dtype in that measurement (`bfloat16`, `float32`).
        prompts: the prompts as token ids (chat template included); vLLM is given these exact ids.
    """
    n = int(report.get("num_drafts") or 0)
    per_pos = [float(x) for x in report.get("per_position") or []]
    return {
        "version": PARITY_VERSION, "engine": "reference", "checkpoint": checkpoint, "verifier": verifier,
        "target_dtype": target_dtype,
        "prompt_set": prompt_set, "num_prompts": len(prompts), "prompts": [[int(t) for t in p] for p in prompts],
        "num_speculative_tokens": int(num_speculative_tokens), "max_new_tokens": int(max_new_tokens),
        "temperature": 0.0, "acceptance_length": report.get("acceptance_length"), "per_position": per_pos,
        "num_drafts": n, "accepted_per_pos": [round(r * n) for r in per_pos],
        "outputs": [list(o) for o in report.get("outputs") or []],
        "histograms": [list(h) for h in report.get("histograms") or []],
        "tolerance": {"z": Z, "floor": FLOOR},
    }  # fmt: skip


def parity_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record without its prompts, outputs and histograms (what a checkpoint's evaluation keeps)."""
    return {k: v for k, v in record.items() if k not in ("prompts", "outputs", "histograms")}


def read_parity(export_dir: str | Path) -> dict[str, Any] | None:
    """The export's parity record, or None when it has none (an export not written by a job's evaluation)."""
    path = Path(export_dir) / PARITY_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) and data.get("prompts") else None


def position_tolerance(p_ref: float, n_ref: int, p_vllm: float, n_vllm: int, *, z: float = Z,
                       floor: float = FLOOR) -> float:
    """The largest tolerated drop of one position's rate (module docstring)."""
    if n_ref <= 0 or n_vllm <= 0:
        return 1.0
    p = (p_ref * n_ref + p_vllm * n_vllm) / (n_ref + n_vllm)
    return max(floor, z * math.sqrt(max(p * (1.0 - p), 0.0) * (1.0 / n_ref + 1.0 / n_vllm)))


@dataclass(frozen=True)
class PositionCheck:
    """One draft position: both rates, the tolerated drop, whether it holds."""

    position: int
    reference: float
    vllm: float
    tolerance: float
    ok: bool


@dataclass(frozen=True)
class ParityResult:
    """The gate's verdict; `message` is one line naming the disagreeing positions and the usual causes.
    `enforced` is False when the record's target dtype is not the one vLLM serves (`SERVED_DTYPE`): a
    failure is then reported and not acted on (`fails`)."""

    ok: bool
    message: str
    enforced: bool = True
    positions: list[PositionCheck] = field(default_factory=list)
    reference_al: float | None = None
    vllm_al: float | None = None
    parallel_drafting_ok: bool | None = None
    requests_matching: int = 0
    requests_compared: int = 0

    @property
    def agreement_ok(self) -> bool:
        """The per-request rule (module docstring); True when too few prompts were compared to apply it."""
        return agreement_holds(self.requests_matching, self.requests_compared)

    @property
    def fails(self) -> bool:
        """Whether the check must stop the export (the serve check fails, `peagle eval` exits 12)."""
        return not self.ok and self.enforced

    @property
    def failed_positions(self) -> list[int]:
        return [p.position for p in self.positions if not p.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "enforced": self.enforced, "fails": self.fails, "message": self.message,
            "failed_positions": self.failed_positions,
            "positions": [p.__dict__ for p in self.positions], "reference_acceptance_length": self.reference_al,
            "vllm_acceptance_length": self.vllm_al, "parallel_drafting_ok": self.parallel_drafting_ok,
            "tolerance": {"z": Z, "floor": FLOOR},
            "requests": {"matching": self.requests_matching, "compared": self.requests_compared,
                         "ok": self.agreement_ok, "agreement": AGREEMENT, "min_requests": MIN_REQUESTS},
        }  # fmt: skip


def _al(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, int | float) else "n/a"


def same_path(reference: Mapping[str, Any], vllm: Mapping[str, Any]
              ) -> tuple[Mapping[str, Any], Mapping[str, Any], int, int]:
    """Both reports restricted to the prompts whose generated tokens are identical in both engines.

    A draft never changes what greedy speculative decoding generates, but the engines' target kernels can
    (bf16 rounding differs): from the first differing token on, the two decode different text and accept
    differently, whatever the draft. On identical paths the same draft must accept alike, so only those are
    compared. Without outputs and histograms on both sides (an older record) nothing is restricted.

    Returns:
        (reference, vllm, prompts kept, prompts compared); both 0 when nothing was restricted.
    """
    r_out, v_out = reference.get("outputs") or [], vllm.get("outputs") or []
    r_h, v_h = reference.get("histograms") or [], vllm.get("histograms") or []
    if not (r_out and v_out and len(r_out) == len(v_out) == len(r_h) == len(v_h)):
        return reference, vllm, 0, 0
    keep = [i for i, (a, b) in enumerate(zip(r_out, v_out, strict=True)) if list(a) == list(b)]

    def sub(report: Mapping[str, Any], hists: Sequence[Sequence[int]]) -> dict[str, Any]:
        acc = compute_acceptance([hists[i] for i in keep])
        return {**report, "acceptance_length": acc.acceptance_length, "per_position": acc.per_position,
                "num_drafts": acc.num_drafts}

    return sub(reference, r_h), sub(vllm, v_h), len(keep), len(r_out)


def _trimmed(hist: Sequence[int]) -> list[int]:
    out = [int(x) for x in hist]
    while out and out[-1] == 0:
        out.pop()
    return out


def request_agreement(reference: Mapping[str, Any], vllm: Mapping[str, Any]) -> tuple[int, int]:
    """How many prompts decoded alike by both engines have the same acceptance histogram in both.

    Args:
        reference, vllm: reports with `outputs` (per prompt: generated token ids) and `histograms` (per prompt:
            `histogram[j]` = drafts with exactly j tokens accepted), prompts in the same order.

    Returns:
        (matching, compared): compared = prompts with identical outputs and at least one draft on either side;
        (0, 0) without outputs and histograms on both sides.
    """
    r_out, v_out = reference.get("outputs") or [], vllm.get("outputs") or []
    r_h, v_h = reference.get("histograms") or [], vllm.get("histograms") or []
    if not (r_out and v_out and len(r_out) == len(v_out) == len(r_h) == len(v_h)):
        return 0, 0
    pairs = [(_trimmed(r_h[i]), _trimmed(v_h[i])) for i in range(len(r_out)) if list(r_out[i]) == list(v_out[i])]
    pairs = [(a, b) for a, b in pairs if a or b]
    return sum(a == b for a, b in pairs), len(pairs)


def agreement_holds(matching: int, compared: int, *, agreement: float = AGREEMENT,
                    min_requests: int = MIN_REQUESTS) -> bool:
    """The per-request rule: True unless at least `min_requests` prompts were compared and fewer than
    `agreement` of them matched."""
    return compared < min_requests or matching >= agreement * compared


def check_parity(reference: Mapping[str, Any], vllm: Mapping[str, Any]) -> ParityResult:
    """Compare vLLM's per-position acceptance with the recorded reference (module docstring).

    Args:
        reference: a `parity_record` (or any report with `per_position`, `num_drafts`).
        vllm: vLLM's report on the record's prompts at its K and max_new_tokens (`run_vllm_probe`, or a
            `measure_vllm` set report with the engine facts): `per_position`, `num_drafts`, and
            `parallel_drafting_ok` / `problems` when known.
    """
    matching, compared = request_agreement(reference, vllm)
    reference, vllm, kept, total = same_path(reference, vllm)
    p_ref = [float(x) for x in reference.get("per_position") or []]
    p_v = [float(x) for x in vllm.get("per_position") or []]
    n_ref, n_v = int(reference.get("num_drafts") or 0), int(vllm.get("num_drafts") or 0)
    parallel = vllm.get("parallel_drafting_ok")
    checks = [PositionCheck(k, p_ref[k], p_v[k], tol := position_tolerance(p_ref[k], n_ref, p_v[k], n_v),
                            p_ref[k] - p_v[k] <= tol) for k in range(min(len(p_ref), len(p_v)))]  # fmt: skip
    problems: list[str] = []
    if parallel is False:
        problems.append("vLLM did not draft in parallel (" + ("; ".join(vllm.get("problems") or []) or "no reason")
                        + ")")
    if n_ref and not n_v:
        problems.append("vLLM drafted nothing on the recorded prompts")
    elif len(p_v) < len(p_ref):
        problems.append(f"vLLM drafted {len(p_v)} positions, the reference {len(p_ref)}")
    if not agreement_holds(matching, compared):
        problems.append(f"per-request acceptance differs: the acceptance histograms match the reference's on "
                        f"{matching} of {compared} prompts decoded alike (at least {AGREEMENT:.0%} must: the same "
                        f"draft on the same tokens accepts alike)")
    bad = [c for c in checks if not c.ok]
    if bad:
        listed = ", ".join(f"position {c.position}: vLLM {c.vllm:.2f} vs reference {c.reference:.2f} "
                           f"(drop {c.reference - c.vllm:.2f} > tolerance {c.tolerance:.2f})" for c in bad)
        problems.insert(0, f"acceptance dropped at draft position{'s' if len(bad) > 1 else ''} "
                           f"{', '.join(str(c.position) for c in bad)} ({listed})")
    ref_al, v_al = reference.get("acceptance_length"), vllm.get("acceptance_length")
    drafts = f"{n_v} vLLM drafts vs {n_ref} reference"
    dtype = reference.get("target_dtype")
    enforced = dtype in (None, SERVED_DTYPE) and (total == 0 or kept * 2 >= total)
    if kept < total:
        drafts += f"; on the {kept} of {total} prompts where both engines generated the same tokens"
    if problems and dtype not in (None, SERVED_DTYPE):
        message = (f"served parity not enforced (the reference decoder ran the target in {dtype}, vLLM serves "
                   f"{SERVED_DTYPE}: greedy outputs part ways): vLLM AL {_al(v_al)} vs {_al(ref_al)} ({drafts}); "
                   + "; ".join(problems))
    elif problems and not enforced:
        message = (f"served parity not enforced (the target's greedy outputs differ between the engines on "
                   f"{total - kept} of {total} prompts): vLLM AL {_al(v_al)} vs {_al(ref_al)} ({drafts}); "
                   + "; ".join(problems))
    elif problems:
        message = (f"served parity failed: vLLM AL {_al(v_al)} vs {_al(ref_al)} in the reference decoder with the "
                   f"same weights and settings ({drafts}); " + "; ".join(problems)
                   + ". Usual causes: " + "; ".join(USUAL_CAUSES))
    else:
        message = (f"served parity ok: vLLM AL {_al(v_al)} vs {_al(ref_al)} in the reference decoder, every draft "
                   f"position within tolerance ({drafts})")
    return ParityResult(ok=not problems, message=message, enforced=enforced, positions=checks, reference_al=ref_al,
                        vllm_al=v_al,
                        parallel_drafting_ok=parallel if isinstance(parallel, bool) else None,
                        requests_matching=matching, requests_compared=compared)
