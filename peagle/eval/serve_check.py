"""vLLM serve check: load an export in a real vLLM engine with parallel drafting and measure AL there.

vLLM lives in its own venv (`make vllm-env` builds `.vllm-venv`; it pins a different transformers), so
this module never imports it: it writes the tokenised prompts to a temp file, runs
`peagle/eval/vllm_probe.py` with that venv's Python and reads back its JSON (see the probe's docstring for
what it verifies). `PEAGLE_VLLM_PYTHON` points at another interpreter (e.g. a GPU vLLM on a GPU worker);
the probe uses CUDA when that interpreter's torch sees a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from peagle.engine.locate import vllm_python
from peagle.errors import ResourceError
from peagle.eval.acceptance import compute_acceptance
from peagle.eval.speedup import SpeedupPlan, recommend, summarize_speedup

__all__ = ["al_report", "compare_reports", "loadable_export", "measure_vllm", "probe_script", "run_probe",
           "run_vllm_probe", "serving_report", "vllm_python"]

def probe_script() -> Path:
    """Path of the script run inside the vLLM venv."""
    return Path(__file__).resolve().with_name("vllm_probe.py")


def _verifier_of(export_dir: Path) -> str | None:
    from peagle.errors import ExportInvalidError
    from peagle.export.rules import read_export_config, verifier_of

    try:
        return verifier_of(read_export_config(export_dir))
    except ExportInvalidError:
        return None


@contextlib.contextmanager
def loadable_export(export_dir: str | Path, verifier: str | Path | None) -> Iterator[Path]:
    """The export as vLLM on this machine must see it: its config naming `verifier` (a local folder).

    Exports name a portable verifier (a hub id, `builtin:tiny-llama`); loading one here needs the local
    folder. When the names differ, yields a temporary folder with a rewritten `config.json` and links to
    the other files (the export itself is never touched); else yields the export.
    """
    src = Path(export_dir).resolve()
    name = str(verifier.resolve()) if isinstance(verifier, Path) else verifier
    if verifier is None or _verifier_of(src) in (None, name):
        yield src
        return
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg["speculators_config"]["verifier"]["name_or_path"] = name
    with tempfile.TemporaryDirectory(prefix="peagle-export-") as tmp:
        view = Path(tmp) / src.name
        view.mkdir()
        for entry in src.iterdir():
            if entry.name != "config.json":
                (view / entry.name).symlink_to(entry)
        (view / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        yield view


def run_probe(
    export_dir: str | Path,
    *,
    al: Mapping[str, Sequence[Sequence[int]]] | None = None,
    max_new_tokens: int = 128,
    speedup: SpeedupPlan | None = None,
    speedup_prompts: Sequence[Sequence[int]] | None = None,
    num_speculative_tokens: int | None = None,
    max_model_len: int | None = None,
    timeout_s: float = 3600.0,
    python: str | Path | None = None,
    log_path: str | Path | None = None,
    verifier: str | Path | None = None,
) -> dict[str, Any]:
    """Run `vllm_probe.py` on an export and return its raw JSON (module docstring of the probe).

    Args:
        export_dir: a speculators-format export.
        al: prompt set name -> token ids per prompt (chat-templated, identical to the reference decoder's);
            each set is generated in one batch and reported per request.
        max_new_tokens: per prompt (greedy), for `al` and the speedup passes.
        speedup: what to time (`peagle.eval.speedup.plan_speedup`), on `speedup_prompts`.
        num_speculative_tokens: K of the draft engine; None = `speculative_tokens` of the config.
        max_model_len: vLLM's context limit; None = the longest prompt + new tokens + K, at least 1024.
        timeout_s: wall-clock limit for the subprocess.
        python: the vLLM interpreter; None = `vllm_python()`.
        log_path: where vLLM's own output goes (default: a temp file, named in errors).
        verifier: the target vLLM loads (a local folder); None = the export's verifier mapped to this
            machine by `peagle.builtin.local_verifier` (a builtin's hub id -> its offline folder).

    Raises:
        ResourceError: no vLLM venv, or the probe crashed / timed out (message names the log's last lines).
    """
    py = Path(python) if python is not None else vllm_python()
    if py is None:
        raise ResourceError(
            "vLLM is not installed: run `make vllm-env` (builds .vllm-venv) or set PEAGLE_VLLM_PYTHON"
        )
    named = _verifier_of(Path(export_dir))
    if verifier is None and named:
        from peagle.builtin import local_verifier

        verifier = local_verifier(named)
    sets = {name: [list(map(int, p)) for p in prompts] for name, prompts in (al or {}).items()}
    timed = speedup.for_probe(speedup_prompts or [], max_new_tokens) if speedup is not None else None
    longest = max((len(p) for ps in [*sets.values(), (timed or {}).get("prompts", [])] for p in ps), default=0)
    with loadable_export(export_dir, verifier) as model_dir, \
            tempfile.TemporaryDirectory(prefix="peagle-vllm-") as tmp:
        plan = {
            "model": str(model_dir),
            "verifier": str(verifier if verifier is not None else named),
            "num_speculative_tokens": num_speculative_tokens,
            "max_model_len": max_model_len or max(1024, longest + max_new_tokens + 40),
            "al": {"max_new_tokens": max_new_tokens, "sets": [{"name": n, "prompts": p} for n, p in sets.items()]}
            if sets else None,
            "speedup": timed,
            "calibrate": bool(speedup is not None and speedup.calibrate),
        }
        plan_file, out_file = Path(tmp) / "plan.json", Path(tmp) / "result.json"
        plan_file.write_text(json.dumps(plan), encoding="utf-8")
        log = Path(log_path) if log_path is not None else Path(tmp) / "vllm.log"
        cmd = [str(py), str(probe_script()), "--plan", str(plan_file), "--out", str(out_file)]
        # TQDM_DISABLE would crash vLLM's generate (it divides by the disabled bar's elapsed time, 0).
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "VIRTUAL_ENV")) and k != "TQDM_DISABLE"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        iomp = py.parent.parent / "lib" / "libiomp5.so"  # vLLM CPU wants Intel OpenMP preloaded for spec decode
        if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
        env["HF_HUB_OFFLINE"] = "1"
        with log.open("w") as fh:
            try:
                proc = subprocess.run(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False
                )
            except subprocess.TimeoutExpired:
                raise ResourceError(f"vLLM probe timed out after {timeout_s:.0f} s") from None
        if not out_file.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise ResourceError(f"vLLM probe failed (exit {proc.returncode}): " + " | ".join(tail))
        result: dict[str, Any] = json.loads(out_file.read_text())
    return result


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
    """AL of one prompt set in vLLM with parallel drafting (`run_probe` + `al_report`), flat.

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
