"""GPU path check (issue 10): run when a GPU machine is lent (`bash bench/gpu.sh` there).

Measures the trainer on CUDA with compiled flex attention and bf16 autocast at SmolLM2-135M dimensions
(H=576, 9/3 heads, head_dim 64, V=49152, 2 draft layers, Vd=8192, K=8) on a real ShareGPT row packed to
T tokens: step time, tokens/s and peak CUDA memory with S=1 and S=4 sequence partitions, plus the S=4/S=1
memory ratio. Prints one JSON object and writes bench/results/gpu.json. On a machine without CUDA it
says so and exits 0 (nothing is measured).

    python -m bench.gpu_check [--seq 2048] [--steps 6] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _real_batch(seq: int, hidden: int, vd: int) -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    from bench.bench_train_step import real_row
    from peagle.builtin import smollm2_dir
    from peagle.data.packing import shift_rows

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    ids, mask, _ = real_row(tok, seq)
    s_ids, s_mask, s_doc = shift_rows(ids, mask, torch.zeros_like(ids))
    g = torch.Generator().manual_seed(1)
    return {
        "input_ids": s_ids,
        "loss_mask": s_mask,
        "document_ids": s_doc,
        "aux": torch.randn(1, seq, 3 * hidden, generator=g),
        "target_logits": torch.randn(1, seq, vd, generator=g),
    }


def _run(partitions: int, seq: int, steps: int, warmup: int, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    from transformers import AutoConfig

    from bench.bench_train_step import FixedSource
    from peagle.builtin import smollm2_dir
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.spec import parse_spec
    from peagle.train.loop import Trainer
    from peagle.train.progress import RecordingSink

    tc = AutoConfig.from_pretrained(smollm2_dir())
    cfg = DraftConfig.from_target(tc, num_layers=2, draft_vocab_size=8192, mask_token_id=tc.vocab_size - 1,
                                  aux_layer_ids=[2, 15, 27])
    spec = parse_spec({
        "target": {"model": "builtin:smollm2-135m-instruct"},
        "data": {"sources": [{"path": "builtin:sharegpt"}], "max_length": seq},
        "draft": {"num_layers": 2, "draft_vocab_size": 8192},
        "peagle": {"num_depths": 8, "sequence_partitions": partitions},
        "optim": {"lr": 1e-4, "pack_length": seq, "schedule": "constant", "warmup_ratio": 0.0},
        "checkpoints": {"every_steps": 10_000_000},
        "eval": {"prompt_sets": []},
        "resources": {"device": "cuda", "gpus": 1, "attention": "flex", "precision": "bf16"},
    })
    torch.manual_seed(0)
    draft = PEagleDraft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(0.0, 0.02)
        draft.lm_head.weight.normal_(0.0, 0.02)
    torch.cuda.reset_peak_memory_stats()
    sink = RecordingSink()
    t0 = time.time()
    Trainer(spec, draft, FixedSource(batch, warmup + steps + 1), sink=sink, device="cuda").train()
    torch.cuda.synchronize()
    stamps = [r["time"] for r in sink.records if r["type"] == "metric"]
    dts = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)][:steps]
    step = statistics.median(dts)
    return {
        "step_s": step,
        "tokens_per_s": seq / step,
        "peak_cuda_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "first_steps_incl_compile_s": stamps[warmup] - t0 if len(stamps) > warmup else float("nan"),
        "final_loss": next(r["values"]["loss"] for r in reversed(sink.records) if r["type"] == "metric"),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device on this machine"}))
        return 0
    batch = _real_batch(args.seq, 576, 8192)
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "seq_len": args.seq,
        "s1": _run(1, args.seq, args.steps, args.warmup, batch),
        "s4": _run(4, args.seq, args.steps, args.warmup, batch),
    }
    s1, s4 = result["s1"], result["s4"]
    assert isinstance(s1, dict) and isinstance(s4, dict)
    result["partition_memory"] = {
        "ratio": s4["peak_cuda_mem_gb"] / s1["peak_cuda_mem_gb"],
        "target": "<= 0.5",
        "pass": s4["peak_cuda_mem_gb"] / s1["peak_cuda_mem_gb"] <= 0.5,
    }
    result["loss_s4_vs_s1_abs_diff"] = abs(s4["final_loss"] - s1["final_loss"])
    out = ROOT / "bench" / "results" / "gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
