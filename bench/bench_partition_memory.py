"""Sequence partitioning memory: peak RSS of one train step with S=4 vs S=1 (issue 4).

One row of T=2048 tokens from a real ShareGPT conversation (SmolLM2 chat template, real assistant
mask, decision-1 shift), K=8, r=0.7, r_min=0.2, SmolLM2-135M draft dimensions (2 layers, Vd=8192).
Each setting runs ONE optimizer step in a fresh process (`--child S`) and reports `ru_maxrss`:
  * `peak_rss_ratio`: peak RSS of the whole process, S=4 / S=1 (includes the interpreter, torch, the
    fp32 weights, gradients and AdamW moments, the same in both);
  * `step_peak_ratio`: what the step adds on top of the process before the step (the part
    partitioning acts on: activations, masks, logits), S=4 / S=1.
Target: <= 0.5. Writes bench/results/partition_memory.json.

    .venv/bin/python -m bench.bench_partition_memory [--seq-len 2048] [--segments 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K, R, R_MIN, VD, LAYERS = 8, 0.7, 0.2, 8192, 2


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def child(data_file: Path, segments: int, threads: int) -> dict:
    from transformers import AutoConfig

    from bench.bench_train_step import FixedSource
    from peagle.draft import DraftConfig, PEagleDraft
    from peagle.fixtures import smollm2_dir
    from peagle.spec import parse_spec
    from peagle.train.loop import Trainer
    from peagle.train.progress import RecordingSink

    torch.set_num_threads(threads)
    data = torch.load(data_file, weights_only=True)
    t = int(data["input_ids"].shape[1])
    cfg = DraftConfig.from_target(AutoConfig.from_pretrained(smollm2_dir()), num_layers=LAYERS,
                                  draft_vocab_size=VD, mask_token_id=49151, aux_layer_ids=[2, 15, 27])
    torch.manual_seed(0)
    draft = PEagleDraft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(0.0, 0.02)
        draft.lm_head.weight.normal_(0.0, 0.02)
    g = torch.Generator().manual_seed(1)
    batch = {k: data[k] for k in ("input_ids", "loss_mask", "document_ids")}
    batch["aux"] = torch.randn(1, t, 3 * cfg.hidden_size, generator=g)
    batch["target_logits"] = torch.randn(1, t, VD, generator=g)
    spec = parse_spec({
        "target": {"model": "builtin:smollm2-135m-instruct"},
        "data": {"sources": [{"path": "builtin:sharegpt"}], "max_length": t},
        "draft": {"num_layers": LAYERS, "draft_vocab_size": VD},
        "peagle": {"num_depths": K, "down_sample_ratio": R, "down_sample_ratio_min": R_MIN,
                   "sequence_partitions": segments},
        "optim": {"lr": 1e-4, "epochs": 1, "pack_length": t},
        "checkpoints": {"every_steps": 10_000_000},
        "eval": {"prompt_sets": []},
        "resources": {"device": "cpu"},
    })
    sink = RecordingSink()
    trainer = Trainer(spec, draft, FixedSource(batch, 1), sink=sink)
    before = _rss_mb()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    peak = _rss_mb()
    loss = [r for r in sink.records if r["type"] == "metric"][-1]["values"]["loss"]
    return {"segments": segments, "rss_before_step_mb": before, "peak_rss_mb": peak,
            "step_peak_mb": peak - before, "step_seconds": seconds, "loss": loss}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", type=int, default=0)
    ap.add_argument("--data")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.data), args.child, args.threads)))
        return 0
    from transformers import AutoTokenizer

    from bench.bench_train_step import real_row
    from peagle.data.packing import shift_rows
    from peagle.fixtures import smollm2_dir

    ids, mask, conv_index = real_row(AutoTokenizer.from_pretrained(smollm2_dir()), args.seq_len)
    s_ids, s_mask, s_doc = shift_rows(ids, mask, torch.zeros_like(ids))
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / "row.pt"
        torch.save({"input_ids": s_ids, "loss_mask": s_mask, "document_ids": s_doc}, data_file)
        for s in (1, args.segments):
            out = subprocess.run(
                [sys.executable, "-m", "bench.bench_partition_memory", "--child", str(s), "--data", str(data_file),
                 "--threads", str(args.threads)],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )
            runs[s] = json.loads(out.stdout.strip().splitlines()[-1])
    one, many = runs[1], runs[args.segments]
    result = {
        "setting": {"seq_len": args.seq_len, "num_depths": K, "r": R, "r_min": R_MIN, "segments": args.segments,
                    "draft_layers": LAYERS, "draft_vocab": VD, "sharegpt_index": conv_index,
                    "supervised_tokens": int(s_mask.sum()), "threads": args.threads, "device": "cpu"},
        "runs": {str(k): v for k, v in runs.items()},
        "peak_rss_ratio": many["peak_rss_mb"] / one["peak_rss_mb"],
        "step_peak_ratio": many["step_peak_mb"] / one["step_peak_mb"],
        "loss_equal": abs(many["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]),
        "target": "<= 0.5",
        "time": time.time(),
    }
    result["pass"] = result["step_peak_ratio"] <= 0.5
    result["peak_rss_pass"] = result["peak_rss_ratio"] <= 0.5  # whole-process ratio, stricter
    out_path = ROOT / "bench" / "results" / "partition_memory.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"S=1 peak {one['peak_rss_mb']:.0f} MB (step +{one['step_peak_mb']:.0f} MB), "
          f"S={args.segments} peak {many['peak_rss_mb']:.0f} MB (step +{many['step_peak_mb']:.0f} MB): "
          f"peak ratio {result['peak_rss_ratio']:.3f}, step ratio {result['step_peak_ratio']:.3f} (target <= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
