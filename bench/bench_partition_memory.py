"""Sequence partitioning memory: peak RSS of one train step with S=4 vs S=1 (issue 4).

One row of T=2048 tokens from a real ShareGPT conversation (SmolLM2 chat template, real assistant
mask, the shift of docs/decisions.md decision 1), K=8, r=0.7, r_min=0.2, SmolLM2-135M draft dimensions (2 layers, Vd=8192).
Each setting runs ONE optimizer step in a fresh process (`--child S`) and reports `ru_maxrss`:
  * `peak_rss_ratio`: peak RSS of the whole process, S=4 / S=1 (includes the interpreter, torch, the
    fp32 weights, gradients and AdamW moments, the same in both);
  * `step_peak_ratio`: what the step adds on top of the process before the step (the part
    partitioning acts on: activations, masks, logits), S=4 / S=1;
  * `tensor_peak_ratio` / `tensor_step_ratio` (two more fresh children, traced, `--no-tensors` skips
    them): the same for the peak bytes of live torch tensors (`_TensorPeak`), the CPU counterpart of
    the peak CUDA memory a GPU run reports (`bench.gpu_check`): parameters, data, gradients, optimizer
    state and activations, without the interpreter, the libraries and the C heap's free pages.
Each child also reports where its peak sits: `ru_maxrss` (the exact high-water mark) is read at phase
markers (`PhaseMarks`), so `peak_phase` is the phase during which the final peak was reached
(`unit3.forward` = the 4th unit's forward incl. the fused head, `unit3.backward`, ...; with S > 1 the
units run from the last segment down to segment 0, and `unit0.build` includes the row's no-grad
depth-0 context pass, see `peagle.train.step`), and `phases`
lists (phase, RSS at its end, high-water mark at its end). The fixed part is broken down into
`rss_start_mb` (interpreter + torch + transformers), parameter and data bytes and the optimizer state
after the step. `--steps N` runs N optimizer steps (different COD draws) and reports the peak over all.
Target: `peak_rss_ratio` <= 0.5 (`pass`). Writes bench/results/partition_memory.json.

    .venv/bin/python -m bench.bench_partition_memory [--seq-len 2048] [--segments 4] [--steps 1] [--no-tensors]
"""

from __future__ import annotations

import argparse
import json
import os
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB (high-water mark)


def _current_rss_mb() -> float:
    with Path("/proc/self/statm").open() as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PhaseMarks:
    """RSS and high-water mark at phase boundaries of the trainer's step (hooks, no sampling thread).

    Phases: `unitI.build` (up to unit I's forward: the unit's mask / inputs), `unitI.forward` (draft +
    fused head), `unitI.backward`, `unitI.release` (`peagle.train.step.release_free_memory`, S > 1
    only), `clip` (sparse all-reduce + clipping), `optimizer` (the step).
    """

    def __init__(self) -> None:
        self.marks: list[tuple[str, float, float]] = []
        self.unit = -1

    def mark(self, phase_ended: str) -> None:
        self.marks.append((phase_ended, round(_current_rss_mb(), 1), round(_rss_mb(), 1)))

    def install(self, trainer: object) -> None:
        import peagle.train.step as step_mod

        def pre_forward(*_: object) -> None:
            self.unit += 1
            self.mark(f"unit{self.unit}.build")

        trainer.objective.register_forward_pre_hook(pre_forward)  # type: ignore[attr-defined]
        trainer.objective.register_forward_hook(lambda *_: self.mark(f"unit{self.unit}.forward"))  # type: ignore[attr-defined]
        coalesce, release = step_mod.coalesce_embedding_grad, step_mod.release_free_memory

        def marked_coalesce(draft: object) -> None:  # called right after every unit's backward
            self.mark(f"unit{self.unit}.backward")
            coalesce(draft)

        def marked_release() -> bool:  # after the backward, only when partitioning
            out = release()
            self.mark(f"unit{self.unit}.release")
            return out

        # both are looked up at call time by run_micro_batch
        step_mod.coalesce_embedding_grad = marked_coalesce  # type: ignore[assignment]
        step_mod.release_free_memory = marked_release  # type: ignore[assignment]
        trainer.optimizer.register_step_pre_hook(lambda *_: self.mark("clip"))  # type: ignore[attr-defined]
        trainer.optimizer.register_step_post_hook(lambda *_: self.mark("optimizer"))  # type: ignore[attr-defined]

    def peak_phase(self) -> str:
        """The phase at whose end the high-water mark first reached its final value."""
        final = max(m[2] for m in self.marks)
        return next(name for name, _, high in self.marks if high >= final)


class _TensorPeak:
    """Peak bytes of live torch tensors on the CPU: what `torch.cuda.max_memory_allocated()` reports on
    a GPU (parameters, data, gradients, optimizer state, activations; not the interpreter, the libraries
    or the C heap's free pages), from the profiler's allocation records (`profile_memory=True`: every
    tensor allocation and free with the running total). The run is traced, so it is slow; the RSS
    children run untraced.

    `stop()` -> (total when `trainer.train` began, peak), MiB.
    """

    def start(self) -> _TensorPeak:
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()
        return self

    def stop(self) -> tuple[float, float]:
        self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self.prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
        start = min(e["ts"] for e in events if e.get("name") == "trainer.train")
        before = next((total for ts, total in reversed(mem) if ts < start), 0)
        peak = max(total for _, total in mem)
        return round(before / 2**20, 1), round(peak / 2**20, 1)


def child(data_file: Path, segments: int, threads: int, steps: int = 1, tensors: bool = False) -> dict:
    """One setting in this (fresh) process. `tensors`: instead of RSS, the peak bytes of live torch
    tensors (`_TensorPeak`; every allocation from before the draft is built)."""
    rss_start = _current_rss_mb()
    tracker = _TensorPeak().start() if tensors else None
    from transformers import AutoConfig

    from bench.bench_train_step import FixedSource
    from peagle.builtin import smollm2_dir
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.progress import RecordingSink
    from peagle.spec import parse_spec
    from peagle.train.loop import Trainer

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
    trainer = Trainer(spec, draft, FixedSource(batch, steps), sink=sink)
    if tracker is not None:
        with torch.profiler.record_function("trainer.train"):
            trainer.train()
        before_mb, peak_mb = tracker.stop()
        loss = next(r for r in sink.records if r["type"] == "metric")["values"]["loss"]
        return {"segments": segments, "steps": steps, "tensor_before_step_mb": before_mb,
                "tensor_peak_mb": peak_mb, "loss": loss}
    marks = PhaseMarks()
    marks.install(trainer)
    before = _rss_mb()
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    peak = _rss_mb()
    loss = next(r for r in sink.records if r["type"] == "metric")["values"]["loss"]
    mb = 2.0**-20
    state = [v for st in trainer.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {
        "segments": segments, "steps": steps, "rss_before_step_mb": before, "peak_rss_mb": peak,
        "step_peak_mb": peak - before, "step_seconds": seconds / steps, "loss": loss,
        "peak_phase": marks.peak_phase(), "phases": marks.marks,
        "fixed": {
            "rss_start_mb": round(rss_start, 1),  # interpreter + torch (bench module imports)
            "params_mb": round(sum(p.numel() * p.element_size() for p in draft.parameters()) * mb, 1),
            "data_mb": round(sum(v.numel() * v.element_size() for v in batch.values()) * mb, 1),
            "optimizer_state_mb": round(sum(v.numel() * v.element_size() for v in state) * mb, 1),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps per setting (peak over all)")
    ap.add_argument("--no-tensors", action="store_true", help="skip the (slow, traced) tensor-memory children")
    ap.add_argument("--child", type=int, default=0)
    ap.add_argument("--tensors", action="store_true", help="child: live-tensor peak instead of RSS")
    ap.add_argument("--data")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.data), args.child, args.threads, args.steps, tensors=args.tensors)))
        return 0
    from transformers import AutoTokenizer

    from bench.bench_train_step import real_row
    from peagle.builtin import smollm2_dir
    from peagle.data.packing import shift_rows

    ids, mask, conv_index = real_row(AutoTokenizer.from_pretrained(smollm2_dir()), args.seq_len)
    s_ids, s_mask, s_doc = shift_rows(ids, mask, torch.zeros_like(ids))
    runs, tensor_runs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data_file = Path(tmp) / "row.pt"
        torch.save({"input_ids": s_ids, "loss_mask": s_mask, "document_ids": s_doc}, data_file)
        for tensors in (False, True) if not args.no_tensors else (False,):
            for s in (1, args.segments):
                out = subprocess.run(
                    [sys.executable, "-m", "bench.bench_partition_memory", "--child", str(s), "--data",
                     str(data_file), "--threads", str(args.threads), "--steps", str(args.steps)]
                    + (["--tensors"] if tensors else []),
                    capture_output=True, text=True, check=True, cwd=ROOT,
                )
                (tensor_runs if tensors else runs)[s] = json.loads(out.stdout.strip().splitlines()[-1])
    one, many = runs[1], runs[args.segments]
    result = {
        "setting": {"seq_len": args.seq_len, "num_depths": K, "r": R, "r_min": R_MIN, "segments": args.segments,
                    "draft_layers": LAYERS, "draft_vocab": VD, "sharegpt_index": conv_index,
                    "supervised_tokens": int(s_mask.sum()), "threads": args.threads, "device": "cpu",
                    "steps": args.steps},
        "runs": {str(k): v for k, v in runs.items()},
        "peak_rss_ratio": many["peak_rss_mb"] / one["peak_rss_mb"],
        "step_peak_ratio": many["step_peak_mb"] / one["step_peak_mb"],
        "loss_equal": abs(many["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]),
        "target": "<= 0.5",
        "time": time.time(),
    }
    if tensor_runs:
        t1, tn = tensor_runs[1], tensor_runs[args.segments]
        result["tensor_runs"] = {str(k): v for k, v in tensor_runs.items()}
        result["tensor_peak_ratio"] = tn["tensor_peak_mb"] / t1["tensor_peak_mb"]
        result["tensor_step_ratio"] = (tn["tensor_peak_mb"] - tn["tensor_before_step_mb"]) / (
            t1["tensor_peak_mb"] - t1["tensor_before_step_mb"])
    # the measure on CPU is the whole-process peak RSS; the others say where the memory goes
    result["pass"] = result["peak_rss_ratio"] <= 0.5
    result["step_peak_pass"] = result["step_peak_ratio"] <= 0.5
    out_path = ROOT / "bench" / "results" / "partition_memory.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"S=1 peak {one['peak_rss_mb']:.0f} MB (step +{one['step_peak_mb']:.0f} MB, in {one['peak_phase']}), "
          f"S={args.segments} peak {many['peak_rss_mb']:.0f} MB (step +{many['step_peak_mb']:.0f} MB, "
          f"in {many['peak_phase']}): peak ratio {result['peak_rss_ratio']:.3f}, "
          f"step ratio {result['step_peak_ratio']:.3f} (target <= 0.5)")
    if tensor_runs:
        print(f"live tensors: S=1 peak {t1['tensor_peak_mb']:.0f} MB (before the step {t1['tensor_before_step_mb']:.0f}), "
              f"S={args.segments} peak {tn['tensor_peak_mb']:.0f} MB: ratio {result['tensor_peak_ratio']:.3f}, "
              f"step ratio {result['tensor_step_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
