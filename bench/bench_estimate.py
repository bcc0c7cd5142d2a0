"""Does the dry-run estimate hold? Measured wall time of a finished run against the estimate of its spec.

Reads a finished `peagle train` RUN (default: the demo run `bench.bench_al` trains under
`.peagle/bench/demo_run`; `make bench` runs this after it), takes each phase's measured seconds from
`RUN/progress.jsonl` (the trainer's `phase` events) and compares them with the calibrated model of
`api.estimate` (no history: what a fresh service answers) for the run's own spec. Prints the ratio
estimate / measured per phase and in total, and passes when the total is within 1.5x either way.

    .venv/bin/python -m bench.bench_estimate                 # the demo run of bench_al
    .venv/bin/python -m bench.bench_estimate --run RUN        # any finished run (e.g. a short demo run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.estimate import estimate  # noqa: E402 - after the checkout is on the path
from api.history import phase_seconds  # noqa: E402
from peagle.spec import parse_spec  # noqa: E402

DEMO_RUN = ROOT / ".peagle" / "bench" / "demo_run"
RESULT = ROOT / "bench" / "results" / "estimate.json"
WITHIN = 1.5


def measure(run: Path) -> dict[str, Any]:
    """Measured phase seconds, total seconds and the estimate of `run`'s spec, with their ratios."""
    records = [json.loads(line) for line in (run / "progress.jsonl").read_text().splitlines() if line.strip()]
    phases = [(r.get("phase"), datetime.fromtimestamp(float(r["time"]), UTC)) for r in records
              if r.get("type") == "event" and r.get("kind") == "phase"]
    if not phases or phases[-1][0] != "done":
        raise SystemExit(f"{run}: not a finished run (no `done` phase in progress.jsonl)")
    measured = phase_seconds(phases)
    total = (phases[-1][1] - phases[0][1]).total_seconds()
    spec = parse_spec(json.loads((run / "resolved_spec.json").read_text()))
    est = estimate(spec, dataset_rows={}, queue="bench", queue_position=0)
    per_phase = {p: {"measured_s": round(measured.get(p, 0.0), 1), "estimate_s": s,
                     "ratio": round(s / measured[p], 3) if measured.get(p, 0.0) >= 1.0 else None}
                 for p, s in est["phase_seconds"].items()}
    ratio = est["wall_clock_seconds"] / max(total, 1e-9)
    return {"run": str(run), "measured_s": round(total, 1), "estimate_s": est["wall_clock_seconds"],
            "estimate_over_measured_ratio": round(ratio, 3), "target": f"within {WITHIN}x",
            "pass": 1 / WITHIN <= ratio <= WITHIN, "phases": per_phase, "accuracy": est["accuracy"],
            "load_average_now": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=None, help="a finished RUN (default: the demo run of bench_al)")
    args = ap.parse_args(argv)
    run = args.run or DEMO_RUN
    if args.run is None and not (run / "progress.jsonl").exists():
        from bench.bench_al import ensure_demo_run

        ensure_demo_run(run)
    rep = measure(run)
    for phase, row in rep["phases"].items():
        print(f"  {phase:15s} measured {row['measured_s']:8.1f} s  estimate {row['estimate_s']:8.1f} s  "
              f"ratio {row['ratio']}")
    print(f"total: measured {rep['measured_s']} s, estimate {rep['estimate_s']} s, "
          f"estimate/measured {rep['estimate_over_measured_ratio']} (target {rep['target']}: "
          f"{'met' if rep['pass'] else 'MISSED'}; load average now {rep['load_average_now']}: the calibrated model is "
          "for a quiet machine)")
    if args.run is None:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(rep, indent=1) + "\n")
    return 0 if rep["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
