"""Several drafts of one target measured on the same prompts in vLLM: what promotion decides on.

    compare_exports({"child": dir_a, "current": dir_b}, spec, batch_sizes=[1, 8], rounds=2)

One vLLM engine holds one draft, so the drafts are measured by ALTERNATING ENGINE STARTS on identical
prompt token ids: round r measures every draft once (`peagle.eval.serve_check.measure_vllm`: AL on every
prompt set, and the served speedup against the verifier alone, timed interleaved with it inside that
probe), the order of the drafts reversed from round to round, so drift in the machine's load over the
rounds hits every draft alike. Each draft's speedup is a paired ratio against the verifier measured
beside it (`peagle.eval.speedup`), so the drafts' numbers compare although they ran in separate probes.
Per (K, batch size) the rounds' ratios are pooled (`merge_rounds`: the median of all of them).

A draft's numbers: `{"acceptance_length", "per_position" (first prompt set), "prompt_sets": {name: {...}},
"num_speculative_tokens", "serving": {"table": rows, "recommended": [...]}, "parallel_drafting_ok",
"problems"}` (what `peagle.eval.promotion.decide` reads). Greedy decoding repeats a draft's AL exactly on
the same prompts, so the AL is the first round's.

Where this machine's vLLM cannot run the drafts (no vLLM; the CPU build and a head size its attention
refuses, as the `tiny` preset's target), `comparison_problems` says so and nothing is measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any

from peagle.eval.speedup import plan_speedup, recommend, speedup_text
from peagle.spec import TrainSpec

__all__ = ["METHOD", "compare_drafts", "compare_exports", "comparison_problems", "merge_rounds"]

#: How the drafts share a run (stored with every comparison).
METHOD = "alternating engine starts on identical prompts (one draft per vLLM engine), order reversed each round"


def comparison_problems(exports: Mapping[str, Path]) -> list[str]:
    """Why this machine cannot measure the drafts in `exports` (name -> export folder) in vLLM; [] if it can."""
    from peagle.engine.locate import vllm_python
    from peagle.engine.machine import vllm_here_problems

    if vllm_python() is None:
        return ["vLLM is not installed on this worker (make vllm-env)"]
    out = []
    for name, d in exports.items():
        if not (Path(d) / "config.json").is_file() or not (Path(d) / "model.safetensors").is_file():
            out.append(f"{name}: no export (config.json + model.safetensors) at its checkpoint")
            continue
        out += [f"{name}: {p}" for p in vllm_here_problems(Path(d))]
    return list(dict.fromkeys(out))


def merge_rounds(tables: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (K, batch size) from several rounds' `summarize_speedup` tables: every round's paired
    ratios pooled (`speedup` their median, `speedup_per_round` all of them), tokens/s the medians, the AL
    and acceptance per position the first round's. Sorted by K then batch size."""
    cells: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for table in tables:
        for row in table:
            cells.setdefault((int(row["num_speculative_tokens"]), int(row["batch_size"])), []).append(row)
    out = []
    for (k, b), rows in sorted(cells.items()):
        ratios = [float(x) for r in rows for x in (r.get("speedup_per_round") or [r["speedup"]])]
        s = median(ratios)
        out.append({"num_speculative_tokens": k, "batch_size": b, "rounds": len(ratios), "speedup": s,
                    "speedup_text": speedup_text(s), "speedup_per_round": ratios,
                    "base_tokens_per_s": median(float(r["base_tokens_per_s"]) for r in rows),
                    "spec_tokens_per_s": median(float(r["spec_tokens_per_s"]) for r in rows),
                    "acceptance_length": rows[0].get("acceptance_length"),
                    "per_position": rows[0].get("per_position")})
    return out


def _numbers(first: Mapping[str, Any], tables: Sequence[Sequence[Mapping[str, Any]]], k: int) -> dict[str, Any]:
    sets = first.get("prompt_sets") or {}
    keep = ("acceptance_length", "per_position", "per_request_spread", "num_prompts", "tokens_generated")
    per_set = {name: {key: r.get(key) for key in keep} for name, r in sets.items()}
    head = next(iter(per_set.values()), {})
    table = merge_rounds(tables)
    return {"acceptance_length": head.get("acceptance_length"), "per_position": head.get("per_position"),
            "prompt_sets": per_set, "num_speculative_tokens": k,
            "serving": {"table": table, "recommended": recommend(table)} if table else None,
            "parallel_drafting_ok": first.get("parallel_drafting_ok"), "problems": first.get("problems") or [],
            "vllm_version": first.get("vllm_version"), "hardware": first.get("hardware")}


def compare_drafts(
    exports: Mapping[str, Path], sets: Mapping[str, Sequence[Sequence[int]]], *, verifier: Path | str,
    max_new_tokens: int, batch_sizes: Sequence[int], num_prompts: int, rounds: int = 2, sweep: bool = False,
    measure: Callable[..., dict[str, Any]] | None = None, log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every draft of `exports` (name -> export folder) on `sets` (name -> prompt token ids),
    `rounds` rounds of alternating engine starts (module docstring).

    Args:
        batch_sizes: the batch sizes timed besides 1 and `num_prompts` (`plan_speedup`).
        num_prompts: prompts of the first set the speedup is timed on.
        sweep: every K from 1 to each draft's own K (one engine start each), else its own K only.
        measure: `measure_vllm` (the default) or a stand-in with its signature.

    Returns:
        `{"method", "rounds", "order": [[names of round 0], ...], "drafts": {name: numbers}}`.
    """
    from peagle.export.rules import read_export_config
    from peagle.export.writer import num_speculative_tokens_of

    if measure is None:
        from peagle.eval.serve_check import measure_vllm

        measure = measure_vllm
    names = list(exports)
    ks = {n: num_speculative_tokens_of(read_export_config(exports[n])) for n in names}
    first: dict[str, dict[str, Any]] = {}
    tables: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    order = []
    for r in range(max(1, int(rounds))):
        this = names if r % 2 == 0 else names[::-1]
        order.append(list(this))
        for name in this:
            plan = plan_speedup(ks[name], num_prompts, sweep=sweep, batch_sizes=batch_sizes, rounds=1)
            if log is not None:
                log(f"round {r + 1}/{rounds}: {name} (K={ks[name]}, batch sizes {plan.batch_sizes})")
            res = measure(exports[name], sets, max_new_tokens=max_new_tokens, num_speculative_tokens=ks[name],
                          speedup=plan, verifier=verifier)
            first.setdefault(name, res)
            tables[name].append(list((res.get("serving") or {}).get("table") or []))
    return {"method": METHOD, "rounds": max(1, int(rounds)), "order": order,
            "drafts": {n: _numbers(first[n], tables[n], ks[n]) for n in names}}


def compare_exports(
    exports: Mapping[str, Path], spec: TrainSpec, *, batch_sizes: Sequence[int], rounds: int = 2,
    heldout_from: Path | None = None, log: Callable[[str], None] | None = None,
    measure: Callable[..., dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`compare_drafts` on `spec`'s prompt sets (`eval.prompt_sets`, its `max_new_tokens`, the speedup on
    the first `eval.speedup_num_prompts` prompts of the first set; the `heldout` set from the run of
    `heldout_from`), the verifier being `spec.target.model` as this machine loads it."""
    from transformers import AutoTokenizer

    from peagle.builtin import local_verifier
    from peagle.data.prompts import PromptSources, prompt_ids, run_heldout_prompts
    from peagle.spec import HELDOUT_PROMPT_SET

    verifier = local_verifier(spec.target.model)
    tok = AutoTokenizer.from_pretrained(str(verifier))
    sources = None
    held = [ps for ps in spec.eval.prompt_sets if ps.name == HELDOUT_PROMPT_SET]
    if held and heldout_from is not None:
        sources = PromptSources(heldout=run_heldout_prompts(heldout_from, held[0].num_prompts))
    sets = dict(prompt_ids(spec, tok, sources))
    if not sets:
        raise ValueError("eval.prompt_sets: no prompt set to compare the drafts on")
    n = min(spec.eval.speedup_num_prompts, len(next(iter(sets.values()))))
    return compare_drafts(exports, sets, verifier=verifier, max_new_tokens=spec.eval.max_new_tokens,
                          batch_sizes=batch_sizes, num_prompts=n, rounds=rounds, sweep=spec.eval.speedup_sweep,
                          measure=measure, log=log)
