"""Dry-run estimate of a job from its spec alone (no torch, no tokenizer, no data read).

Heuristics, stated so users can check them: average templated conversation length
`AVG_TOKENS_PER_ROW` (ShareGPT-like chats, capped at `data.max_length`), packing efficiency
`PACKING_EFFICIENCY`, offline capture stores 3 auxiliary hidden states + the last hidden state per
token in bf16 (`4 * hidden * 2` bytes), throughputs per (target, device) from `THROUGHPUT`.
"""

from __future__ import annotations

import math
from typing import Any

from peagle.spec import TrainSpec

__all__ = ["estimate"]

AVG_TOKENS_PER_ROW = 700
PACKING_EFFICIENCY = 0.9
BUILTIN_ROWS = {"builtin:sharegpt": 94_000}
# hidden size of known targets (unknown targets: 4096, noted).
HIDDEN = {"builtin:smollm2-135m-instruct": 576, "builtin:tiny-llama": 64, "8b": 4096}
# training tokens per second (target forward + draft fwd/bwd), rough.
THROUGHPUT = {("small", "cpu"): 1_500.0, ("tiny", "cpu"): 40_000.0, ("large", "cuda"): 25_000.0,
              ("small", "cuda"): 200_000.0, ("large", "cpu"): 20.0, ("tiny", "cuda"): 1_000_000.0}


def _size_class(model: str) -> str:
    if model == "builtin:tiny-llama":
        return "tiny"
    if model == "builtin:smollm2-135m-instruct" or "135m" in model.lower() or "360m" in model.lower():
        return "small"
    return "large"


def estimate(spec: TrainSpec, *, dataset_rows: dict[str, dict[str, Any]], queue: str,
             queue_position: int) -> dict[str, Any]:
    """Rows, tokens, optimizer steps, offline feature disk and wall-clock for `spec`.

    Args:
        spec: a validated spec.
        dataset_rows: `dataset:<id>` -> that dataset's validation report (rows_kept, tokens if known).
        queue: the queue the job would go to.
        queue_position: jobs queued ahead of it.
    """
    notes: list[str] = []
    rows = 0
    tokens = 0
    cap = spec.data.max_length
    for src in spec.data.sources:
        report = dataset_rows.get(src.path)
        if report is not None:
            n = int(report.get("rows_kept") or 0)
            per = (int(report["tokens"]) / max(n, 1)) if report.get("tokens") else AVG_TOKENS_PER_ROW
        elif src.path in BUILTIN_ROWS:
            n, per = BUILTIN_ROWS[src.path], AVG_TOKENS_PER_ROW
        else:
            n, per = 10_000, AVG_TOKENS_PER_ROW
            notes.append(f"rows of {src.path!r} unknown before the job reads it: assumed {n}")
        n = max(0, n - src.skip)
        if src.max_samples is not None:
            n = min(n, src.max_samples)
        rows += n
        tokens += int(n * min(per, cap))
    if spec.data.max_samples is not None and rows > spec.data.max_samples:
        tokens = int(tokens * spec.data.max_samples / max(rows, 1))
        rows = spec.data.max_samples
    eval_rows = min(spec.data.eval_samples, rows)
    train_rows = rows - eval_rows
    train_tokens = int(tokens * train_rows / max(rows, 1))
    o = spec.optim
    tokens_per_step = o.pack_length * o.micro_batch_size * o.grad_accumulation
    packed = math.ceil(train_tokens / (o.pack_length * PACKING_EFFICIENCY)) if train_tokens else 0
    steps = math.ceil(packed / (o.micro_batch_size * o.grad_accumulation)) * o.epochs
    if o.max_steps is not None:
        steps = min(steps, o.max_steps)
    model = spec.target.model
    hidden = HIDDEN.get(model)
    if hidden is None:
        hidden = HIDDEN["8b"]
        notes.append("target hidden size unknown before loading its config: assumed 4096")
    hidden_bytes = train_tokens * 4 * hidden * 2 if spec.resources.capture == "offline" else 0
    device = spec.resolve(cuda_available=spec.resources.gpus > 0).resources.device
    tps = THROUGHPUT[(_size_class(model), device)] * max(1, spec.resources.gpus)
    seconds = steps * tokens_per_step * PACKING_EFFICIENCY / tps
    seconds += 30.0 + 2.0 * sum(p.num_prompts for p in spec.eval.prompt_sets) * spec.eval.max_new_tokens / 50
    notes.append("wall clock is a heuristic from typical throughput; the job page shows measured tokens/s")
    return {
        "rows": train_rows,
        "tokens": train_tokens,
        "optimizer_steps": steps,
        "tokens_per_step": tokens_per_step,
        "hidden_state_bytes": hidden_bytes,
        "wall_clock_seconds": round(seconds, 1),
        "queue": queue,
        "queue_position": queue_position,
        "notes": notes,
    }
