"""The job spec: the single source of truth for a P-EAGLE training run.

One pydantic model, `TrainSpec`, is the CLI input (`peagle train spec.yaml`), the API body
(`POST /v1/jobs`), the database JSON column and the worker input. It is torch-free so the API can
import it without pulling in the ML stack.

Validation lists every problem at once. Field-level problems come from pydantic; cross-field problems
(e.g. ``down_sample_ratio_min <= down_sample_ratio``) are collected by `peagle.spec.checks` and
reported with the exact field path. `peagle.spec.parse.parse_spec` turns both into a flat list of `SpecProblem`:

    >>> parse_spec({"target": {"model": "x"}, "peagle": {"num_depths": 0}})
    Traceback (most recent call last):
    ...
    peagle.errors.SpecInvalidError: 1 problem in the job spec: peagle.num_depths: ...

Builtin names resolve to offline fixtures (see `peagle.builtin`): targets
``builtin:smollm2-135m-instruct`` and ``builtin:tiny-llama``; data ``builtin:sharegpt``; prompt sets
``humaneval`` and ``sharegpt-heldout``, and ``heldout``: the job's own held-out conversations
(``data.eval_samples``), each up to its first answer.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from peagle.errors import SpecInvalidError
from peagle.spec.base import Strict as _Strict
from peagle.spec.resources import (
    ENGINE_QUEUE_PREFIX,
    RESERVED_QUEUES,
    VLLM_EXTRA_FLAGS,
    ResourceSpec,
    VllmSpec,
    queue_problem,
)
from peagle.spec.targets import is_hub_id

if TYPE_CHECKING:
    from peagle.spec.hardware import DeviceFacts

SPEC_VERSION = 1

BUILTIN_TARGETS = ("builtin:smollm2-135m-instruct", "builtin:tiny-llama")
BUILTIN_DATA = ("builtin:sharegpt",)
#: The prompt set made of the job's own held-out conversations (data.eval_samples), each up to its first answer.
HELDOUT_PROMPT_SET = "heldout"
BUILTIN_PROMPT_SETS = ("humaneval", "sharegpt-heldout", HELDOUT_PROMPT_SET)
#: Prefix of a data source path naming an uploaded dataset (`dataset:<id>`): the API writes and checks
#: it, the worker and `peagle.builtin` resolve it. The one definition (the service re-exports it).
DATASET_PREFIX = "dataset:"

__all__ = [
    "BUILTIN_DATA",
    "BUILTIN_PROMPT_SETS",
    "BUILTIN_TARGETS",
    "DATASET_PREFIX",
    "ENGINE_QUEUE_PREFIX",
    "HELDOUT_PROMPT_SET",
    "RESERVED_QUEUES",
    "SPEC_VERSION",
    "VLLM_EXTRA_FLAGS",
    "CheckpointSpec",
    "DataSource",
    "DataSpec",
    "DraftSpec",
    "EvalSpec",
    "OptimSpec",
    "PEagleSpec",
    "PreviewSpec",
    "PromptSet",
    "RegenerateSpec",
    "ResourceSpec",
    "SpecInvalidError",
    "SpecProblem",
    "TargetSpec",
    "TrainSpec",
    "VllmSpec",
    "dataset_id",
    "dataset_ref",
    "queue_problem",
    "spec_hash",
]


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


#: `target.name_or_path` (it lands in the export's config and in the serve command): a builtin, a hub id
#: (`name` or `org/name`, as `peagle.spec.targets.is_hub_id`), or an absolute folder of shell-safe characters.
_VERIFIER_NAME = (r"^(builtin:[a-z0-9.-]+|[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?"
                  r"|(/[A-Za-z0-9._+@=-]+)+)$")


class TargetSpec(_Strict):
    """The target (verifier) model the draft learns to imitate."""

    model: str = Field(
        min_length=1,
        max_length=512,
        description="Local HF folder, a hub id (needs network at run time), or a builtin "
        "(`builtin:smollm2-135m-instruct`, `builtin:tiny-llama`).",
    )
    revision: str | None = Field(
        default=None, max_length=128, description="Hub revision (branch, tag or commit); None = default."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Target weights dtype (vLLM's and the trainer's); auto = bfloat16 where the "
        "device runs it natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else float32."
    )
    name_or_path: str | None = Field(
        default=None,
        max_length=512,
        pattern=_VERIFIER_NAME,
        description="Verifier name written into the exported config (what `vllm serve` loads where the draft "
        "is downloaded); default = `model`, a builtin its hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`; "
        "`builtin:tiny-llama` has none and stays as is), a local folder its absolute path. Set: a hub id, builtin "
        "or absolute path of `A-Za-z0-9._+@=-`.",
    )

    @field_validator("name_or_path")
    @classmethod
    def _verifier_name(cls, value: str | None) -> str | None:
        """What the pattern cannot say: a known builtin, a hub id without `..`, a folder without `.`/`..`."""
        if value is None:
            return value
        if value.startswith("builtin:"):
            ok = value in BUILTIN_TARGETS
        elif value.startswith("/"):
            ok = not {".", ".."} & set(value.split("/"))
        else:
            ok = is_hub_id(value)
        if not ok:
            raise PydanticCustomError("name_or_path", "must be a hub id ('org/name'), a builtin "
                                      f"({', '.join(BUILTIN_TARGETS)}) or an absolute folder path without "
                                      f"'.' or '..' segments, got {value!r}")
        return value


class DataSource(_Strict):
    """One training data file."""

    path: str = Field(
        min_length=1,
        max_length=1024,
        description="Local file path, `dataset:<id>` for an uploaded dataset, or `builtin:sharegpt`.",
    )
    format: Literal["auto", "sharegpt", "messages", "tokenized", "prompt"] = Field(
        default="auto",
        description="ShareGPT (`conversations` with from/value), `messages` JSONL (role/content; an OpenAI "
        "request body is one), pre-tokenised JSONL (`input_ids` + `loss_mask`), or `prompt` (a prompt list: "
        "the target writes the answers); auto detects from the first row.",
    )
    max_samples: int | None = Field(
        default=None, ge=1, le=100_000_000, description="Use at most this many rows of this source."
    )
    skip: int = Field(default=0, ge=0, le=100_000_000, description="Skip this many rows first.")


class RegenerateSpec(_Strict):
    """Replace assistant turns with the target's own answers (on-policy data: drafts accept more)."""

    enabled: bool | Literal["auto"] = Field(
        default=False,
        description="Regenerate assistant responses with the target; auto = when the resolved target engine "
        "is vllm (the transformers path generates about 40x slower on a CPU).",
    )
    engine: Literal["auto", "hf", "vllm"] = Field(
        default="auto", description="Generation engine; auto = resources.target_engine as resolved."
    )
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, description="0 = greedy.")
    max_new_tokens: int = Field(default=512, ge=1, le=32768, description="Per regenerated turn.")
    on_length: Literal["drop", "keep"] = Field(
        default="drop",
        description="A conversation with an answer cut at max_new_tokens (finish_reason length): drop it "
        "(counted in the data funnel) or keep the cut answer.",
    )
    batch_size: int = Field(
        default=8, ge=1, le=1024,
        description="Prompts per generate() call (hf); conversations in flight at once (vllm).",
    )


class DataSpec(_Strict):
    """Training data and how it becomes rows."""

    sources: list[DataSource] = Field(min_length=1, max_length=64, description="Training data files.")
    max_length: int = Field(
        default=2048, ge=16, le=131072, description="Max tokens of one conversation (truncated beyond)."
    )
    max_samples: int | None = Field(
        default=None, ge=1, le=100_000_000, description="Total conversations kept after all sources."
    )
    eval_samples: int = Field(
        default=0, ge=0, le=1_000_000, description="Held-out conversations for tau_sim / per-depth accuracy."
    )
    regenerate: RegenerateSpec = Field(default_factory=RegenerateSpec, description="Response regeneration.")
    think: Literal["keep", "mask", "drop"] = Field(
        default="keep",
        description="`<think>` traces: keep (supervised), mask (in context, not supervised), drop (removed).",
    )
    min_assistant_tokens: int = Field(
        default=1, ge=1, le=100_000, description="Rows with fewer supervised tokens are skipped (reported)."
    )


class DraftSpec(_Strict):
    """The draft network (Llama-style EAGLE-3 with P-EAGLE extras)."""

    num_layers: int = Field(default=1, ge=1, le=32, description="Draft decoder layers (fused first + L-1).")
    draft_vocab_size: int | None = Field(
        default=None,
        ge=16,
        le=1_048_576,
        description="Draft vocabulary (most frequent assistant tokens); None = the target's full vocab.",
    )
    aux_layer_ids: list[int] | Literal["auto"] = Field(
        default="auto",
        description="3 target layer ids in the vLLM 'input of layer' convention; auto = [2, N//2, N-3].",
    )
    mask_token_id: int | Literal["auto"] = Field(
        default="auto",
        description="Token placed in masked (depth >= 1) slots; auto = tokenizer mask token, else the first "
        "unused embedding slot, else an unused reserved special token.",
    )
    freeze_embeddings: bool = Field(default=False, description="Keep embed_tokens frozen (P-EAGLE trains it).")
    freeze_lm_head: bool = Field(default=False, description="Keep lm_head frozen.")
    layer_init: Literal["target", "random"] = Field(
        default="target",
        description="target: the decoder layers start as copies of the target's last num_layers layers (the "
        "fused first layer's q/k/v in both halves), fc selecting the last aux layer and the final norm from the "
        "target (demo AL 1.225 -> 1.266 in a paired run); random: N(0, 0.02) as speculators and NeMo do.",
    )
    mask_hidden_init: Literal["random", "feature_mean"] = Field(
        default="random",
        description="random: mask_hidden ~ N(0, 1) as speculators and NeMo do; feature_mean: the mean captured "
        "target feature over the run's first micro-batches, so masked (depth >= 1) slots start as an average "
        "target state (docs/decisions.md decision 25).",
    )
    init_from: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="Warm start from these weights, optimizer fresh: `job:<id>` (the owner's job, its best "
        "checkpoint), `job:<id>@step_<N>`, `draft:<id>` (`POST /v1/drafts`) or an export folder (CLI only). "
        "Takes the source's draft vocabulary and mask token; hidden size, layers and aux layer ids must match "
        "(docs/warm_start.md).",
    )

    @field_validator("init_from")
    @classmethod
    def _init_from_shape(cls, value: str | None) -> str | None:
        from peagle.spec.init_from import parse_init_from

        if value is not None:
            try:
                parse_init_from(value)
            except ValueError as exc:
                raise PydanticCustomError("init_from", str(exc)) from None
        return value


class PEagleSpec(_Strict):
    """P-EAGLE training knobs (COD sampling, partitioning)."""

    num_depths: int = Field(
        default=8, ge=1, le=32, description="K: parallel prediction depths = speculative tokens at serve time."
    )
    down_sample_ratio: float = Field(
        default=0.7, gt=0.0, le=1.0, description="r: depth d keeps a fraction max(r**d, r_min) of anchors."
    )
    down_sample_ratio_min: float = Field(
        default=0.2, ge=0.0, le=1.0, description="r_min: floor of the per-depth keep fraction."
    )
    max_anchors: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Cap on chains per row (memory); None = no cap."
    )
    sequence_partitions: int = Field(
        default=1, ge=1, le=64, description="S: forward+backward per segment with exact gradients."
    )
    gradient_checkpointing: bool = Field(default=False, description="Recompute draft layers in backward.")
    depth_decay: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="gamma: a depth-d element's loss weight is gamma**d (the loss stays a weighted mean); 1 = "
        "every COD element counts the same (speculators, NeMo). Below 1 the draft spends more of its capacity "
        "on the early depths that decide most of the acceptance length (docs/decisions.md decision 15).",
    )
    target_temperature: float = Field(
        default=1.0,
        ge=0.0,
        le=10.0,
        description="T: the KL fits softmax(target logits / T); 1 = the target's own distribution (speculators, "
        "NeMo); below 1 it is sharpened toward the greedy token that verification accepts; 0 = cross-entropy on "
        "the target's argmax (docs/decisions.md decision 17).",
    )
    logit_mse: float = Field(
        default=0.0,
        ge=0.0,
        le=100.0,
        description="lambda: adds lambda x mean over the draft vocabulary of the squared gap between the draft's "
        "and the target's logits, each row's mean removed (logit matching, the KL's high-temperature limit), to "
        "each element's KL; 0 = the KL alone (speculators, NeMo) (docs/decisions.md decision 23).",
    )
    loss_positions: Literal["assistant", "all"] = Field(
        default="assistant",
        description="Training positions: `assistant` = the assistant tokens of the loss mask (speculators, NeMo); "
        "`all` = every token whose next token is in the same conversation, prompts included (the target's logits "
        "are captured there too). Held-out metrics always score the assistant tokens "
        "(docs/decisions.md decision 20).",
    )
    feature_noise: float = Field(
        default=0.0,
        ge=0.0,
        le=10.0,
        description="a: training adds uniform noise in [-a, a] x RMS to each aux state of each token (EAGLE's "
        "feature noise, scaled to each state's own size); 0 = off. Held-out metrics and serving see the clean "
        "features (docs/decisions.md decision 20).",
    )


class OptimSpec(_Strict):
    """Optimisation."""

    lr: float = Field(default=6e-4, gt=0.0, le=1.0, description="Peak learning rate (AdamW).")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW betas, each in [0, 1).")
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    schedule: Literal["constant", "linear", "cosine"] = Field(default="cosine", description="LR schedule.")
    warmup_ratio: float = Field(default=0.01, ge=0.0, le=0.5, description="Warmup as a fraction of steps.")
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="Final LR / peak LR (cosine, linear).")
    grad_clip: float | None = Field(default=1.0, gt=0.0, le=1e6, description="Max grad norm; None = off.")
    epochs: int = Field(default=1, ge=1, le=1000, description="Passes over the training rows.")
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000, description="Stop after this many steps.")
    grad_accumulation: int = Field(default=1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    micro_batch_size: int = Field(default=1, ge=1, le=256, description="Packed rows per micro-batch.")
    pack_length: int = Field(
        default=2048, ge=16, le=131072, description="Tokens per packed row (conversations are packed into it)."
    )
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seed for data order, COD sampling, init.")
    layer_lr_scale: float = Field(
        default=1.0,
        gt=0.0,
        le=10.0,
        description="Multiplies the learning rate of the draft's decoder layers (which `draft.layer_init` target "
        "starts as the target's last layers); fc, mask_hidden, the embedding, lm_head and the final norm keep "
        "`lr`. The same schedule scales both. Measured at two layers (docs/decisions.md decision 26): 0.1 lost "
        "acceptance, 3 gained it.",
    )
    ema_decay: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="beta of an exponential moving average of the draft's weights, kept beside the trained "
        "ones (step s uses min(beta, (1 + s) / (10 + s))). Held-out metrics, live AL, the best checkpoint "
        "and the export use the average; training metrics are the trained weights'. 0 = off.",
    )


class CheckpointSpec(_Strict):
    """Checkpointing and best-checkpoint selection."""

    every_steps: int = Field(default=500, ge=1, le=10_000_000, description="Save every this many steps.")
    keep_last: int = Field(default=2, ge=1, le=1000, description="Keep the newest N checkpoints (plus best).")
    select_best_by: Literal["auto", "tau_sim", "acceptance_length", "loss"] = Field(
        default="auto",
        description="Metric that picks the best checkpoint (acceptance, not loss, is what users get); auto = "
        "acceptance_length (measured AL, every prompt of the first eval prompt set at each checkpoint) when "
        "eval.prompt_sets is not empty, else tau_sim.",
    )


class PromptSet(_Strict):
    """A set of prompts for acceptance-length measurement."""

    name: str = Field(
        min_length=1,
        max_length=1024,
        description="`humaneval`, `sharegpt-heldout`, `heldout` (this job's own held-out conversations, "
        "data.eval_samples, each up to its first answer: where the draft meets the user's own traffic), "
        "`dataset:<id>` (an uploaded dataset: each conversation up to its first answer), or a path to a JSONL "
        "file of prompts (not through the API).",
    )
    num_prompts: int = Field(default=40, ge=1, le=100_000, description="First N prompts of the set.")


class EvalSpec(_Strict):
    """Evaluation: tau_sim on held-out rows and measured acceptance length."""

    prompt_sets: list[PromptSet] = Field(
        default_factory=lambda: [PromptSet(name="humaneval", num_prompts=40)],
        max_length=16,
        description="Prompt sets for measured acceptance length (empty = skip).",
    )
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, le=32, description="K at evaluation/serve time; default = peagle.num_depths."
    )
    max_new_tokens: int = Field(default=128, ge=1, le=32768, description="Tokens generated per prompt.")
    every_steps: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Held-out tau_sim every N steps; None = at checkpoints."
    )
    al_every_steps: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description="Also measure AL during training every N steps (a live series next to tau_sim; the "
        "reference decoder on the first `al_num_prompts` prompts of the first prompt set); None = only at "
        "checkpoints and after training.",
    )
    al_num_prompts: int = Field(
        default=4, ge=1, le=100_000,
        description="Prompts of the first prompt set for the AL measured during training (periodic and at "
        "checkpoints); the whole set when checkpoints.select_best_by is (or resolves to) acceptance_length.",
    )
    engine: Literal["auto", "reference", "vllm"] = Field(
        default="auto",
        description="Decoder measuring AL: pure-PyTorch reference (needs the target in the trainer process) or "
        "a real vLLM; auto = vllm when the resolved target engine is vllm, else reference.",
    )
    serve_check: bool = Field(default=False, description="Load the export in vLLM (if installed) after training.")
    speedup: bool = Field(
        default=True,
        description="After training, when vLLM evaluates (eval.engine vllm, or the serve check): time the "
        "verifier alone and with the draft, interleaved, at batch 1, `speedup_num_prompts` and "
        "`speedup_batch_sizes`, for K = 1..eval.num_speculative_tokens "
        "(`speedup_sweep`); stored on the best checkpoint with the hardware and the best K per batch size. "
        "One engine start per K.",
    )
    speedup_num_prompts: int = Field(
        default=8, ge=1, le=1024,
        description="Prompts of the first prompt set the speedup is timed on (also the 'batch of all prompts').",
    )
    speedup_batch_sizes: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=list, max_length=8,
        description="Batch sizes to time besides 1 and speedup_num_prompts (the prompts are cycled to fill them).",
    )
    speedup_rounds: int = Field(
        default=3, ge=1, le=50, description="Interleaved rounds per (K, batch size); the speedup is their median."
    )
    speedup_sweep: bool = Field(
        default=True,
        description="Time every K from 1 to eval.num_speculative_tokens (one engine start each) and recommend the "
        "best per batch size; false = the trained K only.",
    )


class PreviewSpec(_Strict):
    """A first training curve within minutes: a short run on the first conversations before the main run."""

    conversations: int = Field(
        default=0, ge=0, le=1_000_000,
        description="Before the main run, prepare (regenerated answers go to the shared cache, so the main run "
        "reuses them), capture and train a draft of its own on the first N conversations of the data, into "
        "RUN/preview; its metrics are `preview_*` (a curve of their own on the job page). 0 = no preview "
        "(docs/decisions.md decision 33).",
    )
    steps: int = Field(
        default=40, ge=1, le=1000,
        description="Optimizer steps of the preview (the passes over its rows repeat until they are done).",
    )


class TrainSpec(_Strict):
    """A P-EAGLE draft-training job."""

    spec_version: Literal[1] = Field(default=1, description="Version of this schema.")
    name: str | None = Field(default=None, max_length=200, description="Human-readable job name.")
    tags: list[Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:/-]+$")]] = Field(
        default_factory=list, max_length=32, description="Labels for filtering."
    )
    target: TargetSpec = Field(description="Target model.")
    data: DataSpec = Field(
        default_factory=lambda: DataSpec(sources=[DataSource(path="builtin:sharegpt")]),
        description="Training data.",
    )
    draft: DraftSpec = Field(default_factory=DraftSpec, description="Draft network.")
    peagle: PEagleSpec = Field(default_factory=PEagleSpec, description="P-EAGLE knobs.")
    optim: OptimSpec = Field(default_factory=OptimSpec, description="Optimisation.")
    checkpoints: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Evaluation.")
    resources: ResourceSpec = Field(default_factory=ResourceSpec, description="Resources.")
    preview: PreviewSpec = Field(default_factory=PreviewSpec, description="A first curve on a first slice.")

    @model_validator(mode="after")
    def _cross_fields(self) -> TrainSpec:
        from peagle.spec.checks import cross_field_problems

        problems = cross_field_problems(self)
        if problems:
            raise PydanticCustomError(
                "spec_cross_field",
                "; ".join(f"{'.'.join(map(str, p.loc))}: {p.message}" for p in problems),
                {"problems": [{"loc": list(p.loc), "message": p.message} for p in problems]},
            )
        return self

    def resolve(
        self,
        *,
        cuda_available: bool,
        target_num_layers: int | None = None,
        mask_token_id: int | None = None,
        draft_vocab_size: int | None = None,
        max_steps: int | None = None,
        vllm_available: bool | None = None,
        device_facts: DeviceFacts | None = None,
    ) -> TrainSpec:
        """This spec with every derived value filled in: the one place "auto" is decided.

        See `peagle.spec.resolve` for the table of what each "auto" becomes and the facts it needs.
        """
        from peagle.spec.resolve import resolve_spec

        return resolve_spec(self, cuda_available=cuda_available, target_num_layers=target_num_layers,
                            mask_token_id=mask_token_id, draft_vocab_size=draft_vocab_size, max_steps=max_steps,
                            vllm_available=vllm_available, device_facts=device_facts)


# --------------------------------------------------------------------------------------------------
# Problems (the cross-field checks themselves are `peagle.spec.checks`)
# --------------------------------------------------------------------------------------------------


class SpecProblem(BaseModel):
    """One problem in a job spec: where (`loc`, a path of keys/indices) and why."""

    model_config = ConfigDict(frozen=True)

    loc: tuple[str | int, ...]
    message: str

    @property
    def path(self) -> str:
        """Dotted path, e.g. `peagle.num_depths` or `data.sources.0.path`."""
        return ".".join(str(x) for x in self.loc)

    @property
    def pointer(self) -> str:
        """JSON pointer, e.g. `/peagle/num_depths`."""
        return "/" + "/".join(str(x).replace("~", "~0").replace("/", "~1") for x in self.loc)


# --------------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------------


def spec_hash(spec: TrainSpec, *, sections: tuple[str, ...] | None = None) -> str:
    """Stable sha256 of the spec (or of some sections), for caches keyed by what produced them."""
    data = spec.model_dump(mode="json")
    if sections is not None:
        data = {k: data[k] for k in sections}
    blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def dataset_ref(dataset_id: str) -> str:
    """The data source path of an uploaded dataset: `dataset:<id>`."""
    return f"{DATASET_PREFIX}{dataset_id}"


def dataset_id(path: str) -> str | None:
    """The dataset id of a `dataset:<id>` source path; None for any other path."""
    return path[len(DATASET_PREFIX):] if path.startswith(DATASET_PREFIX) else None
