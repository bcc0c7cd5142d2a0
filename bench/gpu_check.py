"""GPU path check (issue 10): run when a GPU machine is lent (`bash bench/gpu.sh` there).

Measures the trainer on CUDA with compiled flex attention and bf16 autocast at SmolLM2-135M dimensions
(H=576, 9/3 heads, head_dim 64, V=49152, 2 draft layers, Vd=8192, K=8) on a real ShareGPT row packed to
T tokens: step time, tokens/s and CUDA memory with S=1 and S=4 sequence partitions. The partition target
(S=4 at most 0.5x S=1) is on the step-added peak: the most CUDA memory a training step allocates on top
of what is live when it starts (weights, gradients, optimizer state, the batch), the counterpart of
`bench.bench_partition_memory`'s tensor_step_ratio; the whole peak is reported beside it. Prints one
JSON object and writes bench/results/gpu_<T>.json. On a machine without CUDA it says so and exits 0
(nothing is measured).

    python -m bench.gpu_check [--seq 2048] [--steps 6] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from peagle.progress import RecordingSink

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


class _StepPeakSink(RecordingSink):
    """Records, at each step's metric record, what that step allocated on top of the memory live before it."""

    def __init__(self) -> None:
        super().__init__()
        self.step_added: list[int] = []
        self._base: int | None = None
        self.whole_peak = 0  # the peak since the run began (the per-step resets keep it here)

    def _emit(self, record: dict[str, Any]) -> None:
        super()._emit(record)
        if record["type"] != "metric":
            return
        torch.cuda.synchronize()
        self.whole_peak = max(self.whole_peak, torch.cuda.max_memory_allocated())
        if self._base is not None:
            self.step_added.append(torch.cuda.max_memory_allocated() - self._base)
        self._base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()


def _run(partitions: int, seq: int, steps: int, warmup: int, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    from transformers import AutoConfig

    from bench.bench_train_step import FixedSource
    from peagle.builtin import smollm2_dir
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.spec import parse_spec
    from peagle.train.loop import Trainer

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
    sink = _StepPeakSink()
    t0 = time.time()
    Trainer(spec, draft, FixedSource(batch, warmup + steps + 1), sink=sink, device="cuda").train()
    torch.cuda.synchronize()
    stamps = [r["time"] for r in sink.records if r["type"] == "metric"]
    dts = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)][:steps]
    step = statistics.median(dts)
    return {
        "step_s": step,
        "tokens_per_s": seq / step,
        "peak_cuda_mem_gb": max(torch.cuda.max_memory_allocated(), sink.whole_peak) / 1e9,
        "step_added_peak_gb": max(sink.step_added[warmup - 1 :]) / 1e9,
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
    ratio = s4["step_added_peak_gb"] / s1["step_added_peak_gb"]
    result["partition_memory"] = {
        "step_added_ratio": ratio,
        "target": "<= 0.5 (step-added peak)",
        "pass": ratio <= 0.5,
        "whole_peak_ratio_reported_only": s4["peak_cuda_mem_gb"] / s1["peak_cuda_mem_gb"],
    }
    result["loss_s4_vs_s1_abs_diff"] = abs(s4["final_loss"] - s1["final_loss"])
    out = ROOT / "bench" / "results" / f"gpu_{args.seq}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
