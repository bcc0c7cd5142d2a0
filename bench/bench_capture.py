"""Capture throughput: target features through vLLM vs the in-process transformers capture (issue 17).

Same target (SmolLM2-135M-Instruct, bf16), same packed rows (templated ShareGPT conversations packed into
rows of `--pack` tokens), same features (3 aux states + the final normed state). Ours-in-process is
`TargetCapture.hidden` over micro-batches of `--rows-per-call` rows (what `write_feature_shards` does);
the engine is `VllmCapture.hidden` over the same rows (one request per document, many in flight), timed
after the engine is ready (its start is reported separately). Interleaved A/B/A/B over `--rounds` rounds;
the ratio is the median of the per-round ratios.

    .venv/bin/python -m bench.bench_capture [--rows 32] [--pack 1024] [--rounds 3]

Writes bench/results/capture.json: `vllm_over_hf_tokens_per_s_ratio` (report only, no target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--pack", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows-per-call", type=int, default=4)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.builtin import sharegpt_path, smollm2_dir
    from peagle.data.formats import IngestReport, iter_rows
    from peagle.data.packing import pack_documents
    from peagle.data.template import tokenize_many
    from peagle.engine.locate import vllm_python
    from peagle.engine.server import CaptureOptions, EngineConfig, VllmServer
    from peagle.target.capture import TargetCapture
    from peagle.target.parts import load_target_parts
    from peagle.target.vllm_capture import VllmCapture

    out = ROOT / "bench" / "results" / "capture.json"
    if vllm_python() is None:
        out.write_text(json.dumps({"skipped": "no vLLM venv (make vllm-env)"}))
        sys.stdout.write("skipped: no vLLM venv\n")
        return 0
    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    convs = [r.messages for r in iter_rows(sharegpt_path(), "sharegpt", IngestReport(), max_samples=args.rows * 4)]
    enc = tokenize_many(tok, convs, max_length=args.pack // 2, think="keep", workers=1)
    rows = pack_documents([(e.input_ids, e.loss_mask) for e in enc if sum(e.loss_mask)], args.pack, seed=0)
    rows = rows.select(list(range(min(args.rows, len(rows)))))
    tokens = int((rows.document_ids >= 0).sum())
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    n = model.config.num_hidden_layers
    aux = [2, n // 2, n - 3]
    hf = TargetCapture(model, aux)
    parts = load_target_parts(path, dtype=torch.bfloat16)
    k = args.rows_per_call

    def run_hf() -> float:
        t0 = time.perf_counter()
        for b in range(0, len(rows), k):
            part = rows.select(list(range(b, min(b + k, len(rows)))))
            hf.hidden(part.input_ids, part.document_ids)
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        cfg = EngineConfig(model=str(path), dtype="bfloat16", max_model_len=args.pack + 1,
                           capture=CaptureOptions(layer_ids=(*aux, n), storage_dir=Path(tmp) / "hs"))
        t0 = time.perf_counter()
        with VllmServer(cfg, log_path=Path(tmp) / "engine.log", name="capture engine") as server:
            start_s = time.perf_counter() - t0
            cap = VllmCapture(server, parts, aux)
            cap.hidden(rows.input_ids[:1], rows.document_ids[:1])  # warm-up

            def run_vllm() -> float:
                t1 = time.perf_counter()
                cap.hidden(rows.input_ids, rows.document_ids)
                return time.perf_counter() - t1

            hf_s, vllm_s = [], []
            for _ in range(args.rounds):
                hf_s.append(run_hf())
                vllm_s.append(run_vllm())
    ratios = [h / v for h, v in zip(hf_s, vllm_s, strict=True)]
    result = {
        "target": "SmolLM2-135M-Instruct bf16",
        "rows": len(rows), "pack_length": args.pack, "tokens": tokens, "rounds": args.rounds,
        "hf_tokens_per_s": [round(tokens / s, 1) for s in hf_s],
        "vllm_tokens_per_s": [round(tokens / s, 1) for s in vllm_s],
        "engine_start_s": round(start_s, 1),
        "vllm_over_hf_tokens_per_s_ratio": round(statistics.median(ratios), 3),
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
