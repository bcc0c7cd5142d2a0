"""Regeneration throughput: vLLM vs transformers `generate`, same target, prompts, limits and driver.

    .venv/bin/python -m bench.bench_regen [--convs 16] [--max-new-tokens 128] [--batch 8] [--dtype bfloat16]

Both engines run the project's regeneration driver (`peagle.data.regenerate`) on the same ShareGPT
conversations (their first user turn, cut to 400 characters, so every conversation is one answer), greedy,
`on_length: keep`, `batch_size` conversations in flight (vLLM) / per `generate` call (transformers), each
into an empty cache of its own. Tokens/s = generated tokens (end-of-turn included) / generation seconds;
the vLLM engine's start-up is reported apart. Writes bench/results/regen.json with
`ratio_vllm_over_hf` (target: at least 5). The engines run one after the other on a possibly shared
machine: compare figures of one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TARGET_RATIO = 5.0


def _prompts(n: int) -> list[list[dict[str, str]]]:
    from peagle.builtin import sharegpt_path
    from peagle.data.formats import IngestReport, iter_rows

    out = []
    for row in iter_rows(sharegpt_path(), "sharegpt", IngestReport(), max_samples=20 * n):
        m = row.messages or []
        if len(m) >= 2 and m[0]["role"] == "user" and len(m[0]["content"]) >= 40:
            out.append([{"role": "user", "content": m[0]["content"][:400]}, {"role": "assistant", "content": ""}])
        if len(out) == n:
            break
    return out


def _run(engine: str, convs: list, tok: Any, args: argparse.Namespace, open_backend: Any) -> dict[str, Any]:
    from peagle.data.regenerate import RegenSettings, regenerate_conversations

    s = RegenSettings(engine=engine, dtype=args.dtype, temperature=0.0, max_new_tokens=args.max_new_tokens,
                      on_length="keep", batch_size=args.batch, max_length=1024,
                      max_model_len=1024 + args.max_new_tokens)
    with tempfile.TemporaryDirectory() as cache:
        res = regenerate_conversations(convs, tok, s, identity={"bench": engine}, open_backend=open_backend,
                                       cache_dir=cache)
    rep = res.report
    return {"tokens": rep["tokens"], "seconds": rep["generation_seconds"], "tokens_per_s": rep["tokens_per_s"],
            "answers_cut": rep["answers_cut"], "conversations": rep["conversations"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--skip-hf", action="store_true", help="vLLM only (no ratio)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.builtin import smollm2_dir
    from peagle.data.regenerate_engines import HfBackend, open_vllm_backend
    from peagle.engine.locate import vllm_python
    from peagle.engine.server import EngineConfig

    if vllm_python() is None:
        print("regeneration: skipped, no vLLM venv (`make vllm-env` builds it)")
        return
    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    convs = _prompts(args.convs)
    load = (f"SmolLM2-135M-Instruct {args.dtype}, {len(convs)} ShareGPT prompts, greedy, max_new_tokens "
            f"{args.max_new_tokens}, {args.batch} in flight, CPU {os.cpu_count()} cores, load avg "
            f"{os.getloadavg()[0]:.1f}")
    print(f"regeneration: {load}", flush=True)

    cfg = EngineConfig(model=str(path), dtype=args.dtype, max_model_len=1024 + args.max_new_tokens)
    started: dict[str, float] = {}

    @contextlib.contextmanager
    def vllm_backend():
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp, open_vllm_backend(cfg, Path(tmp) / "engine.log") as backend:
            started["s"] = time.perf_counter() - t0
            yield backend

    out: dict[str, Any] = {"load": load}
    out["vllm"] = _run("vllm", convs, tok, args, vllm_backend)
    out["vllm"]["engine_start_s"] = round(started["s"], 1)
    print(f"  vLLM          {out['vllm']['tokens']:>6} tokens in {out['vllm']['seconds']:7.1f} s = "
          f"{out['vllm']['tokens_per_s']:7.1f} tokens/s (engine start {started['s']:.0f} s)", flush=True)
    if not args.skip_hf:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).eval()
        out["hf"] = _run("hf", convs, tok, args, lambda: contextlib.nullcontext(HfBackend(model, tok)))
        print(f"  transformers  {out['hf']['tokens']:>6} tokens in {out['hf']['seconds']:7.1f} s = "
              f"{out['hf']['tokens_per_s']:7.1f} tokens/s (torch threads {torch.get_num_threads()})", flush=True)
        ratio = out["vllm"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
        out.update(ratio_vllm_over_hf=round(ratio, 2), target=TARGET_RATIO, **{"pass": ratio >= TARGET_RATIO})
        print(f"  ratio vLLM / transformers: {ratio:.1f}x (target >= {TARGET_RATIO:g}x)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "regen.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
