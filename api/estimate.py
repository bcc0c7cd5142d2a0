"""Dry-run estimate of a job: its data funnel, per-phase wall time and how far to trust it.

No torch, no tokenizer, no data read. Two sources, stated in the answer (`basis`, `accuracy`):

* **history**: earlier succeeded jobs on the same queue and device class (`api.history`): each phase's
  measured seconds over what the calibrated model predicted for that job's own spec; the median ratio per
  phase scales this job's model, and the spread of the ratios is the stated accuracy.
* **model** (no history): the calibrated model below. Its constants were measured on the 2-core CPU
  development machine with the demo preset (SmolLM2-135M, K=4, pack 1024, 2026-11-25, docs/service.md 8):
  about 1.1 s per training step when quiet, 652 conversations read and prepared in about 4 s, the reference
  decoder generating about 6 tokens/s with the draft (8 prompts x 64 tokens: 184 s at load average 4, so
  about 90 s idle), the vLLM serve check about 25 s. Idle total: about 6.5 minutes, as the CLI run of the
  bench/README.md "The demo end to end" (6 min 21 s). A loaded machine is slower (the demo took 35 min
  beside four other heavy jobs), hence the stated range `MODEL_RANGE`.

The data funnel uses `peagle.spec.funnel` (the keys the job's data report and the dataset report use):
a dataset's own validator report when the source is an uploaded dataset, the measured profile of the
builtin ShareGPT data (`BUILTIN_PROFILE`), else assumptions listed in `notes`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from peagle.spec import TrainSpec
from peagle.spec.funnel import DROPPED_BY_REASON, READ, funnel
from peagle.spec.hardware import cpu_facts

__all__ = ["MODEL_RANGE", "PHASE_GROUPS", "Measured", "estimate", "model_seconds", "phase_ratio"]

AVG_TOKENS_PER_ROW = 700
PACKING_EFFICIENCY = 0.99  # measured 0.996 on the demo (most conversations cut at max_length)


@dataclass(frozen=True)
class _Profile:
    """Measured on a builtin data set at one `data.max_length` (prepare_data of the demo spec)."""

    rows: int
    read_per_kept: float  # rows read per conversation the ingestion keeps (empty / no-assistant rows skipped)
    ingest_reasons: Mapping[str, float]  # share of the rows read, per reason
    max_length: int
    too_long_share: float  # kept by ingestion, then cut at max_length before any assistant token
    tokens_per_conversation: float  # templated tokens per training conversation (after the cut)


# builtin:sharegpt at max_length 512 (the demo's first 1920 conversations, the dataset's own answers): 1958
# read, 15 empty + 23 no assistant turn, 1920 kept by ingestion, 242 cut before any assistant token, 1678
# kept, 784,974 tokens in 1662 training conversations. (The first 1280: 1306 read, 11 + 15, 174 cut,
# 512,921 tokens in 1090; the first 640: 652 read, 5 + 7, 75 cut, 258,060 tokens in 549.)
BUILTIN_PROFILE = {
    "builtin:sharegpt": _Profile(rows=94_000, read_per_kept=1958 / 1920,
                                 ingest_reasons={"empty_conversation": 15 / 1958, "no_assistant_turn": 23 / 1958},
                                 max_length=512, too_long_share=242 / 1920,
                                 tokens_per_conversation=784_974 / 1662),
}
# hidden size of known targets (unknown targets: 4096, noted).
HIDDEN = {"builtin:smollm2-135m-instruct": 576, "builtin:tiny-llama": 64, "8b": 4096}
# training tokens (packed row slots) per second; small/cpu measured (demo: 1024 tokens per 1.1 s step).
THROUGHPUT = {("small", "cpu"): 930.0, ("tiny", "cpu"): 40_000.0, ("large", "cuda"): 25_000.0,
              ("small", "cuda"): 200_000.0, ("large", "cpu"): 20.0, ("tiny", "cuda"): 1_000_000.0}
# tokens generated per second by the reference decoder (target + draft), per size class and device.
DECODE = {("small", "cpu"): 6.0, ("tiny", "cpu"): 2_000.0, ("large", "cuda"): 40.0, ("small", "cuda"): 300.0,
          ("large", "cpu"): 0.5, ("tiny", "cuda"): 2_000.0}
LOAD_SECONDS = {"tiny": 1.0, "small": 3.0, "large": 60.0}
# a step that trains every position (`peagle.loss_positions` all) costs this much more than one that trains
# the answers: 1.44x the depth-0 elements on ShareGPT, 573 s against 467-530 s for 944 demo steps
# (docs/decisions.md decision 20)
ALL_POSITIONS_STEP_COST = 1.2
# tokens generated per second when regenerating answers, per engine, size class and device (small/cpu:
# SmolLM2 bf16 on 2 cores, vLLM with 64 conversations in flight vs transformers `generate` batch 8).
REGEN_TOKENS_PER_S = {("vllm", "small", "cpu"): 400.0, ("hf", "small", "cpu"): 10.0,
                      ("vllm", "tiny", "cpu"): 2_000.0, ("hf", "tiny", "cpu"): 500.0,
                      ("vllm", "large", "cpu"): 2.0, ("hf", "large", "cpu"): 0.2,
                      ("vllm", "small", "cuda"): 20_000.0, ("hf", "small", "cuda"): 1_000.0,
                      ("vllm", "tiny", "cuda"): 50_000.0, ("hf", "tiny", "cuda"): 5_000.0,
                      ("vllm", "large", "cuda"): 2_500.0, ("hf", "large", "cuda"): 150.0}
ENGINE_START_SECONDS = {"cpu": 40.0, "cuda": 120.0}  # `vllm serve` to /health (SmolLM2 on 2 cores: ~35 s)
# features captured per second through vLLM (small/cpu: the demo's 248k tokens at 924/s, load average 5-7)
VLLM_CAPTURE_TOKENS_PER_S = {"tiny": {"cpu": 5_000.0, "cuda": 500_000.0}, "small": {"cpu": 1_500.0, "cuda": 200_000.0},
                             "large": {"cpu": 10.0, "cuda": 30_000.0}}
# tokens/s vLLM generates with the draft: one request at a time / a batch of all prompts (small/cpu: the demo
# draft on SmolLM2, 55 and about 300 tokens/s, bench_speedup)
VLLM_DECODE = {"tiny": {"cpu": (500.0, 2_000.0), "cuda": (1_000.0, 20_000.0)},
               "small": {"cpu": (55.0, 300.0), "cuda": (400.0, 10_000.0)},
               "large": {"cpu": (0.5, 2.0), "cuda": (80.0, 2_000.0)}}
# regenerated tokens per training conversation: answers stop at max_new_tokens, and a conversation stops
# regenerating once its prompt reaches data.max_length (about 1.5 answers of the demo's ShareGPT data).
REGEN_TURNS_PER_CONVERSATION = 1.5
REGEN_FILL = 0.6  # answers average this share of max_new_tokens
PREP_PER_CONVERSATION = 0.004  # templating + packing, seconds per conversation read (2 cores)
EXPORT_SECONDS = 5.0
SERVE_CHECK_SECONDS = 25.0  # the demo's vLLM CPU serve check (a warning and ~0 s without a vLLM venv)
#: The calibrated model's accuracy: measured/estimated seen between these factors (idle to shared machine).
MODEL_RANGE = (0.6, 1.6)

#: Estimate phase -> the pipeline phases (`peagle.spec.phases`) whose time it covers.
PHASE_GROUPS: Mapping[str, tuple[str, ...]] = {
    "preparing_data": ("validating", "preparing_data", "building_vocab"),
    "regenerating": ("regenerating",),
    "capturing": ("capturing",),
    "training": ("training",),
    "evaluating": ("evaluating",),
    "exporting": ("exporting", "serve_check"),
}


@dataclass(frozen=True)
class Measured:
    """One earlier succeeded job: its spec and the measured seconds of each `PHASE_GROUPS` phase."""

    spec: TrainSpec
    phase_seconds: Mapping[str, float]
    steps: int  # optimizer steps it ran


def _size_class(model: str) -> str:
    if model == "builtin:tiny-llama":
        return "tiny"
    if model == "builtin:smollm2-135m-instruct" or "135m" in model.lower() or "360m" in model.lower():
        return "small"
    return "large"


def feature_bytes_per_token(spec: TrainSpec, hidden: int) -> int:
    """Disk one token of target features takes in a shard: aux [3H] and the final state [H] in their stored
    dtype (the engine's dtype with vllm; fp32 aux on a CPU with hf), plus ids, loss mask, document id."""
    r = spec.resources
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(spec.target.dtype, 4)
    aux_bytes = dtype_bytes if r.target_engine == "vllm" else (2 if r.device == "cuda" else 4)
    return 3 * hidden * aux_bytes + hidden * dtype_bytes + 3 * 8


def device_class(spec: TrainSpec) -> str:
    """`cpu` or `cuda` (what the job resolves to), the hardware class history is matched on."""
    return str(spec.resolve(cuda_available=spec.resources.gpus > 0).resources.device)


def _data_funnel(spec: TrainSpec, dataset_rows: dict[str, dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    read = kept = 0
    tokens = 0.0
    reasons: dict[str, float] = {}
    cap = spec.data.max_length
    budget = spec.data.max_samples
    for src in spec.data.sources:
        report = dataset_rows.get(src.path)
        profile = BUILTIN_PROFILE.get(src.path)
        if report is not None:
            base = report.get("funnel") or {}
            avail = int(report.get("rows_kept") or 0)
            r_read = int(report.get("rows_read") or avail)
            shares = {k: v / max(r_read, 1) for k, v in (base.get(DROPPED_BY_REASON) or
                                                         report.get("skipped_by_reason") or {}).items()}
            per_kept = r_read / max(avail, 1)
            per = (int(report["tokens"]) / max(avail, 1)) if report.get("tokens") else AVG_TOKENS_PER_ROW
            too_long = 0.0
        elif profile is not None:
            avail, per_kept, shares = profile.rows, profile.read_per_kept, dict(profile.ingest_reasons)
            per, too_long = profile.tokens_per_conversation, profile.too_long_share
            if cap != profile.max_length:
                per = min(AVG_TOKENS_PER_ROW, cap * profile.tokens_per_conversation / profile.max_length)
                notes.append(f"{src.path}: drops and tokens per conversation measured at data.max_length="
                             f"{profile.max_length}, scaled to {cap}")
        else:
            avail, per_kept, shares, per, too_long = 10_000, 1.0, {}, AVG_TOKENS_PER_ROW, 0.0
            notes.append(f"rows of {src.path!r} unknown before the job reads it: assumed {avail}")
        n = max(0, avail - src.skip)
        for cap_n in (src.max_samples, budget):
            if cap_n is not None:
                n = min(n, cap_n)
        if budget is not None:
            budget -= n
        n_read = round(n * per_kept) + min(src.skip, avail)
        for k, share in shares.items():
            reasons[k] = reasons.get(k, 0.0) + share * n_read
        if src.skip:
            reasons["source_skip"] = reasons.get("source_skip", 0.0) + min(src.skip, avail)
        cut = round(n * too_long)
        if cut:
            reasons["too_long_no_assistant_left"] = reasons.get("too_long_no_assistant_left", 0.0) + cut
        read += n_read
        kept += n - cut
        tokens += (n - cut) * min(per, cap)
    whole = {k: round(v) for k, v in reasons.items()}
    # rounding may leave the sum a conversation off: give it to the largest reason, never to "unaccounted"
    gap = read - kept - sum(whole.values())
    if gap and whole:
        big = max(whole, key=lambda k: whole[k])
        whole[big] += gap
    held = min(spec.data.eval_samples, max(kept - 1, 0))
    train = kept - held
    train_tokens = int(tokens * train / max(kept, 1))
    packed = math.ceil(train_tokens / (spec.optim.pack_length * PACKING_EFFICIENCY)) if train_tokens else 0
    return funnel(read=read, kept=kept, dropped_by_reason=whole, held_out=held, packed_rows=packed,
                  train_tokens=train_tokens, estimated=True)


def _steps(spec: TrainSpec, packed_rows: int) -> int:
    o = spec.optim
    steps = math.ceil(packed_rows / (o.micro_batch_size * o.grad_accumulation)) * o.epochs
    return min(steps, o.max_steps) if o.max_steps is not None else steps


def model_seconds(
    spec: TrainSpec, *, read: int, steps: int, packed_rows: int, serve_check_ready: bool = True
) -> dict[str, float]:
    """The calibrated model: seconds per `PHASE_GROUPS` phase of `spec` reading `read` rows, `steps` steps
    over `packed_rows` training rows (offline capture forwards each row once, whatever the epochs)."""
    size, dev = _size_class(spec.target.model), device_class(spec)
    gpus = max(1, spec.resources.gpus)
    o = spec.optim
    step_tokens = o.pack_length * o.micro_batch_size * o.grad_accumulation
    tps = THROUGHPUT[(size, dev)] * gpus
    train_tokens = steps * step_tokens * (ALL_POSITIONS_STEP_COST if spec.peagle.loss_positions == "all" else 1.0)
    captured_tokens = packed_rows * o.pack_length
    capture = 0.0 if spec.resources.capture == "online" else captured_tokens / (3.0 * tps)
    # held-out evals (at checkpoints or every eval.every_steps) forward the eval rows: about one step each
    every = spec.eval.every_steps or spec.checkpoints.every_steps
    evals = math.ceil(steps / every) if steps else 0
    held_rows = math.ceil(spec.data.eval_samples * AVG_TOKENS_PER_ROW / o.pack_length)
    training = train_tokens / tps + evals * (1.0 + held_rows * o.pack_length / (3.0 * tps))
    generated = sum(p.num_prompts for p in spec.eval.prompt_sets) * spec.eval.max_new_tokens
    # the serve check follows the reference decoder; with vLLM measuring AL its speedup run replaces it
    serve = SERVE_CHECK_SECONDS if spec.eval.serve_check and spec.eval.engine != "vllm" and serve_check_ready else 0
    regen = spec.data.regenerate
    regenerating = 0.0
    if regen.enabled is True:
        engine = "vllm" if regen.engine == "vllm" else "hf"
        new_tokens = read * REGEN_TURNS_PER_CONVERSATION * regen.max_new_tokens * REGEN_FILL
        regenerating = new_tokens / (REGEN_TOKENS_PER_S[(engine, size, dev)] * gpus)
        regenerating += ENGINE_START_SECONDS[dev] if engine == "vllm" else 0.0
    if spec.resources.target_engine == "vllm":
        features = captured_tokens if spec.resources.capture == "offline" else 0  # online: streamed in training
        capture = ENGINE_START_SECONDS[dev] + features / (VLLM_CAPTURE_TOKENS_PER_S[size][dev] * gpus)
    evaluating = generated / DECODE[(size, dev)]
    if spec.eval.engine == "vllm":  # resolved: AL measured by vLLM, one engine start per measurement
        evaluating, training = _vllm_eval_seconds(spec, size, dev, steps, training, generated)
    return {
        "preparing_data": LOAD_SECONDS[size] + read * PREP_PER_CONVERSATION,
        "regenerating": regenerating,
        "capturing": capture,
        "training": training,
        "evaluating": evaluating,
        "exporting": EXPORT_SECONDS + serve,
    }


def _vllm_eval_seconds(spec: TrainSpec, size: str, dev: str, steps: int, training: float, generated: int
                       ) -> tuple[float, float]:
    """(evaluating, training incl. its AL measurements) when vLLM measures AL: an engine start
    per measurement (the AL during training: every `eval.al_every_steps` and at checkpoints), the prompts
    generated as one batch, and the serving speedup (`eval.speedup`: per K of the sweep an engine start and
    `speedup_rounds` rounds of both sides at batch 1 and at a batch of all prompts)."""
    e = spec.eval
    start = ENGINE_START_SECONDS[dev]
    one, batch = VLLM_DECODE[size][dev]
    if e.prompt_sets and steps:
        at = set(range(e.al_every_steps, steps + 1, e.al_every_steps)) if e.al_every_steps else set()
        calls = len(at | set(range(spec.checkpoints.every_steps, steps + 1, spec.checkpoints.every_steps)) | {steps})
        prompts = e.al_num_prompts if spec.checkpoints.select_best_by not in ("auto", "acceptance_length") \
            else e.prompt_sets[0].num_prompts
        training += calls * (start + prompts * e.max_new_tokens / batch)
    evaluating = start + generated / batch if e.prompt_sets else 0.0
    if e.speedup and e.prompt_sets:
        k = e.num_speculative_tokens or spec.peagle.num_depths
        ks = k if e.speedup_sweep else 1
        n = min(e.speedup_num_prompts, e.prompt_sets[0].num_prompts)
        tokens = n * e.max_new_tokens
        per_round = 2 * (tokens / one + tokens / batch) + sum(2 * tokens / batch for _ in e.speedup_batch_sizes)
        evaluating += (ks + 1) * start + ks * e.speedup_rounds * per_round
    return evaluating, training


def phase_ratio(history: Sequence[Measured]) -> dict[str, list[float]]:
    """Per phase, measured / modelled seconds of each earlier job (phases it did not run are left out)."""
    out: dict[str, list[float]] = {k: [] for k in PHASE_GROUPS}
    for m in history:
        fun = _data_funnel(m.spec, {}, [])
        modelled = model_seconds(m.spec, read=fun[READ], steps=m.steps, packed_rows=fun["packed_rows"] or 0)
        for phase, secs in m.phase_seconds.items():
            if phase in out and modelled.get(phase, 0.0) > 0.5 and secs > 0:
                out[phase].append(secs / modelled[phase])
    return out


def estimate(spec: TrainSpec, *, dataset_rows: dict[str, dict[str, Any]], queue: str, queue_position: int,
             history: Sequence[Measured] = (), vllm_available: bool | None = None, queue_running: int = 0
             ) -> dict[str, Any]:
    """The data funnel, steps, per-phase and total wall time of `spec`, with its basis and accuracy.

    Args:
        spec: a validated spec.
        dataset_rows: `dataset:<id>` -> that dataset's validation report (its funnel, tokens if known).
        queue: the queue the job would go to.
        queue_position: jobs ahead of it on `queue`: running there now and queued (`repo.queue_ahead`).
        queue_running: how many of those run now.
        history: earlier succeeded jobs on `queue` with the same device class (`api.history`).
        vllm_available: whether the workers can run the vLLM target engine (resolves `target_engine: auto`).
    """
    notes: list[str] = []
    # estimate what the worker will run: the engines resolved (when known) and `target.dtype: auto` by what
    # this host's CPU runs natively (the workers share it in docker-compose)
    spec = spec.resolve(cuda_available=spec.resources.gpus > 0, vllm_available=vllm_available,
                        device_facts=cpu_facts())
    fun = _data_funnel(spec, dataset_rows, notes)
    steps = _steps(spec, fun["packed_rows"] or 0)
    o = spec.optim
    tokens_per_step = o.pack_length * o.micro_batch_size * o.grad_accumulation
    hidden = HIDDEN.get(spec.target.model)
    if hidden is None:
        hidden = HIDDEN["8b"]
        notes.append("target hidden size unknown before loading its config: assumed 4096")
    per_token = feature_bytes_per_token(spec, hidden)
    dump = (fun["train_tokens"] + spec.data.eval_samples * AVG_TOKENS_PER_ROW) * per_token
    engine = spec.resources.target_engine
    if spec.resources.capture == "offline":
        hidden_bytes = dump
    elif engine == "vllm":  # streamed: the engine runs ahead of the trainer within feature_disk_gb
        hidden_bytes = min(dump, int(spec.resources.feature_disk_gb * 1e9))
    else:
        hidden_bytes = 0
    phases = model_seconds(spec, read=fun[READ], steps=steps, packed_rows=fun["packed_rows"] or 0)
    ratios = phase_ratio(history)
    spreads: list[float] = []
    for phase, rs in ratios.items():
        if rs and phases[phase] > 0:
            mid = statistics.median(rs)
            phases[phase] *= mid
            spreads += [max(r / mid, mid / r) for r in rs]
    total = sum(phases.values())
    dev = device_class(spec)
    if history:
        spread = max(spreads, default=1.0)
        err = max(0.2, spread - 1.0)
        lo, hi = total / (1 + err), total * (1 + err)
        accuracy = (f"from {len(history)} earlier job{'s' if len(history) > 1 else ''} on queue {queue} ({dev}): "
                    f"±{round(100 * err)}%")
        basis = "history"
    else:
        lo, hi = total * MODEL_RANGE[0], total * MODEL_RANGE[1]
        accuracy = (f"no history on queue {queue} ({dev}): calibrated model, typically within "
                    f"{MODEL_RANGE[0]}x-{MODEL_RANGE[1]}x (idle to moderately loaded machine)")
        basis = "model"
    if queue_position:
        notes.append(f"{queue_position} job{'s' if queue_position > 1 else ''} ahead on queue {queue}: "
                     f"{queue_running} running, {queue_position - queue_running} queued; it starts when a worker "
                     "of the queue is free")
    notes.append("the job page shows the measured step rate and time left once training runs")
    return {
        "rows": fun["train_conversations"],
        "tokens": fun["train_tokens"],
        "optimizer_steps": steps,
        "tokens_per_step": tokens_per_step,
        "hidden_state_bytes": hidden_bytes,
        "feature_bytes_per_token": per_token,
        "offline_dump_bytes": dump,
        "target_engine": engine,
        "target_dtype": spec.target.dtype,
        "wall_clock_seconds": round(total, 1),
        "wall_clock_range_seconds": [round(lo, 1), round(hi, 1)],
        "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        "basis": basis,
        "history_jobs": len(history),
        "accuracy": accuracy,
        "funnel": fun,
        "queue": queue,
        "queue_position": queue_position,
        "queue_running": queue_running,
        "notes": notes,
    }
