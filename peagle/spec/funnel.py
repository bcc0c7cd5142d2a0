"""The data funnel: how many conversations were read, kept, dropped (and why), held out, packed, tokens.

One definition of the keys and one function that builds the funnel, so the job's data report
(`peagle.data.prepare`), the dataset validator (`peagle.data.formats.validate_dataset`) and the dry-run
estimate (`api.estimate`) report the same numbers under the same names (docs/service.md 8). Torch-free.

Invariant (by construction): ``read == kept + dropped`` and ``dropped == sum(dropped_by_reason.values())``;
a difference the caller cannot explain is filed under `UNACCOUNTED` (tests assert it never appears).

    >>> f = funnel(read=10, kept=8, dropped_by_reason={"no_assistant_turn": 2}, held_out=1)
    >>> f["dropped"], f["train_conversations"]
    (2, 7)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "DROPPED",
    "DROPPED_BY_REASON",
    "ESTIMATED",
    "FUNNEL_KEYS",
    "HELD_OUT",
    "KEPT",
    "PACKED_ROWS",
    "READ",
    "REASONS",
    "SOURCE_SKIP",
    "TOKEN_OUT_OF_RANGE",
    "TOO_FEW_ASSISTANT_TOKENS",
    "TOO_LONG",
    "TRAIN_CONVERSATIONS",
    "TRAIN_TOKENS",
    "TRUNCATED",
    "UNACCOUNTED",
    "funnel",
]

READ = "read"
KEPT = "kept"
DROPPED = "dropped"
DROPPED_BY_REASON = "dropped_by_reason"
HELD_OUT = "held_out"
TRAIN_CONVERSATIONS = "train_conversations"
PACKED_ROWS = "packed_rows"
TRAIN_TOKENS = "train_tokens"
#: Kept conversations cut at `data.max_length` (not a drop: they train on their first max_length tokens).
TRUNCATED = "truncated"
#: Whether the numbers are an estimate (dry run) or counted (job report, dataset validator).
ESTIMATED = "estimated"

FUNNEL_KEYS = (READ, KEPT, DROPPED, DROPPED_BY_REASON, HELD_OUT, TRAIN_CONVERSATIONS, PACKED_ROWS, TRAIN_TOKENS,
               TRUNCATED, ESTIMATED)

# Drop reasons decided after templating (peagle.data.prepare); the ingestion reasons are
# peagle.data.formats' skip keys (empty_conversation, no_assistant_turn, invalid_json, ...).
SOURCE_SKIP = "source_skip"
TOO_LONG = "too_long_no_assistant_left"
TOO_FEW_ASSISTANT_TOKENS = "too_few_assistant_tokens"
TOKEN_OUT_OF_RANGE = "token_out_of_range"
UNACCOUNTED = "unaccounted"

#: Every reason a conversation can be dropped for, with the sentence the dashboard and logs show.
REASONS: Mapping[str, str] = {
    "empty_conversation": "the conversation has no turns",
    "no_assistant_turn": "no non-empty assistant turn after a prompt",
    "missing_field": "no conversations/messages/input_ids field",
    "wrong_type": "a field has the wrong type",
    "invalid_json": "the line is not valid JSON",
    "invalid_utf8": "invalid UTF-8 or lone surrogates",
    "too_deep": "JSON nested too deeply",
    "row_too_large": "the row exceeds the size or turn limit",
    "length_mismatch": "input_ids and loss_mask differ in length",
    SOURCE_SKIP: "skipped by data.sources[].skip",
    TOO_LONG: "cut at data.max_length before any assistant token",
    TOO_FEW_ASSISTANT_TOKENS: "fewer supervised tokens than data.min_assistant_tokens",
    TOKEN_OUT_OF_RANGE: "a token id beyond the target's vocabulary",
    UNACCOUNTED: "not explained (a bug: please report it)",
}


def funnel(
    *,
    read: int,
    kept: int,
    dropped_by_reason: Mapping[str, int],
    held_out: int = 0,
    packed_rows: int | None = None,
    train_tokens: int | None = None,
    truncated: int | None = None,
    estimated: bool = False,
) -> dict[str, Any]:
    """The funnel of one data pass: read -> kept (+ dropped by reason) -> held out -> packed rows -> tokens.

    Args:
        read: conversations (rows) read from the sources.
        kept: conversations that survived every check.
        dropped_by_reason: reason key (`REASONS`) -> count; zero counts are left out.
        held_out: kept conversations held out for evaluation (`data.eval_samples`).
        packed_rows: training rows after packing (None: not known, e.g. the dataset validator).
        train_tokens: tokens in the training rows (None: not known).
        truncated: kept conversations cut at `data.max_length` (None: not known).
        estimated: True for the dry run's estimate.
    """
    reasons = {k: int(v) for k, v in sorted(dropped_by_reason.items()) if int(v) > 0}
    gap = int(read) - int(kept) - sum(reasons.values())
    if gap:
        reasons[UNACCOUNTED] = reasons.get(UNACCOUNTED, 0) + gap
    held = min(int(held_out), int(kept))
    return {
        READ: int(read),
        KEPT: int(kept),
        DROPPED: int(read) - int(kept),
        DROPPED_BY_REASON: reasons,
        HELD_OUT: held,
        TRAIN_CONVERSATIONS: int(kept) - held,
        PACKED_ROWS: packed_rows,
        TRAIN_TOKENS: train_tokens,
        TRUNCATED: truncated,
        ESTIMATED: estimated,
    }
