"""The cost model's calibration: what was measured, on which machine, and how other machines scale it.

The constants were measured on the 2-core `cpu-bf16` development machine (AVX-512 with AMX-BF16) with the
demo preset (SmolLM2-135M in bfloat16, K=4, pack 1024; bench/README.md "The demo end to end",
docs/experiments.md "Estimates"). `TARGET_SPEED` and `DRAFT_SPEED` scale them for the other hardware classes
(`peagle.spec.hardware.hardware_class`) and target dtypes; `size_class` maps a target to the size the
per-size tables are keyed by. Pure data and pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from peagle.spec import TrainSpec
from peagle.spec.hardware import CPU_CLASSES, hardware_class

__all__ = [
    "ALL_POSITIONS_STEP_COST", "AL_MEASUREMENT_SECONDS", "AVG_TOKENS_PER_ROW", "BUILTIN_PROFILE", "CALIBRATION_CLASS",
    "DECODE", "DRAFT_SPEED", "ENGINE_START_SECONDS", "EXPORT_SECONDS", "HIDDEN", "HISTORY_JOBS", "HISTORY_MIN_ERROR",
    "LOAD_SECONDS", "MODEL_RANGE", "PACKING_EFFICIENCY", "PHASE_GROUPS", "PREP_PER_CONVERSATION",
    "REGEN_FILL", "REGEN_TOKENS_PER_S", "REGEN_TURNS_PER_CONVERSATION", "SERVE_CHECK_SECONDS", "STARTUP_SECONDS",
    "TARGET_SPEED", "THROUGHPUT", "VLLM_CAPTURE_TOKENS_PER_S", "VLLM_DECODE", "Profile", "draft_speed",
    "size_class", "spec_hardware", "target_speed",
]  # fmt: skip

AVG_TOKENS_PER_ROW = 700
PACKING_EFFICIENCY = 0.99  # measured 0.996 on the demo (most conversations cut at max_length)


@dataclass(frozen=True)
class Profile:
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
    "builtin:sharegpt": Profile(rows=94_000, read_per_kept=1958 / 1920,
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


def size_class(model: str) -> str:
    """The size class (`tiny`, `small`, `large`) a target's per-size constants are looked up by."""
    if model == "builtin:tiny-llama":
        return "tiny"
    if model == "builtin:smollm2-135m-instruct" or "135m" in model.lower() or "360m" in model.lower():
        return "small"
    return "large"


def spec_hardware(spec: TrainSpec, cpu_flags: frozenset[str]) -> str:
    """The hardware class (`peagle.spec.hardware.hardware_class`) `spec` runs on: `cuda-<n>gpu` when it
    resolves to CUDA, else the class of a CPU with `cpu_flags`."""
    device = str(spec.resolve(cuda_available=spec.resources.gpus > 0).resources.device)
    return hardware_class(device=device, gpus=spec.resources.gpus, cpu_flags=cpu_flags)


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
