"""Acceptance length: reference decoder vs vLLM, and our trained draft vs untrained / peer drafts (issue 6).

For a finished `peagle train` run (default: the demo preset's RUN), measures on the first N HumanEval
prompts (default 40, 128 new tokens, K=4, greedy, chat-templated):
  * `untrained`: the run's draft at step 0 with random layers (same seed, vocab, mask token; embeddings /
    lm_head from the target), and `init`: the step-0 draft the run actually started from (`layer_init`),
  * `trained`: RUN/export (the best checkpoint, bf16 as served),
  * `peer` (optional `--peer DIR`): an export of a draft trained by speculators' own PEagleDraftModel + loss,
each with the pure-PyTorch reference decoder and (when `.vllm-venv` exists) vLLM CPU with parallel drafting.
Prints the vLLM/reference AL agreement ratio (target: within 5 %) and our/peer AL ratio (target >= 1), and
writes bench/results/al.json. Each (draft, engine) measurement is cached in .peagle/bench/al/ so stages can
run at different times (`--drafts`, `--engines`; `--force` re-measures).

    .venv/bin/python bench/bench_al.py --run RUN [--peer DIR] [--drafts untrained,trained] [--engines reference,vllm]
    .venv/bin/python -m bench.bench_al      (`make bench`: trains the demo run and the peer draft if missing)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = ROOT / ".peagle" / "bench" / "al"
RESULTS = ROOT / "bench" / "results"
DEMO_RUN = ROOT / ".peagle" / "bench" / "demo_run"
PEER_EXPORT = ROOT / ".peagle" / "bench" / "peer_export"
PEER_PY = ROOT / ".peer-venv" / "bin" / "python"


def ensure_demo_run(run: Path) -> bool:
    """Train the demo preset into `run` unless it already holds an export; True if it trained now."""
    if (run / "export" / "config.json").exists():
        return False
    print(f"==> no demo run in {run}: training the demo preset (about an hour on 2 idle cores: docs/decisions.md decision 18)", flush=True)
    subprocess.run([sys.executable, "-m", "peagle", "train", "demo", "--out", str(run), "--resume", "auto"],
                   check=True, cwd=ROOT)
    return True


def verifier_folder(export: Path, cfg: dict[str, Any]) -> Path | str:
    """What loads the verifier that an export's config `cfg` names, on this machine (`local_verifier`).

    Raises:
        SystemExit: the export names no verifier.
    """
    from peagle.builtin import local_verifier
    from peagle.export.writer import verifier_of

    name = verifier_of(cfg)
    if name is None:
        raise SystemExit(f"{export}: the export names no verifier (speculators_config.verifier.name_or_path)")
    return local_verifier(name)


def ensure_peer_export(run: Path, out: Path) -> Path | None:
    """The peer draft (speculators' own model + loss on the run's features), trained if missing."""
    if (out / "config.json").exists():
        return out
    if not PEER_PY.exists():
        print("peer draft skipped: .peer-venv missing (bash bench/peer_env.sh)", flush=True)
        return None
    print(f"==> training the peer draft from {run} into {out} (speculators 0.9.0, same features/steps/seed)",
          flush=True)
    subprocess.run([str(PEER_PY), str(ROOT / "bench" / "peer_train_al.py"), "--run", str(run), "--out", str(out)],
                   check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    return out


def untrained_export(run: Path, out: Path, layer_init: str = "random") -> Path:
    """Export the run's step-0 draft, built as the pipeline builds it with `draft.layer_init` =
    `layer_init` ("random": the issue's untrained random draft; "target": what the run started from)."""
    import torch

    from peagle.data.vocab import load_vocab
    from peagle.export.writer import export_draft
    from peagle.pipeline import build_initial_draft, verifier_name
    from peagle.spec import parse_spec
    from peagle.target.loader import load_target

    spec = parse_spec(json.loads((run / "resolved_spec.json").read_text()))
    spec.draft.layer_init = layer_init  # type: ignore[assignment]
    model, _, path = load_target(spec, torch.device("cpu"))
    vocab = load_vocab(run / "data" / "vocab.safetensors")
    if vocab.t2d is None:  # full vocab: DraftVocab carries no mapping
        vocab.selected = torch.arange(int(model.config.vocab_size))
    draft = build_initial_draft(
        spec, model, vocab, int(spec.draft.mask_token_id), list(spec.draft.aux_layer_ids)
    )
    return export_draft(
        draft,
        out,
        num_speculative_tokens=spec.peagle.num_depths,
        verifier_name_or_path=verifier_name(spec, path),
        verifier_architectures=list(model.config.architectures or ["LlamaForCausalLM"]),
    )


def measure(name: str, export: Path, engine: str, args: argparse.Namespace) -> dict:
    from peagle.cli.evaluate import run_eval

    CACHE.mkdir(parents=True, exist_ok=True)
    tag = engine if engine != "reference" or args.dtype == "float32" else f"reference-{args.dtype}"
    cache = CACHE / f"{name}_{tag}_{args.num_prompts}x{args.max_new_tokens}_k{args.k}.json"
    if cache.exists() and not args.force:
        return json.loads(cache.read_text())
    t0 = time.time()
    rep = run_eval(
        export,
        prompts="humaneval",
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.k,
        engine=engine,
        dtype=args.dtype,
    )
    rep["wall_seconds"] = round(time.time() - t0, 1)
    rep["export"] = str(export)
    cache.write_text(json.dumps(rep))
    print(
        f"{name:10s} {engine:9s} AL {rep.get('acceptance_length')}  per-position "
        f"{[round(x, 3) for x in rep.get('per_position') or []]}  ({rep['wall_seconds']} s)",
        flush=True,
    )
    return rep


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=None,
                   help=f"a finished `peagle train` run directory (default: {DEMO_RUN.relative_to(ROOT)}, "
                        "trained with the demo preset if missing)")
    p.add_argument("--peer", type=Path, default=None,
                   help=f"export dir of the peer-trained draft (default: {PEER_EXPORT.relative_to(ROOT)}, trained "
                        "from the run by bench/peer_train_al.py in .peer-venv if missing)")
    p.add_argument("--drafts", default="untrained,init,trained,peer",
                   help="untrained = step 0 with random layers, init = step 0 as the run started (its layer_init)")
    p.add_argument("--draft-dir", action="append", default=[], help="NAME=EXPORT_DIR, another draft to measure")
    p.add_argument("--engines", default="reference,vllm")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", help="reference decoder dtype (vLLM CPU serves bf16)")
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    if args.run is None:  # `make bench`: one command from nothing to the AL table
        args.run = DEMO_RUN
        if ensure_demo_run(DEMO_RUN):
            shutil.rmtree(PEER_EXPORT, ignore_errors=True)
            shutil.rmtree(CACHE, ignore_errors=True)  # measurements of an earlier run
            shutil.rmtree(CACHE.parent / "untrained_export", ignore_errors=True)
            shutil.rmtree(CACHE.parent / "init_export", ignore_errors=True)
        if args.peer is None and "peer" in args.drafts.split(","):
            args.peer = ensure_peer_export(DEMO_RUN, PEER_EXPORT)

    from peagle.eval.serve_check import vllm_python

    engines = [e for e in args.engines.split(",") if e and (e != "vllm" or vllm_python() is not None)]
    exports: dict[str, Path] = {}
    for name in args.drafts.split(","):
        if name == "trained" and (args.run / "export" / "config.json").exists():
            exports["trained"] = args.run / "export"
        elif name in ("untrained", "init"):  # step 0 with random layers / with the run's layer init
            out = CACHE.parent / f"{name}_export"
            exports[name] = (
                out
                if (out / "config.json").exists() and not args.force
                else untrained_export(args.run, out, "random" if name == "untrained" else "target")
            )
        elif name == "peer" and args.peer is not None:
            exports["peer"] = args.peer
    for item in args.draft_dir:
        name, _, path = item.partition("=")
        exports[name] = Path(path)
    results: dict[str, dict] = {}
    for name, export in exports.items():
        for engine in engines:
            results.setdefault(name, {})[engine] = measure(name, export, engine, args)

    # Merge with what earlier invocations measured (same settings), so one al.json has everything.
    suffix = f"_{args.num_prompts}x{args.max_new_tokens}_k{args.k}.json"
    for f in sorted(CACHE.glob(f"*{suffix}")):
        name, tag = f.name.removesuffix(suffix).rsplit("_", 1)
        if tag.startswith("reference") and tag != ("reference" if args.dtype == "float32" else f"reference-{args.dtype}"):
            continue  # a reference measurement in another dtype
        engine = "reference" if tag.startswith("reference") else tag
        results.setdefault(name, {}).setdefault(engine, json.loads(f.read_text()))

    def al(name: str, engine: str) -> float | None:
        return (results.get(name, {}).get(engine) or {}).get("acceptance_length")

    summary: dict = {
        "settings": {
            "prompts": "humaneval",
            "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens,
            "num_speculative_tokens": args.k,
            "reference_dtype": args.dtype,
            "run": str(args.run),
        },
        "drafts": {
            name: {
                engine: {
                    k: r.get(k)
                    for k in (
                        "acceptance_length",
                        "per_position",
                        "tokens_generated",
                        "num_drafts",
                        "wall_seconds",
                        "speculative_config",
                        "mask_hidden_loaded",
                        "parallel_drafting_ok",
                        "device",
                    )
                    if k in r
                }
                for engine, r in res.items()
            }
            for name, res in results.items()
        },
    }
    for name in results:
        ref, vl = al(name, "reference"), al(name, "vllm")
        if ref and vl:
            ratio = vl / ref
            summary[f"{name}_vllm_vs_reference"] = {
                "ratio": ratio,
                "target": "0.95..1.05",
                "pass": abs(ratio - 1) <= 0.05,
            }
    ours, peer = al("trained", "reference"), al("peer", "reference")
    if ours and peer:
        summary["ours_vs_peer"] = {"ratio": ours / peer, "target": ">= 1.0", "pass": ours >= peer}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "al.json").write_text(json.dumps(summary, indent=2))
    for key, val in summary.items():
        if isinstance(val, dict) and "ratio" in val:
            print(f"{key}: ratio {val['ratio']:.4f} (target {val['target']}, pass {val['pass']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
