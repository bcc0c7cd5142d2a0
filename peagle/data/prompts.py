"""Prompts for measuring acceptance, read from a conversation dataset.

A conversation's prompt is what a server would be sent for its first answer: the turns before the first
assistant turn, through the target's chat template with the generation prompt. A pre-tokenised row's
prompt is its tokens before the first supervised token. Rows with no turn before an answer, or no answer,
are passed over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.data.formats import IngestReport, iter_rows
from peagle.data.template import generation_prompt_ids
from peagle.errors import DataInvalidError
from peagle.spec import BUILTIN_PROMPT_SETS, DATASET_PREFIX, HELDOUT_PROMPT_SET, TrainSpec

__all__ = ["PromptSources", "dataset_prompts", "prompt_ids", "prompt_set_ids"]


def dataset_prompts(path: str | Path, tokenizer: Any, num_prompts: int, *, format: str = "auto"
                    ) -> list[list[int]]:
    """The first `num_prompts` prompts (token ids) of the dataset file at `path` (module docstring).

    Raises:
        DataInvalidError: the file is missing, too large or malformed (`peagle.data.formats.iter_rows`), or
            it holds no row with a prompt.
    """
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


@dataclass(frozen=True)
class PromptSources:
    """What a job's prompt sets resolve against besides the builtin sets and files.

    Attributes:
        heldout: the job's held-out conversations up to their first answer
            (`peagle.data.packing.document_prompts` of the prepared eval rows): the `heldout` set.
        dataset_root: where uploaded datasets (`dataset:<id>` sets) live.
    """

    heldout: list[list[int]] = field(default_factory=list)
    dataset_root: Path | None = None


def prompt_ids(spec: TrainSpec, tok: Any, sources: PromptSources | None = None, *, first_only: bool = False
               ) -> list[tuple[str, list[list[int]]]]:
    """(name, chat-templated token ids) of every `eval.prompt_sets` entry, in order (`prompt_set_ids`); only
    the first one's with `first_only` (what the AL during training and the serve check measure).

    Raises:
        DataInvalidError: a set that cannot be read (the message names its `eval.prompt_sets` entry).
    """
    out: list[tuple[str, list[list[int]]]] = []
    for i, ps in enumerate(spec.eval.prompt_sets[:1] if first_only else spec.eval.prompt_sets):
        try:
            out.append((ps.name, prompt_set_ids(ps.name, ps.num_prompts, tok, sources)))
        except DataInvalidError as exc:
            raise DataInvalidError(f"eval.prompt_sets.{i}.name: {exc}") from None
    return out


def prompt_set_ids(name: str, num_prompts: int, tok: Any, sources: PromptSources | None = None) -> list[list[int]]:
    """The first `num_prompts` prompts (token ids, chat template and generation prompt included) of set `name`:
    `heldout` (`sources.heldout`), a builtin set, an uploaded dataset or any conversation dataset file
    (`peagle.data.prompts`: each conversation up to its first answer), or a JSONL of `{"prompt": ...}`.

    Raises:
        DataInvalidError: `heldout` without held-out conversations; a set that cannot be read or holds no prompt.
    """
    from peagle.builtin import resolve_data_path
    from peagle.eval.reference import load_prompts, tokenize_prompts

    src = sources or PromptSources()
    if name == HELDOUT_PROMPT_SET:
        if not src.heldout:
            raise DataInvalidError("'heldout' needs held-out conversations with an answer (data.eval_samples); "
                                   "this run has none")
        return [list(p) for p in src.heldout[:num_prompts]]
    if name in BUILTIN_PROMPT_SETS or not _conversation_file(name):
        return tokenize_prompts(tok, load_prompts(name, num_prompts))
    try:
        path = resolve_data_path(name, src.dataset_root)
    except ValueError as exc:
        raise DataInvalidError(f"{name}: {exc}") from None
    return dataset_prompts(path, tok, num_prompts)


def _conversation_file(name: str) -> bool:
    """Whether prompt set `name` is read as a conversation dataset (`peagle.data.prompts`): an uploaded
    dataset (`dataset:<id>`: the worker hands the trainer its file), or a file whose first record has no
    `prompt` key (JSON arrays, ShareGPT, messages, tokenised rows); a JSONL of `{"prompt": ...}` records
    is read by `load_prompts`."""
    if name.startswith(DATASET_PREFIX):
        return True
    path = Path(name).expanduser()
    if not path.is_file():
        return False  # load_prompts names the problem
    with path.open(encoding="utf-8", errors="replace") as fh:
        head = fh.read(1 << 16).lstrip()
    if head.startswith("["):
        return True
    try:
        first = json.loads(head.splitlines()[0]) if head else None
    except json.JSONDecodeError:
        return False
    return not (isinstance(first, dict) and "prompt" in first)
