"""Metric keys: the one definition of the names the trainer writes and the service stores and shows.

The trainer (`peagle.cod.loss`, `peagle.train.loop`, `peagle.pipeline`) produces them, the worker
(`worker.progress`) files them into the database, the API ranks checkpoints by them and serves their
patterns to the dashboard (`GET /v1/meta`). Torch-free.

    acc_key(0) == "acc_0"; eval_key("loss") == "eval_loss"; al_pos_key(2) == "al_pos_2"
    preview_key("loss") == "preview_loss"

The preview's training metrics (`peagle.preview`: a short run on the first conversations before the main
run) carry `PREVIEW_PREFIX`: stored and streamed like every metric, but a series of their own (their steps
start again at 1), never a checkpoint's rank nor a point of the main curve.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ACCEPTANCE_LENGTH",
    "ACC_PREFIX",
    "AL_POS_PREFIX",
    "EVAL_PREFIX",
    "FULL_ACC",
    "LOSS",
    "PER_POSITION",
    "PREVIEW_PREFIX",
    "REGEN_CONVERSATIONS",
    "REGEN_CONVERSATIONS_TOTAL",
    "REGEN_SECONDS_REMAINING",
    "REGEN_TOKENS",
    "REGEN_TOKENS_PER_S",
    "TAU_SIM",
    "TOKENS_PER_S",
    "VLLM_ACCEPTANCE_LENGTH",
    "acc_key",
    "al_pos_key",
    "al_pos_values",
    "eval_key",
    "is_eval_key",
    "is_measured_al_key",
    "is_preview_key",
    "key_patterns",
    "preview_key",
    "preview_values",
]

LOSS = "loss"
FULL_ACC = "full_acc"
#: Simulated accepted draft tokens per step (sum over k of prod_{j<=k} acc_j); 1 + tau_sim overstates the
#: measured AL (docs/decisions.md decision 11).
TAU_SIM = "tau_sim"
#: Training throughput of a step: non-padding tokens per wall-clock second.
TOKENS_PER_S = "tokens_per_s"
#: Measured acceptance length (reference decoder on the eval prompts).
ACCEPTANCE_LENGTH = "acceptance_length"
#: Acceptance length measured by a real vLLM engine on the export (the serve check).
VLLM_ACCEPTANCE_LENGTH = "vllm_acceptance_length"
#: Depth-d accuracy: `acc_{d}`.
ACC_PREFIX = "acc_"
#: Held-out versions of the training metrics: `eval_{key}`.
EVAL_PREFIX = "eval_"
#: The preview's training metrics: `preview_{key}` (module docstring).
PREVIEW_PREFIX = "preview_"
#: Measured acceptance rate at draft position k: `al_pos_{k}`.
AL_POS_PREFIX = "al_pos_"
#: The list of per-position acceptance rates in an eval record (spread into `al_pos_{k}` keys).
PER_POSITION = "per_position"

# Regeneration progress (peagle.data.regenerate): fields of a `progress` event with `phase: regenerating`,
# which also carries `step` / `total_steps` = conversations generated / those needing generation (cached ones
# are done before the engine starts), so a generic progress bar counts only the remaining work.
#: Conversations done (cached ones included) and their total.
REGEN_CONVERSATIONS = "regen_conversations"
REGEN_CONVERSATIONS_TOTAL = "regen_conversations_total"
#: Tokens the engine generated so far in this run, and per second since it started answering.
REGEN_TOKENS = "regen_tokens"
REGEN_TOKENS_PER_S = "regen_tokens_per_s"
#: Smoothed ETA (`peagle.progress.smoothed_eta`) over the answers left; None until 3 answers came back.
REGEN_SECONDS_REMAINING = "regen_seconds_remaining"


def acc_key(depth: int) -> str:
    """`acc_{depth}`."""
    return f"{ACC_PREFIX}{depth}"


def eval_key(key: str) -> str:
    """`eval_{key}`: the held-out value of a training metric."""
    return f"{EVAL_PREFIX}{key}"


def al_pos_key(position: int) -> str:
    """`al_pos_{position}`."""
    return f"{AL_POS_PREFIX}{position}"


def al_pos_values(per_position: Iterable[Any]) -> dict[str, Any]:
    """`{al_pos_0: v0, al_pos_1: v1, ...}` of a per-position list."""
    return {al_pos_key(k): v for k, v in enumerate(per_position)}


def preview_key(key: str) -> str:
    """`preview_{key}`: a training metric of the preview run."""
    return f"{PREVIEW_PREFIX}{key}"


def is_preview_key(key: str) -> bool:
    """A metric of the preview run (`preview_*`)."""
    return key.startswith(PREVIEW_PREFIX)


def preview_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """A preview step's metric record: every key as `preview_key(key)`."""
    return {preview_key(k): v for k, v in values.items()}


def is_eval_key(key: str) -> bool:
    """Measured on held-out data or by decoding (drawn unsmoothed): `eval_*` and `acceptance_length`."""
    return key.startswith(EVAL_PREFIX) or key == ACCEPTANCE_LENGTH


def is_measured_al_key(key: str) -> bool:
    """The measured acceptance length (reference decoder or vLLM) or one of its per-position rates."""
    return key in (ACCEPTANCE_LENGTH, VLLM_ACCEPTANCE_LENGTH) or key.startswith(AL_POS_PREFIX)


def key_patterns() -> Mapping[str, str]:
    """The named keys and prefixes, as the API serves them to the dashboard."""
    return {"loss": LOSS, "full_acc": FULL_ACC, "tau_sim": TAU_SIM, "acceptance_length": ACCEPTANCE_LENGTH,
            "acc_prefix": ACC_PREFIX, "eval_prefix": EVAL_PREFIX, "al_pos_prefix": AL_POS_PREFIX,
            "preview_prefix": PREVIEW_PREFIX}
