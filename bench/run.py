"""`make bench`: run every benchmark in its own process, then print one table of ratios.

Each `bench/bench_*.py` measures ours against its peer in the same run and writes
`bench/results/<name>.json`. Every numeric field whose name contains `ratio` is listed in the table
(with a `target` and `pass` when the benchmark states one); the raw JSON stays for tracking.
Select benchmarks with `make bench BENCH="core train_step"` (names without the `bench_` prefix).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peagle import ONEDNN_CACHE_BOUNDS  # noqa: E402 - after the checkout is on the path

RESULTS = ROOT / "bench" / "results"


def _flatten(prefix: str, obj: object, out: list[tuple[str, object]]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out.append((prefix, obj))


def _rows(data: dict) -> list[tuple[str, str, str, str]]:
    flat: list[tuple[str, object]] = []
    _flatten("", data, flat)
    values = dict(flat)
    rows = []
    for key, val in flat:
        if "ratio" in key.split(".")[-1] and isinstance(val, int | float):
            base = key.rsplit(".", 1)[0] if "." in key else ""
            target = values.get(f"{base}.target" if base else "target", "")
            ok = values.get(f"{base}.pass" if base else "pass", "")
            al = values.get(f"{base}.al" if base else "al")  # a serving speedup is shown next to its AL
            name = f"{key} (AL {al:.2f})" if isinstance(al, int | float) else key
            rows.append((name, f"{val:.3f}", str(target), {True: "yes", False: "NO"}.get(ok, "")))  # type: ignore[arg-type]
    return rows


def main() -> int:
    wanted = os.environ.get("BENCH", "").split()
    scripts = sorted(ROOT.glob("bench/bench_*.py"))
    if wanted:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
    RESULTS.mkdir(parents=True, exist_ok=True)
    failures = []
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        print(f"==> {name}", flush=True)
        t0 = time.time()
        # the oneDNN kernel-cache bounds `python -m peagle` sets for training runs (see peagle/__main__.py)
        env = {**ONEDNN_CACHE_BOUNDS, **os.environ}
        proc = subprocess.run([sys.executable, "-m", f"bench.{script.stem}"], cwd=ROOT, env=env)
        print(f"    ({time.time() - t0:.0f} s, exit {proc.returncode})", flush=True)
        if proc.returncode != 0:
            failures.append(name)
    print()
    print(f"{'benchmark':<18} {'ratio':<52} {'value':>8}  {'target':<10} pass")
    for path in sorted(RESULTS.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        for key, val, target, ok in _rows(data):
            print(f"{path.stem:<18} {key:<52} {val:>8}  {target:<10} {ok}")
    if failures:
        print(f"\nfailed: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
