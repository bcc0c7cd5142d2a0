"""The calibrated model of each phase of a job: its own work, the rate it runs at, the seconds that do not
scale with it.

`model_phases` gives one `PhaseModel` per `calibration.PHASE_GROUPS` phase of a resolved spec on a hardware
class: conversations read, regenerated tokens, captured tokens, training tokens (one split over engine
workers: `split_training`), generated tokens, exports; the preview (`preview_model`) is a phase of its own
in the jobs that have one. The constants are `service.estimate.calibration`'s, scaled by `target_speed` and
`draft_speed`. Pure functions of the spec.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from peagle.spec import TrainSpec
from peagle.spec.funnel import READ
from peagle.spec.preview import preview_off_reason, preview_spec
from service.estimate.calibration import (
    AL_MEASUREMENT_SECONDS,
    ALL_POSITIONS_STEP_COST,
    AVG_TOKENS_PER_ROW,
    CALIBRATION_CLASS,
    DECODE,
    ENGINE_START_SECONDS,
    EXPORT_SECONDS,
    LOAD_SECONDS,
    PREP_PER_CONVERSATION,
    REGEN_FILL,
    REGEN_TOKENS_PER_S,
    REGEN_TURNS_PER_CONVERSATION,
    SERVE_CHECK_SECONDS,
    STARTUP_SECONDS,
    THROUGHPUT,
    VLLM_CAPTURE_TOKENS_PER_S,
    VLLM_DECODE,
    draft_speed,
    size_class,
    target_speed,
)
from service.estimate.funnel import data_funnel, optimizer_steps

__all__ = ["PhaseModel", "PreviewModel", "feature_bytes_per_token", "model_phases", "model_seconds", "preview_model",
           "split_training"]


def feature_bytes_per_token(spec: TrainSpec, hidden: int) -> int:
    """Disk one token of target features takes in a shard: aux [3H] and the final state [H] in their stored
    dtype (the engine's dtype with vllm; fp32 aux on a CPU with hf), plus ids, loss mask, document id."""
    r = spec.resources
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(spec.target.dtype, 4)
    aux_bytes = dtype_bytes if r.target_engine == "vllm" else (2 if r.device == "cuda" else 4)
    return 3 * hidden * aux_bytes + hidden * dtype_bytes + 3 * 8


@dataclass(frozen=True)
class PhaseModel:
    """The calibrated model of one phase: `work` units of the phase's own work (`unit`: conversations read,
    regenerated tokens, captured tokens, training tokens, generated tokens, exports) at `rate` units per second,
    plus `other_s` seconds that do not scale with it (engine starts, loading, the evaluations during training)."""

    unit: str
    work: float
    rate: float
    other_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.other_s + (self.work / self.rate if self.work > 0 else 0.0)


@dataclass(frozen=True)
class PreviewModel:
    """The model of a job's preview (`preview`, `peagle.preview`): its whole phase, the seconds from its start to
    its first training step (prepare, regenerate, capture, one step), and the regenerated tokens it leaves
    in the cache for the main run."""

    seconds: float
    first_step_s: float
    regen_tokens: float


def preview_model(spec: TrainSpec, *, hardware: str, funnel_: Mapping[str, Any] | None = None) -> PreviewModel | None:
    """The `PreviewModel` of a resolved `spec` on `hardware` (None without a preview): the model of its own
    spec (`peagle.spec.preview.preview_spec`) whose data funnel is `funnel_` (default: `data_funnel` with no
    dataset report), without the target's load (the main run's, done once)."""
    if spec.preview.conversations < 1 or preview_off_reason(spec) is not None:
        return None
    p = preview_spec(spec)
    fun = funnel_ if funnel_ is not None else data_funnel(p, {}, [])
    packed = int(fun.get("packed_rows") or 0)
    steps = optimizer_steps(p, packed) if packed else 0
    m = model_phases(p, read=int(fun[READ]), steps=steps, packed_rows=packed, hardware=hardware)
    prep = m["preparing_data"]
    before = prep.work / prep.rate + m["regenerating"].seconds + m["capturing"].seconds
    train = m["training"]
    step_s = train.work / train.rate / steps if steps and train.work > 0 else 0.0
    return PreviewModel(seconds=before + train.seconds, first_step_s=before + step_s,
                        regen_tokens=m["regenerating"].work)


def model_phases(
    spec: TrainSpec, *, read: int, steps: int, packed_rows: int, hardware: str, serve_check_ready: bool = True,
    preview_funnel: Mapping[str, Any] | None = None,
) -> dict[str, PhaseModel]:
    """The calibrated model of each `PHASE_GROUPS` phase of a resolved `spec` on `hardware` (a
    `hardware_class`) reading `read` rows, `steps` steps over `packed_rows` training rows (offline capture
    forwards each row once, whatever the epochs). The constants are the calibration machine's (`cpu-bf16`,
    target in bfloat16), scaled by `target_speed` for the target's work and `draft_speed` for training.

    The preview (`preview_model`, its data funnel `preview_funnel`; only for a spec that has one) is a phase
    measured in the seconds its model gives (`modelled seconds`: history scales them by the ratio a comparable job measured); the answers
    it regenerated are cached, so the main run's regeneration generates only the others'."""
    size = size_class(spec.target.model)
    dev = "cuda" if hardware.startswith("cuda") else "cpu"
    gpus = max(1, spec.resources.gpus)
    ts, ds = target_speed(hardware, spec.target.dtype), draft_speed(hardware)
    o = spec.optim
    step_tokens = o.pack_length * o.micro_batch_size * o.grad_accumulation
    tps = THROUGHPUT[(size, dev)] * gpus
    train_tokens = steps * step_tokens * (ALL_POSITIONS_STEP_COST if spec.peagle.loss_positions == "all" else 1.0)
    captured_tokens = packed_rows * o.pack_length
    if spec.resources.target_engine == "vllm":
        features = captured_tokens if spec.resources.capture == "offline" else 0  # online: streamed in training
        capture = PhaseModel("captured tokens", features, VLLM_CAPTURE_TOKENS_PER_S[size][dev] * gpus * ts,
                             ENGINE_START_SECONDS[dev])
    else:
        capture = PhaseModel("captured tokens", captured_tokens if spec.resources.capture == "offline" else 0,
                             3.0 * tps * ts)
    # held-out evals (at checkpoints or every eval.every_steps) forward the eval rows: about one step each
    every = spec.eval.every_steps or spec.checkpoints.every_steps
    evals = math.ceil(steps / every) if steps else 0
    held_rows = math.ceil(spec.data.eval_samples * AVG_TOKENS_PER_ROW / o.pack_length)
    train_other = evals * (1.0 + held_rows * o.pack_length / (3.0 * tps * ds))
    generated = sum(p.num_prompts for p in spec.eval.prompt_sets) * spec.eval.max_new_tokens
    # the serve check follows the reference decoder; with vLLM measuring AL its speedup run replaces it
    serve = SERVE_CHECK_SECONDS if spec.eval.serve_check and spec.eval.engine != "vllm" and serve_check_ready else 0
    regen = spec.data.regenerate
    pv = preview_model(spec, hardware=hardware, funnel_=preview_funnel)
    regenerating = PhaseModel("regenerated tokens", 0.0, 1.0)
    if regen.enabled is True:
        engine = "vllm" if regen.engine == "vllm" else "hf"
        new_tokens = read * REGEN_TURNS_PER_CONVERSATION * regen.max_new_tokens * REGEN_FILL
        if pv is not None:  # the preview's answers come from the cache
            new_tokens = max(0.0, new_tokens - pv.regen_tokens)
        regenerating = PhaseModel("regenerated tokens", new_tokens, REGEN_TOKENS_PER_S[(engine, size, dev)] * gpus * ts,
                                  ENGINE_START_SECONDS[dev] if engine == "vllm" else 0.0)
    evaluating = PhaseModel("generated tokens", generated, DECODE[(size, dev)] * ts)
    if spec.eval.engine == "vllm":  # resolved: AL measured by vLLM, one engine start per measurement
        evaluating, al_s = _vllm_eval(spec, size, dev, steps, ts)
        train_other += al_s
    training = PhaseModel("training tokens", train_tokens, tps * ds, train_other)
    if spec.resources.engine is not None:
        training = split_training(spec, training, steps=steps, rate=VLLM_CAPTURE_TOKENS_PER_S[size][dev] * ts,
                                  engine_start_s=ENGINE_START_SECONDS[dev])
    out = {
        "starting": PhaseModel("job starts", 1.0, 1.0 / STARTUP_SECONDS[dev]),
        "preparing_data": PhaseModel("conversations read", read, 1.0 / PREP_PER_CONVERSATION, LOAD_SECONDS[size]),
        "regenerating": regenerating,
        "capturing": capture,
        "training": training,
        "evaluating": evaluating,
        "exporting": PhaseModel("exports", 1.0, 1.0 / (EXPORT_SECONDS + serve)),
    }
    if pv is not None:  # a phase of the jobs that have one, in its place after preparing_data
        out = {"starting": out.pop("starting"), "preparing_data": out.pop("preparing_data"),
               "preview": PhaseModel("modelled seconds", pv.seconds, 1.0), **out}
    return out


def split_training(spec: TrainSpec, training: PhaseModel, *, steps: int, rate: float,
                   engine_start_s: float) -> PhaseModel:
    """The training phase of a job split over engine workers (`resources.engine`, issue 37): the trainer
    streams every micro-batch it reads (steps x grad_accumulation x micro_batch_size x pack_length tokens)
    from `replicas` engines of `max(1, engine.gpus)` GPUs each, capturing `rate` tokens/s per GPU, so it
    runs at the slower of its own pace and theirs, after one engine start (the replicas start at once)."""
    e, o = spec.resources.engine, spec.optim
    assert e is not None
    streamed = steps * o.grad_accumulation * o.micro_batch_size * o.pack_length
    engines = PhaseModel("captured tokens", streamed, rate * max(1, e.gpus) * e.replicas)
    compute = training.work / training.rate if training.work > 0 else 0.0
    if engines.seconds > compute:
        return PhaseModel("captured tokens", streamed, engines.rate, training.other_s + engine_start_s)
    return PhaseModel(training.unit, training.work, training.rate, training.other_s + engine_start_s)


def model_seconds(
    spec: TrainSpec, *, read: int, steps: int, packed_rows: int, hardware: str = CALIBRATION_CLASS,
    serve_check_ready: bool = True
) -> dict[str, float]:
    """Seconds per `PHASE_GROUPS` phase of `model_phases`."""
    return {k: p.seconds for k, p in model_phases(spec, read=read, steps=steps, packed_rows=packed_rows,
                                                  hardware=hardware, serve_check_ready=serve_check_ready).items()}


def _vllm_eval(spec: TrainSpec, size: str, dev: str, steps: int, ts: float) -> tuple[PhaseModel, float]:
    """(the evaluating phase, the seconds its AL measurements add to training) when vLLM measures AL: an
    engine start per measurement (the AL during training: every `eval.al_every_steps` and at checkpoints),
    the prompts generated as one batch, and the serving speedup (`eval.speedup`: the AL's draft engine times
    its K, a sweep starts one more per other K, and one engine without the draft; `speedup_rounds` rounds of
    both sides at batch 1 and at a batch of all prompts)."""
    e = spec.eval
    start = ENGINE_START_SECONDS[dev]
    one, batch = (r * ts for r in VLLM_DECODE[size][dev])
    al_s = 0.0
    if e.prompt_sets and steps:
        at = set(range(e.al_every_steps, steps + 1, e.al_every_steps)) if e.al_every_steps else set()
        calls = len(at | set(range(spec.checkpoints.every_steps, steps + 1, spec.checkpoints.every_steps)) | {steps})
        prompts = e.al_num_prompts if spec.checkpoints.select_best_by not in ("auto", "acceptance_length") \
            else e.prompt_sets[0].num_prompts
        al_s = calls * (AL_MEASUREMENT_SECONDS[dev] + prompts * e.max_new_tokens / batch)
    if not e.prompt_sets:
        return PhaseModel("generated tokens", 0.0, 1.0), al_s
    generated = sum(p.num_prompts for p in e.prompt_sets) * e.max_new_tokens
    other, work, busy = start, float(generated), generated / batch
    if e.speedup:
        k = e.num_speculative_tokens or spec.peagle.num_depths
        ks = k if e.speedup_sweep else 1
        tokens = min(e.speedup_num_prompts, e.prompt_sets[0].num_prompts) * e.max_new_tokens
        other += ks * start  # the AL's draft engine times K's passes; the sweep adds K - 1 more and one without
        work += ks * e.speedup_rounds * tokens * (4 + 2 * len(e.speedup_batch_sizes))
        busy += ks * e.speedup_rounds * (2 * (tokens / one + tokens / batch)
                                         + sum(2 * tokens / batch for _ in e.speedup_batch_sizes))
    return PhaseModel("generated tokens", work, work / busy, other), al_s
