"""Response models of checkpoints, their evaluations and serving, and of the dry-run estimate.

Part of the `/v1` API's models (`api.schemas` holds the rest); the OpenAPI schema is generated from them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas import ErrorDetail

__all__ = ["CheckpointEvaluation", "CheckpointList", "CheckpointOut", "Estimate", "FileOut", "Funnel", "Hardware",
           "ServeCommand", "Serving", "Spread"]


class FileOut(BaseModel):
    path: str
    size: int
    sha256: str
    url: str


class Spread(BaseModel):
    """Per-request values (one AL per prompt) summarised: the pooled AL hides how unequal they are."""

    min: float
    p25: float
    median: float
    p75: float
    max: float
    mean: float = Field(description="Mean of per-request ALs: NOT the AL (which pools drafts over requests).")


class Hardware(BaseModel):
    """What a speedup was measured on: it only holds there."""

    device: str = Field(description="`cpu` or `cuda`.")
    cpu: str | None = None
    cpu_count: int | None = Field(default=None, description="Logical CPUs the measuring process could use.")
    memory_gb: float | None = None
    gpu: str | None = None
    gpu_count: int | None = None
    load_average: list[float] | None = Field(default=None, description="Load average (1, 5, 15 min) at the "
                                             "start: other work on the machine makes every timing noisier.")
    load_average_end: list[float] | None = None


class SpeedupRow(BaseModel):
    """The verifier alone vs with the draft at one (K, batch size), interleaved rounds."""

    num_speculative_tokens: int
    batch_size: int
    rounds: int
    speedup: float = Field(description="Median over rounds of (tokens/s with the draft) / (tokens/s alone); "
                           "below 1 is a slowdown.")
    speedup_text: str | None = Field(default=None, description="The speedup in words (`0.45x (2.22x slower)`).")
    speedup_per_round: list[float]
    base_tokens_per_s: float = Field(description="Verifier alone, median over rounds.")
    spec_tokens_per_s: float = Field(description="Verifier with the draft, median over rounds.")
    acceptance_length: float | None = Field(description="AL of these same generations (None: no drafts).")
    per_position: list[float] = Field(default_factory=list)
    base_tokens: int | None = None
    spec_tokens: int | None = None
    speedup_cpu_time: float | None = Field(default=None, description="The same ratio by CPU time of the engine "
                                           "processes (steadier than wall time on a shared CPU machine; "
                                           "meaningless on a GPU).")


class Recommendation(BaseModel):
    batch_size: int
    num_speculative_tokens: int = Field(description="The fastest K at this batch size; 0 = serve without the "
                                       "draft (slower than the verifier alone at every K measured).")
    speedup: float = Field(description="Speedup of that K (of the best K measured when 0).")
    best_measured_k: int | None = None


class Serving(BaseModel):
    """Measured serving speedup in vLLM (`peagle.eval.speedup`)."""

    num_speculative_tokens: int = Field(description="The trained K (the headline rows).")
    batch_sizes: list[int] = Field(default_factory=list)
    rounds: int | None = None
    num_prompts: int | None = None
    batch_1: SpeedupRow | None = Field(default=None, description="Trained K, one request at a time (latency).")
    batch_n: SpeedupRow | None = Field(default=None, description="Trained K, a batch of all prompts (throughput).")
    acceptance_length: float | None = Field(default=None, description="AL of the trained K's timed generations.")
    per_position: list[float] = Field(default_factory=list)
    per_request_spread: Spread | None = None
    table: list[SpeedupRow] = Field(default_factory=list, description="Every (K, batch size) measured.")
    recommended: list[Recommendation] = Field(default_factory=list, description="Best K per batch size.")
    recommended_speculative_config: dict[str, Any] | None = None
    engines: str | None = Field(default=None, description="`both` (verifier and draft engines loaded side by "
                                "side) or `alternate` (one at a time).")
    vllm_version: str | None = None
    hardware: Hardware | None = None
    parallel_drafting_ok: bool | None = None
    summary: str | None = Field(default=None, description="One line in words.")


class PromptSetEval(BaseModel):
    acceptance_length: float | None = Field(default=None, description="Pooled: 1 + accepted / drafts (vLLM's "
                                            "definition); None when nothing was drafted.")
    per_position: list[float] = Field(default_factory=list)
    per_request_spread: Spread | None = None
    num_prompts: int | None = None
    num_drafts: int | None = None
    tokens_generated: int | None = None
    engine: str | None = None


class CheckpointEvaluation(BaseModel):
    """What the run's evaluation measured on this checkpoint (the best one)."""

    engine: str | None = Field(default=None, description="`reference` (PyTorch decoder) or `vllm`: who measured "
                               "the AL.")
    num_speculative_tokens: int | None = None
    prompt_sets: dict[str, PromptSetEval] = Field(default_factory=dict, description="AL per prompt set.")
    serving: Serving | None = Field(default=None, description="Measured serving speedup (vLLM runs only).")
    vllm: dict[str, Any] | None = Field(default=None, description="vLLM's own AL of the serve check, when the "
                                        "reference decoder measured the job's AL.")
    hardware: Hardware | None = None
    vllm_version: str | None = None
    parallel_drafting_ok: bool | None = None


class CheckpointOut(BaseModel):
    step: int
    dir: str
    metrics: dict[str, Any]
    tau_sim: float | None
    acceptance_length: float | None
    is_best: bool
    is_latest: bool
    files: list[FileOut]
    created_at: datetime
    archive_url: str
    serve_url: str
    folder: str = Field(description="What the archive unpacks to (`<folder>/config.json`, ...) and "
                        "`peagle jobs download` writes by default; the serve command names it.")
    evaluation: CheckpointEvaluation | None = Field(default=None, description="The evaluation of this checkpoint "
                                                    "(the job's best): AL per prompt set, serving speedup.")


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointOut]


class ServeCommand(BaseModel):
    command: str = Field(description="Short form, run beside the unpacked archive (`./<model_dir>`): the draft's "
                         "config.json names the verifier.")
    long_command: str = Field(description="Explicit verifier (a hub id, never a server path) + --speculative-config.")
    speculative_config: dict[str, Any]
    model_dir: str = Field(description="The folder the archive unpacks to; `peagle jobs download`'s default --out.")
    note: str | None = Field(default=None, description="Set when the verifier is not loadable by name elsewhere "
                             "(`builtin:tiny-llama`, random weights with no hub copy): what to do instead.")
    recommended: list[Recommendation] = Field(default_factory=list, description="Best K per batch size as "
                                              "measured (the long form uses the K of the smallest batch that gains).")
    speedup_note: str | None = Field(default=None, description="The measured speedup in words, slowdowns "
                                     "included, and the hardware it was measured on; None: not measured.")


class Funnel(BaseModel):
    """The data funnel (`peagle.spec.funnel`; the same keys in the dry run, the job's `data` event and the
    dataset report): read -> kept (+ dropped, each under one reason) -> held out -> packed rows -> tokens."""

    read: int = Field(description="Conversations (rows) read from the sources.")
    kept: int = Field(description="Conversations that passed every check.")
    dropped: int = Field(description="read - kept.")
    dropped_by_reason: dict[str, int] = Field(description="Reason -> conversations; sums to `dropped`.")
    held_out: int = Field(description="Kept conversations held out for evaluation (`data.eval_samples`).")
    train_conversations: int
    packed_rows: int | None = Field(description="Training rows after packing (null: not known here).")
    train_tokens: int | None = Field(description="Tokens in the training rows (null: not known here).")
    truncated: int | None = Field(description="Kept conversations cut at `data.max_length` (null: not known).")
    estimated: bool = Field(description="True in the dry run (an estimate), false when counted.")
    prompts_only: int | None = Field(default=None, description="Rows read that end with a user turn and have no "
                                     "answer (request bodies, prompts): kept when `data.regenerate.enabled` is on "
                                     "(the target writes the answer), else among the `no_assistant_turn` drops "
                                     "(null: not known here).")


class Estimate(BaseModel):
    """`?dry_run=true`: what the job would cost, without queuing it."""

    object: Literal["estimate"] = "estimate"
    valid: bool = Field(default=True, description="False when `problems` is not empty: submitting would be a 422.")
    problems: list[ErrorDetail] = Field(default_factory=list, description="What would stop the job before it is "
                                        "queued (a dataset not `ready`, no usable row, a missing model folder).")
    spec: dict[str, Any]
    rows: int = Field(description="Conversations used (estimated when the source size is unknown).")
    tokens: int = Field(description="Training tokens after templating (estimate).")
    optimizer_steps: int
    tokens_per_step: int
    hidden_state_bytes: int = Field(description="Disk the job's target features take at most: the whole dump "
                                    "offline, at most resources.feature_disk_gb online through vLLM, 0 online in "
                                    "the trainer.")
    feature_bytes_per_token: int = Field(description="Bytes of target features per token (aux + final state).")
    offline_dump_bytes: int = Field(description="What an offline dump of every training and held-out token "
                                    "would take (the capture: offline figure).")
    target_engine: Literal["auto", "hf", "vllm"] = Field(
        description="Where the target will run: vllm (an engine beside a draft-only trainer) or hf; auto only "
                    "when the API cannot tell what the workers have.")
    target_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        description="The target's dtype as the job will run it: `auto` is bfloat16 only where the device runs it "
                    "natively (a CUDA GPU, a CPU with avx512_bf16 or amx_bf16), else float32.")
    wall_clock_seconds: float = Field(description="Wall-clock estimate on the requested device (sum of "
                                      "`phase_seconds`).")
    wall_clock_range_seconds: list[float] = Field(description="[low, high]: the range `accuracy` states.")
    first_curve_s: float = Field(description="Seconds from the job's start to its first training metric: the "
                                 "preview's first step (spec `preview`), else the main run's.")
    phase_seconds: dict[str, float] = Field(description="Seconds per phase: preparing_data, preview, regenerating, "
                                            "capturing, training, evaluating, exporting (export + serve check).")
    basis: Literal["history", "model"] = Field(description="history: rates measured by comparable earlier jobs "
                                               "(same target, dtype, engines, hardware class); model: the "
                                               "calibrated model alone.")
    history_jobs: int = Field(description="Earlier jobs the estimate is measured from.")
    accuracy: str = Field(description="How far to trust the estimate, and why.")
    funnel: Funnel
    queue: str
    queue_position: int = Field(description="Jobs ahead on that queue: those its workers run now and those "
                                "queued before (0: the next free worker takes it; `queue_running` of them run).")
    queue_running: int = Field(default=0, description="Of `queue_position`, the jobs running on that queue now.")
    notes: list[str]
