"""Prompts for measuring acceptance, read from a conversation dataset.

A conversation's prompt is what a server would be sent for its first answer: the turns before the first
assistant turn, through the target's chat template with the generation prompt. A pre-tokenised row's
prompt is its tokens before the first supervised token. Rows with no turn before an answer, or no answer,
are passed over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peagle.data.formats import IngestReport, iter_rows
from peagle.data.template import generation_prompt_ids

__all__ = ["dataset_prompts"]


def dataset_prompts(path: str | Path, tokenizer: Any, num_prompts: int, *, format: str = "auto"
                    ) -> list[list[int]]:
    """The first `num_prompts` prompts (token ids) of the dataset file at `path` (module docstring).

    Raises:
        DataInvalidError: the file is missing, too large or malformed (`peagle.data.formats.iter_rows`), or
            it holds no row with a prompt.
    """
    from peagle.errors import DataInvalidError

    out: list[list[int]] = []
    report = IngestReport()
    for row in iter_rows(path, format, report):
        if len(out) >= num_prompts:
            break
        if row.messages is not None:
            first = next((i for i, m in enumerate(row.messages) if m["role"] == "assistant"), None)
            turns = row.messages[:first] if first is not None else row.messages
            if turns and turns[-1]["role"] == "user":
                out.append(generation_prompt_ids(tokenizer, turns))
        elif row.input_ids is not None and row.loss_mask is not None:
            start = next((i for i, m in enumerate(row.loss_mask) if m), None)
            if start:
                out.append([int(t) for t in row.input_ids[:start]])
    if not out:
        raise DataInvalidError(f"no prompt in the dataset ({report.to_dict().get('rows_kept', 0)} usable rows): "
                               "a prompt is the turns before a conversation's first answer, ending with a user turn")
    return out
