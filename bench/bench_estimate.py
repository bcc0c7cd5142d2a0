"""Does the dry-run estimate hold? Each phase of a short demo run on this machine against its estimate.

`make bench` (or `python -m bench.bench_estimate`) trains `short_demo_spec()`: the demo preset with its
first phases shortened (96 conversations, 40 steps, 4 HumanEval prompts, one speedup round at K = 4), with
the target in vLLM when `.vllm-venv` exists (regeneration, capture, AL and speedup there, answers regenerated
from scratch: a fresh regeneration cache), into `.peagle/bench/estimate_run` (about 5-8 minutes on 2 quiet
cores). Then each phase's measured seconds (the trainer's `phase` events in `RUN/progress.jsonl`) are
compared with the calibrated model of `service.estimate` (no history: what a fresh service answers) for the
same spec on this machine's hardware class: every phase that took at least `MIN_PHASE_S` must be within
`WITHIN`x either way. Prints a table and a verdict; exit 1 when a phase missed.

    .venv/bin/python -m bench.bench_estimate               # run the short demo, then compare
    .venv/bin/python -m bench.bench_estimate --run RUN     # compare a finished run (e.g. the full demo)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.history import phase_seconds  # noqa: E402
from peagle.spec import TrainSpec, parse_spec, preset  # noqa: E402
from peagle.spec.hardware import cpu_facts  # noqa: E402
from service.estimate import estimate, spec_hardware  # noqa: E402 - after the checkout is on the path

RUN = ROOT / ".peagle" / "bench" / "estimate_run"
RESULT = ROOT / "bench" / "results" / "estimate.json"
WITHIN = 1.5
#: Phases shorter than this are listed but not judged (a second of scheduling noise is a large ratio).
MIN_PHASE_S = 5.0


def short_demo_spec() -> TrainSpec:
    """The demo preset with its first phases shortened to a few minutes (its own settings otherwise)."""
    data = preset("demo").model_dump(mode="json")
    data["name"] = "bench_estimate: the demo, shortened"
    data["data"]["sources"][0]["max_samples"] = 96
    data["data"]["eval_samples"] = 8
    data["optim"]["max_steps"] = 40
    data["checkpoints"]["every_steps"] = 20
    data["eval"].update(prompt_sets=[{"name": "humaneval", "num_prompts": 4}], speedup_rounds=1,
                        speedup_sweep=False, speedup_num_prompts=4)
    return parse_spec(data)


def train(spec: TrainSpec, run: Path) -> float:
    """Train `spec` into a fresh `run` (answers regenerated, none from a cache); its wall seconds."""
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    spec_file = run.parent / "estimate_spec.json"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json"), indent=1))
    with tempfile.TemporaryDirectory(prefix="bench-estimate-regen-") as cache:
        env = {**os.environ, "PEAGLE_REGEN_CACHE": cache}
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "peagle", "train", str(spec_file), "--out", str(run)],
                       check=True, cwd=ROOT, env=env)
        return time.time() - t0


def measure(run: Path, *, spec: TrainSpec | None = None, cpu_flags: frozenset[str] | None = None) -> dict[str, Any]:
    """Measured seconds of each phase of a finished `run` against the estimate of `spec` (default: the
    run's own resolved spec), with their ratios estimate / measured and whether each is within `WITHIN`x."""
    records = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines() if line.strip()]
    phases = [(r.get("phase"), datetime.fromtimestamp(float(r["time"]), UTC)) for r in records
              if r.get("type") == "event" and r.get("kind") == "phase"]
    if not phases or phases[-1][0] != "done":
        raise SystemExit(f"{run}: not a finished run (no `done` phase in progress.jsonl)")
    measured = phase_seconds(phases)
    total = (phases[-1][1] - phases[0][1]).total_seconds()
    if spec is None:
        spec = parse_spec(json.loads((run / "resolved_spec.json").read_text()))
    resolved = json.loads((run / "resolved_spec.json").read_text())
    flags = cpu_facts().cpu_flags if cpu_flags is None else cpu_flags
    vllm = (resolved.get("resources") or {}).get("target_engine") == "vllm"
    est = estimate(spec, dataset_rows={}, queue="bench", queue_position=0, vllm_available=vllm, cpu_flags=flags)
    per_phase: dict[str, dict[str, Any]] = {}
    # the job's start in a worker ("starting") comes before the first phase event: a run measures from that
    started = float(est["phase_seconds"].get("starting", 0.0))
    for p, s in est["phase_seconds"].items():
        if p == "starting":
            continue
        got = measured.get(p, 0.0)
        judged = got >= MIN_PHASE_S
        ratio = round(s / got, 3) if got >= 1.0 else None
        per_phase[p] = {"measured_s": round(got, 1), "estimate_s": s, "ratio": ratio,
                        **({"target": f"within {WITHIN}x", "pass": ratio is not None and 1 / WITHIN <= ratio <= WITHIN}
                           if judged else {})}
    ratio = (est["wall_clock_seconds"] - started) / max(total, 1e-9)
    judged_phases = [p for p, row in per_phase.items() if "pass" in row]
    return {"run": str(run), "hardware": spec_hardware(spec.resolve(cuda_available=False), flags),
            "target_dtype": est["target_dtype"], "target_engine": est["target_engine"],
            "measured_s": round(total, 1), "estimate_s": round(est["wall_clock_seconds"] - started, 1),
            "total_estimate_over_measured": round(ratio, 3),
            "pass": all(per_phase[p]["pass"] for p in judged_phases), "judged": judged_phases,
            "phases": per_phase, "accuracy": est["accuracy"],
            "load_average_now": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=None, help="a finished RUN to compare (default: train the short demo)")
    args = ap.parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    if args.run is None:
        spec = short_demo_spec()
        print(f"==> training the shortened demo into {RUN} (about 5-8 minutes on 2 quiet cores)", flush=True)
        wall = train(spec, RUN)
        rep = measure(RUN, spec=spec)
        rep["wall_s"] = round(wall, 1)
    else:
        rep = measure(args.run)
    rep["load_average_before"] = load_before
    print(f"{'phase':16s} {'measured s':>10s} {'estimate s':>10s} {'est/meas':>9s}  within {WITHIN}x")
    for phase, row in rep["phases"].items():
        verdict = {True: "yes", False: "NO"}.get(row.get("pass"), f"(< {MIN_PHASE_S:.0f} s: not judged)")
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        print(f"{phase:16s} {row['measured_s']:10.1f} {row['estimate_s']:10.1f} {ratio:>9s}  {verdict}")
    print(f"total: measured {rep['measured_s']} s, estimate {rep['estimate_s']} s "
          f"({rep['total_estimate_over_measured']}x); {rep['hardware']}, target {rep['target_dtype']} in "
          f"{rep['target_engine']}; load average before {load_before}, now {rep['load_average_now']}")
    print(f"verdict: every phase of >= {MIN_PHASE_S:.0f} s within {WITHIN}x of its estimate: "
          f"{'met' if rep['pass'] else 'MISSED'}")
    if args.run is None:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(rep, indent=1) + "\n")
    return 0 if rep["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
