"""vLLM serve check: load an export in a real vLLM engine with parallel drafting and measure AL there.

The probe engine (`peagle.engine.prober.run_probe`: `peagle/engine/probe.py` in vLLM's venv, under the
guard) reports raw facts; this module turns them into reports: AL per prompt set (`al_report`, with
vLLM's own counters checked against the per-request sums), the serving speedup (`serving_report`), and
vLLM side by side with the reference decoder (`compare_reports`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from peagle.engine.locate import vllm_python
from peagle.engine.prober import run_probe
from peagle.eval.acceptance import compute_acceptance
from peagle.eval.speedup import SpeedupPlan, recommend, summarize_speedup

# vllm_python: re-exported for callers that check for vLLM beside a probe (bench, tests).
__all__ = ["al_report", "compare_reports", "measure_vllm", "run_vllm_probe", "serving_report", "vllm_python"]


def al_report(raw: Mapping[str, Any]) -> dict[str, Any]:
    """AL of one prompt set the probe generated (`compute_acceptance` of its per-request histograms), with
    vLLM's global counters over the same generation and whether they agree with the per-request sums."""
    requests = raw.get("requests") or []
    acc = compute_acceptance([r["histogram"] for r in requests if r.get("histogram") is not None])
    counters = raw.get("counters") or {}
    agree = (counters.get("num_drafts") == acc.num_drafts
             and counters.get("num_accepted_tokens") == acc.num_accepted_tokens
             and list(counters.get("per_pos") or [])[: len(acc.accepted_per_pos)] == acc.accepted_per_pos)  # fmt: skip
    return {
        **acc.to_dict(), "engine": "vllm", "num_prompts": len(requests),
        "tokens_generated": sum(int(r.get("tokens") or 0) for r in requests),
        "num_draft_tokens": counters.get("num_draft_tokens"), "counters": counters,
        "counters_agree": bool(agree), "generate_seconds": raw.get("seconds"), "outputs": raw.get("outputs") or [],
        "histograms": [list(r.get("histogram") or []) for r in requests],
    }  # fmt: skip


#: Probe fields every vLLM report repeats (what was loaded, and whether parallel drafting is on).
_ENGINE_KEYS = ("vllm_version", "device", "hardware", "speculative_config", "mask_hidden_loaded",
                "parallel_drafting_ok", "problems", "load_seconds")


def serving_report(raw: Mapping[str, Any], plan: SpeedupPlan) -> dict[str, Any]:
    """The measured serving speedup of a probe result (`peagle.eval.speedup`): the (K, batch) table, the
    recommended K per batch size, the headline rows (trained K at batch 1 and at a batch of all prompts)
    and the AL of those same passes, with the hardware and engine facts."""
    sp = raw.get("speedup") or {}
    rows = summarize_speedup(sp.get("passes") or [])
    k = int((raw.get("speculative_config") or {}).get("num_speculative_tokens") or max(plan.ks))
    n = max(plan.batch_sizes)

    def row(b: int) -> dict[str, Any] | None:
        return next((r for r in rows if r["num_speculative_tokens"] == k and r["batch_size"] == b), None)

    hists = [q["histogram"] for p in sp.get("passes") or [] if p["side"] == "spec" and int(p["k"]) == k
             for q in p.get("requests") or [] if q.get("histogram") is not None]  # fmt: skip
    acc = compute_acceptance(hists).to_dict()
    return {
        "num_speculative_tokens": k, "batch_sizes": list(plan.batch_sizes), "rounds": plan.rounds,
        "num_prompts": plan.num_prompts, "batch_1": row(1), "batch_n": row(n) if n != 1 else None,
        "acceptance_length": acc["acceptance_length"], "per_position": acc["per_position"],
        "per_request_spread": acc["per_request_spread"],
        "table": rows, "recommended": recommend(rows),
        "engines": sp.get("engines"), "engines_reason": sp.get("engines_reason"),
        "outputs_identical": sp.get("outputs_identical"), "checks": sp.get("checks"),
        "load_seconds": sp.get("load_seconds"), "vllm_version": raw.get("vllm_version"),
        "hardware": raw.get("hardware"),
    }  # fmt: skip


def run_vllm_probe(
    export_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    num_speculative_tokens: int | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """AL of one prompt set in vLLM with parallel drafting (`peagle.engine.prober.run_probe` + `al_report`), flat.

    Returns:
        The engine facts (`speculative_config`, `mask_hidden_loaded`, `parallel_drafting_ok`, `problems`,
        `hardware`, ...) and the set's `al_report` (`acceptance_length`, `per_position`, counters,
        `per_request_spread`, `outputs`).
    """
    raw = run_probe(export_dir, al={"prompts": prompts}, max_new_tokens=max_new_tokens,
                    num_speculative_tokens=num_speculative_tokens, **kw)  # fmt: skip
    return {**{k: raw.get(k) for k in _ENGINE_KEYS}, "engine": "vllm", "max_new_tokens": max_new_tokens,
            **al_report(raw["al"]["sets"][0])}


def measure_vllm(
    export_dir: str | Path,
    sets: Mapping[str, Sequence[Sequence[int]]],
    *,
    max_new_tokens: int,
    num_speculative_tokens: int | None = None,
    speedup: SpeedupPlan | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """AL of every prompt set and (with `speedup`) the serving speedup on the first set, in ONE probe
    process (one draft-engine start for both).

    Returns:
        The engine facts, `prompt_sets` (name -> `al_report`, outputs included) and `serving`
        (`serving_report`, None without `speedup`).
    """
    first = next(iter(sets.values()), [])
    raw = run_probe(export_dir, al=sets, max_new_tokens=max_new_tokens, speedup=speedup, speedup_prompts=first,
                    num_speculative_tokens=num_speculative_tokens, **kw)  # fmt: skip
    reports = {s["name"]: al_report(s) for s in (raw.get("al") or {}).get("sets", [])}
    return {**{k: raw.get(k) for k in _ENGINE_KEYS}, "engine": "vllm", "prompt_sets": reports,
            "serving": serving_report(raw, speedup) if speedup is not None else None}


def compare_reports(reference: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """Side by side: AL and per-position of both engines, their ratio, and output agreement.

    Args:
        reference: `EvalReport.to_dict(with_outputs=True)` of the reference decoder.
        vllm: `run_vllm_probe` result (or a `measure_vllm` set report with the engine facts).
    """
    ref_al, v_al = reference.get("acceptance_length"), vllm.get("acceptance_length")
    ratio = v_al / ref_al if ref_al and v_al else None
    ref_out, v_out = reference.get("outputs") or [], vllm.get("outputs") or []
    same = sum(1 for a, b in zip(ref_out, v_out, strict=False) if list(a) == list(b))
    shared = ("acceptance_length", "per_position", "per_request_spread", "num_drafts", "tokens_generated")
    return {
        "reference": {k: reference.get(k) for k in shared},
        "vllm": {k: vllm.get(k) for k in (*shared, "speculative_config", "mask_hidden_loaded", "parallel_drafting_ok",
                                          "problems", "vllm_version", "device", "hardware")},
        "al_ratio_vllm_over_reference": ratio,
        "al_within_5pct": ratio is not None and abs(ratio - 1.0) <= 0.05,
        # Outputs are compared only when both sides carry them (None = not compared, not "0 identical").
        "identical_outputs": same if ref_out and v_out else None,
        "num_prompts": min(len(ref_out), len(v_out)) if ref_out and v_out else None,
    }
