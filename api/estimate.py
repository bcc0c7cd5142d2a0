"""Dry-run estimate of a job: its data funnel, per-phase wall time and how far to trust it.

No torch, no tokenizer, no data read. Two sources, stated in the answer (`basis`, `accuracy`):

* **history**: earlier succeeded jobs comparable to this one (`Comparable`: the same target and revision,
  resolved target dtype, target and regeneration engines and hardware class; `api.history` reads them).
  Each phase is measured as a rate of its own work (conversations read, regenerated tokens, captured
  tokens, training tokens, generated tokens: `PhaseModel`), so a comparable job of another size scales;
  the median rate per phase replaces the model's, and the spread between the jobs is the stated accuracy.
  A job of another model never informs it.
* **model** (the phases no comparable job measured): the calibrated model below, for the job's hardware
  class (`peagle.spec.hardware.hardware_class`: `cpu-bf16`, `cpu-avx512`, `cpu-avx2`, `cpu`, `cuda-<n>gpu`).
  Its constants were measured on the 2-core `cpu-bf16` development machine (AVX-512 with AMX-BF16) with
  the demo preset (SmolLM2-135M in bfloat16, K=4, pack 1024; bench/README.md "The demo end to end",
  docs/experiments.md "Estimates"); `TARGET_SPEED` and `DRAFT_SPEED` scale them for the other classes
  and target dtypes. A loaded machine is slower, hence the stated range `MODEL_RANGE`
  (`make bench` checks each phase within 1.5x on this machine: `bench/bench_estimate.py`).

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
from peagle.spec.hardware import CPU_CLASSES, DeviceFacts, cpu_facts, hardware_class
from peagle.spec.preview import preview_off_reason, preview_spec

__all__ = ["CALIBRATION_CLASS", "HISTORY_JOBS", "MODEL_RANGE", "PHASE_GROUPS", "Comparable", "Measured",
           "PhaseModel", "PhaseRate", "PreviewModel", "estimate", "measured_rates", "model_phases", "model_seconds",
           "preview_model", "spec_hardware"]

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
# training tokens (packed row slots) per second; small/cpu: the demo's 2836 steps of 1024 tokens, every
# position trained (x ALL_POSITIONS_STEP_COST), in 30 min on a quiet day (2026-11-27, bench/README.md "The
# demo end to end"; was 930 from the 640-conversation demo before the oneDNN trainer).
THROUGHPUT = {("small", "cpu"): 1_900.0, ("tiny", "cpu"): 40_000.0, ("large", "cuda"): 25_000.0,
              ("small", "cuda"): 200_000.0, ("large", "cpu"): 20.0, ("tiny", "cuda"): 1_000_000.0}
# tokens generated per second by the reference decoder (target + draft), per size class and device.
DECODE = {("small", "cpu"): 6.0, ("tiny", "cpu"): 2_000.0, ("large", "cuda"): 40.0, ("small", "cuda"): 300.0,
          ("large", "cpu"): 0.5, ("tiny", "cuda"): 2_000.0}
LOAD_SECONDS = {"tiny": 1.0, "small": 3.0, "large": 60.0}
# a job's start in a worker before its first phase: the trainer process (interpreter, torch and transformers
# imports), measured 4 s from `started_at` to `validating` for the tiny preset on 2 cores (load 2); the
# tiny job took 12.8-13.3 s in the service against 8.2 s estimated without it (issue 39)
STARTUP_SECONDS = {"cpu": 5.0, "cuda": 20.0}
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
# one live AL measurement during training, engine start included (the demo: 23 in about 8 min, quiet day)
AL_MEASUREMENT_SECONDS = {"cpu": 20.0, "cuda": 60.0}
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
#: The hardware class the constants above were measured on (AVX-512 + AMX-BF16, 2 cores, target in bf16).
CALIBRATION_CLASS = "cpu-bf16"
#: The target's speed per CPU class and resolved dtype against CALIBRATION_CLASS in bfloat16 (regeneration,
#: capture, decoding). Measured (docs/experiments.md "Estimates", `bench.cpu_class_speed`): fp32 on cpu-bf16
#: 0.37 of bf16 in vLLM generation, 0.45 in capture; fp32 with AVX2 emulated 0.21 (an upper bound: vLLM's own
#: kernels keep their AVX-512); bf16 on an AVX2-only EPYC 19-26 tokens/s where cpu-bf16 makes about 400
#: (issue 39). The classes without a measurement (cpu-avx512 bf16, plain cpu) are guesses, said so there.
TARGET_SPEED: Mapping[tuple[str, str], float] = {
    ("cpu-bf16", "bfloat16"): 1.0, ("cpu-bf16", "float32"): 0.4,
    ("cpu-avx512", "bfloat16"): 0.1, ("cpu-avx512", "float32"): 0.4,
    ("cpu-avx2", "bfloat16"): 0.055, ("cpu-avx2", "float32"): 0.2,
    ("cpu", "bfloat16"): 0.02, ("cpu", "float32"): 0.08,
}
#: The draft's fp32 training speed per CPU class against CALIBRATION_CLASS (cpu-avx2: 0.83 measured with
#: AVX2 emulated for torch, oneDNN and MKL; plain cpu a guess).
DRAFT_SPEED: Mapping[str, float] = {"cpu-bf16": 1.0, "cpu-avx512": 1.0, "cpu-avx2": 0.8, "cpu": 0.25}
#: At most this many earlier comparable jobs (the newest) inform an estimate.
HISTORY_JOBS = 5
#: The least error stated for a phase measured by earlier jobs (one job, or jobs that agree).
HISTORY_MIN_ERROR = 0.2

#: Estimate phase -> the pipeline phases (`peagle.spec.phases`) whose time it covers.
PHASE_GROUPS: Mapping[str, tuple[str, ...]] = {
    "starting": (),  # from the worker's start of the job to its first phase: no phase event, the model's always
    "preparing_data": ("validating", "preparing_data", "building_vocab"),
    "preview": ("preview",),
    "regenerating": ("regenerating",),
    "capturing": ("capturing",),
    "training": ("training",),
    "evaluating": ("evaluating",),
    "exporting": ("exporting", "serve_check"),
}


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


def spec_hardware(spec: TrainSpec, cpu_flags: frozenset[str]) -> str:
    """The hardware class (`peagle.spec.hardware.hardware_class`) `spec` runs on: `cuda-<n>gpu` when it
    resolves to CUDA, else the class of a CPU with `cpu_flags`."""
    device = str(spec.resolve(cuda_available=spec.resources.gpus > 0).resources.device)
    return hardware_class(device=device, gpus=spec.resources.gpus, cpu_flags=cpu_flags)


@dataclass(frozen=True)
class Comparable:
    """What makes two jobs' phase rates comparable: the same target (model and revision), resolved target
    dtype, target engine, regeneration engine (`none` without regeneration) and hardware class."""

    model: str
    revision: str | None
    dtype: str
    target_engine: str
    regen_engine: str
    hardware: str

    @classmethod
    def of(cls, resolved: Mapping[str, Any], hardware: str) -> Comparable:
        """From a resolved spec as JSON (a job's `resolved_spec`, or `spec.model_dump(mode="json")`)."""
        target = resolved.get("target") or {}
        regen = (resolved.get("data") or {}).get("regenerate") or {}
        res = resolved.get("resources") or {}
        split = res.get("engine")  # engine workers beside the trainer (issue 37): another training rate
        engine = str(res.get("target_engine")) + (
            f" split over {split.get('replicas')} engine workers of {split.get('gpus')} GPUs"
            if isinstance(split, dict) else "")
        return cls(model=str(target.get("model")), revision=target.get("revision"), dtype=str(target.get("dtype")),
                   target_engine=engine,
                   regen_engine=str(regen.get("engine")) if regen.get("enabled") is True else "none",
                   hardware=hardware)

    def describe(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return (f"target {self.model}{rev} in {self.dtype}, target engine {self.target_engine}, regeneration "
                f"{self.regen_engine}, hardware {self.hardware}")


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


def target_speed(hardware: str, dtype: str) -> float:
    """How fast the target runs on `hardware` in `dtype`, against the calibration machine's bfloat16."""
    if hardware.startswith("cuda"):
        return 1.0
    cls = hardware if hardware in CPU_CLASSES else "cpu"
    if dtype == "float16":  # no CPU class here computes in fp16 natively: as fast as bf16 where that is emulated
        dtype = "float32" if cls == "cpu-bf16" else "bfloat16"
    return TARGET_SPEED[(cls, "float32" if dtype not in ("bfloat16", "float32") else dtype)]


def draft_speed(hardware: str) -> float:
    """How fast the draft (fp32) trains on `hardware`, against the calibration machine."""
    return 1.0 if hardware.startswith("cuda") else DRAFT_SPEED.get(hardware, DRAFT_SPEED["cpu"])


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
    spec (`peagle.spec.preview.preview_spec`) whose data funnel is `funnel_` (default: `_data_funnel` with no
    dataset report), without the target's load (the main run's, done once)."""
    if spec.preview.conversations < 1 or preview_off_reason(spec) is not None:
        return None
    p = preview_spec(spec)
    fun = funnel_ if funnel_ is not None else _data_funnel(p, {}, [])
    packed = int(fun.get("packed_rows") or 0)
    steps = _steps(p, packed) if packed else 0
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
    size = _size_class(spec.target.model)
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


@dataclass(frozen=True)
class Measured:
    """One earlier succeeded job: its resolved spec, what makes it comparable, the measured seconds of each
    `PHASE_GROUPS` phase, the optimizer steps it ran, its counted data funnel (None: not recorded, the model's
    is used) and the tokens its regeneration generated (None: not recorded; 0: every answer was cached)."""

    job_id: str
    spec: TrainSpec
    key: Comparable
    phase_seconds: Mapping[str, float]
    steps: int
    funnel: Mapping[str, Any] | None = None
    regen_tokens: int | None = None


@dataclass(frozen=True)
class PhaseRate:
    """What one earlier job measured of one phase: its rate of the phase's own work (None: it did none) and
    the factor on the model's `other_s` seconds (at most 1 when it did work: a faster machine)."""

    rate: float | None
    other_factor: float


def measured_rates(m: Measured) -> dict[str, PhaseRate]:
    """Per phase that `m` ran (and the model gives more than half a second), its measured rate.

    The measured seconds are split as the model splits them when the job was faster than modelled (both
    parts scaled), else the model's `other_s` is taken as it is and the rest is the phase's own work; so an
    estimate of the same spec from these rates gives back the measured seconds."""
    fun: Mapping[str, Any] = m.funnel if m.funnel and m.funnel.get(READ) else _data_funnel(m.spec, {}, [])
    model = model_phases(m.spec, read=int(fun[READ]), steps=m.steps, packed_rows=int(fun.get("packed_rows") or 0),
                         hardware=m.key.hardware)
    out: dict[str, PhaseRate] = {}
    for phase, secs in m.phase_seconds.items():
        p = model.get(phase)
        if p is None or p.seconds <= 0.5 or secs <= 0:
            continue
        work = p.work
        if phase == "regenerating":  # the tokens it generated; cached answers are no work (and no rate)
            if not m.regen_tokens:
                continue
            work = float(m.regen_tokens)
        if work > 0:
            factor = min(1.0, secs / p.seconds)
            out[phase] = PhaseRate(rate=work / (secs - p.other_s * factor), other_factor=factor)
        elif p.other_s > 0:
            out[phase] = PhaseRate(rate=None, other_factor=secs / p.other_s)
    return out


def _from_history(model: Mapping[str, PhaseModel], rates: Mapping[str, list[PhaseRate]]
                  ) -> dict[str, tuple[float, float]]:
    """Per phase with measurements: (seconds, spread) where seconds uses the median rate and other-factor and
    spread is the largest factor by which one job's own rates would differ from that (1.0: one job)."""
    out: dict[str, tuple[float, float]] = {}
    for phase, rs in rates.items():
        p = model.get(phase)
        if p is None or not rs or p.seconds <= 0:
            continue

        def secs(rate: float | None, factor: float, p: PhaseModel = p) -> float:
            return p.other_s * factor + (p.work / rate if p.work > 0 and rate else 0.0)

        with_rate = [r.rate for r in rs if r.rate]
        if p.work > 0 and not with_rate:
            continue  # earlier jobs did none of this phase's work: nothing to scale it by
        mid = secs(statistics.median(with_rate) if with_rate else None, statistics.median(r.other_factor for r in rs))
        each = [secs(r.rate if r.rate else None, r.other_factor) for r in rs if r.rate or p.work <= 0]
        spread = max((max(e / mid, mid / e) for e in each if e > 0 and mid > 0), default=1.0)
        out[phase] = (mid, spread)
    return out


def estimate(spec: TrainSpec, *, dataset_rows: dict[str, dict[str, Any]], queue: str, queue_position: int,
             history: Sequence[Measured] = (), vllm_available: bool | None = None, queue_running: int = 0,
             cpu_flags: frozenset[str] | None = None) -> dict[str, Any]:
    """The data funnel, steps, per-phase and total wall time of `spec`, with its basis and accuracy.

    Args:
        spec: a validated spec.
        dataset_rows: `dataset:<id>` -> that dataset's validation report (its funnel, tokens if known).
        queue: the queue the job would go to.
        queue_position: jobs ahead of it on `queue`: running there now and queued (`repo.queue_ahead`).
        queue_running: how many of those run now.
        history: earlier succeeded jobs on `queue`, newest first (`api.history`); only the newest
            `HISTORY_JOBS` comparable to this one (`Comparable`) are used.
        vllm_available: whether the workers can run the vLLM target engine (resolves `target_engine: auto`).
        cpu_flags: the workers' CPU flags (default: this host's, which the workers share in docker-compose).
    """
    notes: list[str] = []
    flags = cpu_facts().cpu_flags if cpu_flags is None else cpu_flags
    # estimate what the worker will run: the engines resolved (when known) and `target.dtype: auto` by what
    # the CPU runs natively
    spec = spec.resolve(cuda_available=spec.resources.gpus > 0, vllm_available=vllm_available,
                        device_facts=DeviceFacts(cpu_flags=flags))
    hw = spec_hardware(spec, flags)
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
    pv_on = spec.preview.conversations > 0 and preview_off_reason(spec) is None
    pv_funnel = _data_funnel(preview_spec(spec), dataset_rows, []) if pv_on else None
    model = model_phases(spec, read=fun[READ], steps=steps, packed_rows=fun["packed_rows"] or 0, hardware=hw,
                         preview_funnel=pv_funnel)
    key = Comparable.of(spec.model_dump(mode="json"), hw)
    used = [m for m in history if m.key == key][:HISTORY_JOBS]
    rates: dict[str, list[PhaseRate]] = {k: [] for k in PHASE_GROUPS}
    for m in used:
        for phase, r in measured_rates(m).items():
            rates[phase].append(r)
    measured = _from_history(model, rates)
    phases: dict[str, float] = {}
    lo = hi = 0.0
    worst = 1.0
    for phase, p in model.items():
        if phase in measured:
            secs, spread = measured[phase]
            err = max(HISTORY_MIN_ERROR, spread - 1.0)
            worst = max(worst, 1.0 + err)
            phases[phase], lo, hi = secs, lo + secs / (1 + err), hi + secs * (1 + err)
        else:
            phases[phase] = p.seconds
            lo, hi = lo + p.seconds * MODEL_RANGE[0], hi + p.seconds * MODEL_RANGE[1]
    total = sum(phases.values())
    calibrated = (f"calibrated model for {hw} with the target in {spec.target.dtype} (typically within "
                  f"{MODEL_RANGE[0]}x-{MODEL_RANGE[1]}x, idle to moderately loaded machine)")
    if hw not in (CALIBRATION_CLASS,) and not hw.startswith("cuda"):
        calibrated += f"; constants measured on {CALIBRATION_CLASS}, scaled for {hw}"
    if measured:
        from_model = [p for p in model if p not in measured and model[p].seconds > 0.5]
        ids = ", ".join(m.job_id for m in used)
        accuracy = (f"from {len(used)} comparable earlier job{'s' if len(used) > 1 else ''} ({ids}; {key.describe()}) "
                    f"for {', '.join(measured)}: ±{round(100 * (worst - 1))}%")
        if from_model:
            accuracy += f"; {', '.join(from_model)}: {calibrated}"
        basis = "history"
    else:
        others = len(history) - len(used)
        why = (f" ({others} earlier job{'s' if others > 1 else ''} there differ in target, dtype, engine or "
               "hardware)") if others else ""
        accuracy = f"no comparable history on queue {queue}{why}: {calibrated}"
        basis = "model"
    if queue_position:
        notes.append(f"{queue_position} job{'s' if queue_position > 1 else ''} ahead on queue {queue}: "
                     f"{queue_running} running, {queue_position - queue_running} queued; it starts when a worker "
                     "of the queue is free")
    first_curve = _first_curve_seconds(spec, model, phases, steps, preview_model(spec, hardware=hw,
                                                                                 funnel_=pv_funnel))
    off = preview_off_reason(spec)
    if pv_on:
        notes.append(f"first training curve after about {_minutes(first_curve)}: a preview of "
                     f"{spec.preview.steps} steps on the first {spec.preview.conversations} conversations, "
                     "before the main run (phase preview)")
    else:
        if off is not None:
            notes.append(f"no preview: {off}")
        notes.append(f"first training curve after about {_minutes(first_curve)} (when training starts)")
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
        "first_curve_s": round(first_curve, 1),
        "basis": basis,
        "history_jobs": len(used),
        "accuracy": accuracy,
        "funnel": fun,
        "queue": queue,
        "queue_position": queue_position,
        "queue_running": queue_running,
        "notes": notes,
    }


def _first_curve_seconds(spec: TrainSpec, model: Mapping[str, PhaseModel], phases: Mapping[str, float], steps: int,
                         pv: PreviewModel | None) -> float:
    """Seconds from the job's start to its first training metric: its start in the worker, the target's load and the preview's first
    step when the spec has a preview, else every phase before training and one main step; each part scaled
    as the estimate of its phase was (history or model)."""
    prep, start = model["preparing_data"], phases.get("starting", 0.0)
    if pv is not None and "preview" in model:
        own = model["preview"].seconds
        factor = phases["preview"] / own if own > 0 else 1.0
        return start + prep.other_s + pv.first_step_s * factor
    train = model["training"]
    step = train.work / train.rate / steps if steps and train.work > 0 else 0.0
    factor = phases["training"] / train.seconds if train.seconds > 0 else 1.0
    return start + phases["preparing_data"] + phases["regenerating"] + phases["capturing"] + step * factor


def _minutes(seconds: float) -> str:
    """`95` -> `2 min`, `30` -> `30 s`."""
    return f"{round(seconds)} s" if seconds < 90 else f"{round(seconds / 60)} min"
