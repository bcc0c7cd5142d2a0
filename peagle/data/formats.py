"""Streaming ingestion of chat datasets (torch-free: the API's dataset upload runs it in a subprocess).

Containers: a top-level JSON array (ShareGPT's 125 MB file; parsed element by element with
`json.JSONDecoder.raw_decode` over chunks, never loaded whole) or JSON lines. Schemas:

- ``sharegpt``: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``
- ``messages``: ``{"messages": [{"role": "user", "content": "..."}, ...]}``; an OpenAI chat-completions
  request body (``{"model": ..., "messages": [...], "temperature": ...}``) is one: only ``messages`` is read
- ``tokenized``: ``{"input_ids": [...], "loss_mask": [...]}`` (pre-tokenised, used as is)
- ``prompt``: a prompt list, ``{"prompt": "..."}`` per row (other fields ignored, as in an OpenAI
  completions request body) or a bare JSON string per row; each becomes one user turn

**Prompts-only rows.** A chat row with no non-empty assistant turn whose last turn is a non-empty user turn
(a request body, a prompt) has no answer to train on. It is kept only when the caller asks
(``keep_prompts_only``: the job regenerates, so the target writes the answer, `peagle.data.regenerate`);
otherwise it is skipped as `no_assistant_turn`. Either way it is counted in `IngestReport.prompts_only`.

Every row is either kept (yielded as a `Row`) or skipped with a reason in the `IngestReport`
(counts per reason + the first `MAX_BAD_ROWS` rows with their line number and index). A file that cannot
be read at all (not found, too large, truncated/malformed JSON container) raises `DataInvalidError` naming
the line. Roles: human/user -> user; gpt/assistant/chatgpt/bard/bing/model -> assistant; system; tool/
function/ipython -> tool; developer (OpenAI's newer name) -> system; anything else -> assistant (as speculators does; counted in `unknown_roles`).

Run as ``python -m peagle.data.formats PATH [--format F] [--tokenizer DIR]`` to print `validate_dataset`'s
report as JSON (exit 0 if usable, 4 otherwise).
"""

from __future__ import annotations

import codecs
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle.errors import DataInvalidError
from peagle.spec.funnel import NO_ASSISTANT_TURN, funnel

__all__ = [
    "MAX_BAD_ROWS",
    "SCHEMAS",
    "IngestReport",
    "Limits",
    "Row",
    "detect_format",
    "iter_rows",
    "normalise_role",
    "validate_dataset",
]

MAX_BAD_ROWS = 100
#: The row schemas (`format` values besides ``auto``).
SCHEMAS = ("sharegpt", "messages", "tokenized", "prompt")
_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}


@dataclass(frozen=True)
class Limits:
    """Size limits; a file beyond `max_file_bytes` is refused, a row beyond the others is skipped."""

    max_file_bytes: int = 16 * 1024**3
    max_row_bytes: int = 64 * 1024**2
    max_turns: int = 4096


@dataclass
class Row:
    """One kept row: `messages` (normalised {role, content}) or `input_ids` + `loss_mask`."""

    index: int  # 0-based position in the file (array element or line)
    line: int  # 1-based line where the row starts
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    source: int = 0  # index of the DataSource it came from
    prompt_only: bool = False  # no answer, ends with a user turn (kept only with keep_prompts_only)


@dataclass
class IngestReport:
    """Counts of one ingestion: read / kept / skipped by reason, and where the bad rows are."""

    path: str = ""
    format: str = ""  # sharegpt | messages | tokenized | prompt
    container: str = ""  # array (one JSON array) | jsonl
    rows_read: int = 0
    rows_kept: int = 0
    skipped_by_reason: Counter[str] = field(default_factory=Counter)
    bad_rows: list[dict[str, Any]] = field(default_factory=list)
    unknown_roles: Counter[str] = field(default_factory=Counter)
    #: Prompts-only rows met (module docstring): kept with `keep_prompts_only`, else among the skipped.
    prompts_only: int = 0

    @property
    def rows_skipped(self) -> int:
        return sum(self.skipped_by_reason.values())

    def skip(self, index: int, line: int, reason: str, detail: str = "", *, bad: bool = True) -> None:
        """Record a skipped row (reason is a short snake_case key, detail free text); `bad` False counts it
        without listing it in `bad_rows` (a prompts-only row is not malformed: it only lacks an answer)."""
        self.skipped_by_reason[reason] += 1
        if bad and len(self.bad_rows) < MAX_BAD_ROWS:
            self.bad_rows.append({"line": line, "index": index, "reason": reason, "detail": detail[:300]})

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "container": self.container,
            "rows_read": self.rows_read,
            "rows_kept": self.rows_kept,
            "rows_skipped": self.rows_skipped,
            "skipped_by_reason": dict(sorted(self.skipped_by_reason.items())),
            "bad_rows": list(self.bad_rows),
            "unknown_roles": dict(self.unknown_roles),
            "prompts_only": self.prompts_only,
        }


def normalise_role(role: str) -> tuple[str, bool]:
    """Map a dataset role name onto user/assistant/system/tool; returns (role, known)."""
    key = role.strip().lower()
    if key in _ROLE_MAP:
        return _ROLE_MAP[key], True
    return "assistant", False


# ---------------------------------------------------------------------------------------------------
# Containers: raw JSON values with their (index, line)
# ---------------------------------------------------------------------------------------------------


def _first_char(path: Path) -> str:
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return chr(head[0]) if head else ""


def _lines(fh: Any, cap: int) -> Iterator[tuple[bytes, int]]:
    """(first `cap` + 1 bytes of each line, its full length): an endless line never sits in memory."""
    while raw := fh.readline(cap + 1):
        size, tail = len(raw), raw
        if size > cap:  # skip the rest of the line; yield its head (an over-long last line has no "\n")
            while not tail.endswith(b"\n") and (tail := fh.readline(1 << 20)):
                size += len(tail)
        yield raw, size


def _iter_jsonl(path: Path, report: IngestReport, limits: Limits) -> Iterator[tuple[int, int, Any]]:
    with path.open("rb") as fh:
        index = -1
        for lineno, (raw, size) in enumerate(_lines(fh, limits.max_row_bytes), start=1):
            if not raw.strip():
                continue
            index += 1
            report.rows_read += 1
            if size > limits.max_row_bytes:
                report.skip(index, lineno, "row_too_large", f"{size} bytes > {limits.max_row_bytes}")
                continue
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                report.skip(index, lineno, "invalid_utf8", str(exc))
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                report.skip(index, lineno, "invalid_json", str(exc))
                continue
            except RecursionError:
                report.skip(index, lineno, "too_deep", "JSON nested too deeply")
                continue
            yield index, lineno, value


def _iter_json_array(
    path: Path, report: IngestReport, limits: Limits, chunk_size: int = 1 << 20
) -> Iterator[tuple[int, int, Any]]:
    """Yield the elements of a top-level JSON array one by one (streaming, bounded memory)."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf = ""
    pos = 0
    mark, mark_line = 0, 1  # buf[mark] is on line mark_line (counted incrementally: O(file), not O(n^2))
    eof = False
    with path.open("rb") as fh:

        def fill() -> bool:
            nonlocal buf, pos, mark, mark_line, eof
            if eof:
                return False
            data = fh.read(chunk_size)
            eof = not data
            line_at(pos)
            mark = 0
            buf = buf[pos:] + utf8.decode(data, final=eof)
            pos = 0
            return True

        def skip_ws() -> str:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                    pos += 1
                if pos < len(buf):
                    return buf[pos]
                if not fill():
                    return ""

        def line_at(p: int) -> int:
            nonlocal mark, mark_line
            if p < mark:  # only for error messages
                return mark_line - buf.count("\n", p, mark)
            mark_line += buf.count("\n", mark, p)
            mark = p
            return mark_line

        if skip_ws() != "[":
            raise DataInvalidError(f"{path}: line {line_at(pos)}: expected a JSON array '['")
        pos += 1
        index = 0
        if skip_ws() == "]":
            return
        while True:
            if skip_ws() == "":
                raise DataInvalidError(f"{path}: line {line_at(pos)}: truncated JSON (array not closed)")
            start_line = line_at(pos)
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                except RecursionError:
                    raise DataInvalidError(
                        f"{path}: line {start_line}: element {index} is nested too deeply"
                    ) from None
                except json.JSONDecodeError as exc:
                    if eof:
                        what = "truncated JSON" if exc.pos >= len(buf) - 1 else f"malformed JSON ({exc.msg})"
                        raise DataInvalidError(
                            f"{path}: line {line_at(min(exc.pos, len(buf)))}: {what} in element "
                            f"{index} (starts at line {start_line})"
                        ) from None
                if len(buf) - pos > limits.max_row_bytes:
                    raise DataInvalidError(
                        f"{path}: line {start_line}: element {index} exceeds {limits.max_row_bytes} bytes"
                    )
                fill()
            if end - pos > limits.max_row_bytes:  # whole in the buffer, still too big (size in characters)
                raise DataInvalidError(
                    f"{path}: line {start_line}: element {index} exceeds {limits.max_row_bytes} bytes"
                )
            pos = end
            report.rows_read += 1
            yield index, start_line, value
            index += 1
            sep = skip_ws()
            if sep == ",":
                pos += 1
            elif sep == "]":
                return
            elif sep == "":
                raise DataInvalidError(f"{path}: line {line_at(pos)}: truncated JSON (array not closed)")
            else:
                raise DataInvalidError(
                    f"{path}: line {line_at(pos)}: expected ',' or ']' after element {index - 1}"
                )


# ---------------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------------


def _bad_text(s: str) -> bool:
    # lone surrogates come from invalid UTF-8 bytes (surrogateescape) or \udXXX escapes: not encodable
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI-style parts
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        texts = [p for p in parts if isinstance(p, str)]
        if len(texts) == len(parts):
            return "".join(texts)
    return None


def _schema_of(value: Any) -> str | None:
    if isinstance(value, dict):
        if "conversations" in value:
            return "sharegpt"
        if "messages" in value:
            return "messages"
        if "input_ids" in value:
            return "tokenized"
        if "prompt" in value:
            return "prompt"
    if isinstance(value, str):
        return "prompt"
    return None


def _answered(messages: list[dict[str, str]]) -> bool:
    return any(m["role"] == "assistant" and m["content"].strip() for m in messages)


def _parse_prompt(value: Any) -> tuple[list | None, str, str]:
    """A prompt-list row as one user turn: (messages, reason, detail); messages None = skip."""
    text = value.get("prompt") if isinstance(value, dict) else value
    if not isinstance(value, (dict, str)):
        return None, "wrong_type", f"row is {type(value).__name__}, expected an object or a string"
    if text is None:
        return None, "missing_field", "no 'prompt' field"
    if not isinstance(text, str):
        return None, "wrong_type", f"'prompt' is {type(text).__name__}, expected a string"
    if not text.strip():
        return None, "empty_conversation", "the prompt is empty"
    if _bad_text(text):
        return None, "invalid_utf8", "the prompt has invalid UTF-8 / lone surrogates"
    return [{"role": "user", "content": text}], "", ""


def _parse_chat(
    value: Any, schema: str, limits: Limits, report: IngestReport
) -> tuple[list | None, str, str]:
    """Return (messages, reason, detail); messages None = skip."""
    if not isinstance(value, dict):
        return None, "wrong_type", f"row is {type(value).__name__}, expected an object"
    key, rkey, ckey = (
        ("conversations", "from", "value") if schema == "sharegpt" else ("messages", "role", "content")
    )
    turns = value.get(key)
    if turns is None and schema == "sharegpt" and "messages" in value:
        key, rkey, ckey, turns = "messages", "role", "content", value["messages"]
    if turns is None:
        return None, "missing_field", f"no {key!r} field"
    if not isinstance(turns, list):
        return None, "wrong_type", f"{key!r} is {type(turns).__name__}, expected a list"
    if not turns:
        return None, "empty_conversation", f"{key!r} is empty"
    if len(turns) > limits.max_turns:
        return None, "row_too_large", f"{len(turns)} turns > {limits.max_turns}"
    out: list[dict[str, str]] = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None, "wrong_type", f"turn {t} is {type(turn).__name__}, expected an object"
        role = turn.get(rkey, turn.get("role", turn.get("from")))
        content = _text_of(turn.get(ckey, turn.get("content", turn.get("value"))))
        if not isinstance(role, str):
            return None, "wrong_type", f"turn {t}: {rkey!r} missing or not a string"
        if content is None:
            return None, "wrong_type", f"turn {t}: {ckey!r} missing or not a string"
        norm, known = normalise_role(role)
        if not known:
            report.unknown_roles[role[:40]] += 1
        reasoning = turn.get("reasoning_content", turn.get("thinking"))
        if norm == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content}"
        if _bad_text(content) or _bad_text(role):
            return None, "invalid_utf8", f"turn {t} has invalid UTF-8 / lone surrogates"
        out.append({"role": norm, "content": content})
    while out and out[0]["role"] == "assistant":  # a conversation must not open with the answer
        out.pop(0)
    if not _answered(out) and not (out and out[-1]["role"] == "user" and out[-1]["content"].strip()):
        return None, NO_ASSISTANT_TURN, "no non-empty assistant turn after a prompt"
    return out, "", ""  # (without an answer: prompts-only, `iter_rows` decides)


def _parse_tokenized(value: Any) -> tuple[list[int] | None, list[int] | None, str, str]:
    if not isinstance(value, dict):
        return None, None, "wrong_type", f"row is {type(value).__name__}, expected an object"
    ids, mask = value.get("input_ids"), value.get("loss_mask")
    if ids is None or mask is None:
        return None, None, "missing_field", "needs 'input_ids' and 'loss_mask'"
    if not isinstance(ids, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids
    ):
        return None, None, "wrong_type", "'input_ids' must be a list of non-negative ints"
    if not isinstance(mask, list) or not all(x in (0, 1) and not isinstance(x, float) for x in mask):
        return None, None, "wrong_type", "'loss_mask' must be a list of 0/1"
    if not ids:
        return None, None, "empty_conversation", "'input_ids' is empty"
    if len(ids) != len(mask):
        return None, None, "length_mismatch", f"input_ids {len(ids)} vs loss_mask {len(mask)}"
    if not any(mask):
        return None, None, NO_ASSISTANT_TURN, "loss_mask is all zero"
    return ids, [int(x) for x in mask], "", ""


def detect_format(path: str | Path) -> tuple[str, str]:
    """(container, schema) of a file from its first character and first row: container `array`|`jsonl`."""
    path = Path(path)
    first = _first_char(path)
    if not first or first not in '[{"':
        raise DataInvalidError(f"{path}: line 1: not JSON/JSONL (does not start with '[', '{{' or '\"')")
    container = "array" if first == "[" else "jsonl"
    scratch = IngestReport()
    it = (
        _iter_json_array(path, scratch, Limits())
        if container == "array"
        else _iter_jsonl(path, scratch, Limits())
    )
    for _, line, value in it:
        schema = _schema_of(value)
        if schema is None:
            raise DataInvalidError(
                f"{path}: line {line}: cannot detect the format: first row has none of "
                "'conversations', 'messages', 'input_ids', 'prompt' (nor is it a string)"
            )
        return container, schema
    if scratch.bad_rows:  # rows, none readable: say why the first one is not
        bad = scratch.bad_rows[0]
        raise DataInvalidError(f"{path}: line {bad['line']}: no readable row ({bad['reason']}: {bad['detail']})")
    raise DataInvalidError(f"{path}: no rows")


def iter_rows(
    path: str | Path,
    format: str = "auto",
    report: IngestReport | None = None,
    *,
    skip: int = 0,
    max_samples: int | None = None,
    limits: Limits | None = None,
    keep_prompts_only: bool = False,
) -> Iterator[Row]:
    """Stream the usable rows of a dataset file; skipped rows are recorded in `report`.

    Args:
        path: JSON array or JSONL file.
        format: ``auto`` | ``sharegpt`` | ``messages`` | ``tokenized`` | ``prompt``.
        report: filled in place (counts, bad rows); pass one to read it afterwards.
        skip: drop this many readable rows first (DataSource.skip); they count as read, not kept.
        max_samples: stop after this many kept rows.
        limits: size limits.
        keep_prompts_only: yield prompts-only rows (`Row.prompt_only`; module docstring) instead of skipping
            them as `no_assistant_turn`: the caller has the target write their answers.

    Raises:
        DataInvalidError: the file is missing, too large, or its container is malformed (names the line).
    """
    limits = limits or Limits()
    report = report if report is not None else IngestReport()
    path = Path(path)
    if not path.is_file():
        raise DataInvalidError(f"{path}: no such file")
    size = path.stat().st_size
    if size > limits.max_file_bytes:
        raise DataInvalidError(f"{path}: {size} bytes exceeds the limit of {limits.max_file_bytes}")
    if size == 0:
        raise DataInvalidError(f"{path}: empty file")
    container, detected = detect_format(path) if format == "auto" else (None, format)
    if container is None:
        container = "array" if _first_char(path) == "[" else "jsonl"
    if detected not in SCHEMAS:
        raise DataInvalidError(f"{path}: unknown format {detected!r} (one of {', '.join(SCHEMAS)})")
    schema = detected
    report.path, report.format, report.container = str(path), schema, container
    raw = (
        _iter_json_array(path, report, limits) if container == "array" else _iter_jsonl(path, report, limits)
    )
    skipped = 0
    for index, line, value in raw:
        if schema == "tokenized":
            ids, mask, reason, detail = _parse_tokenized(value)
            row = Row(index, line, input_ids=ids, loss_mask=mask) if ids is not None else None
        else:
            msgs, reason, detail = (_parse_prompt(value) if schema == "prompt"
                                    else _parse_chat(value, schema, limits, report))
            row = Row(index, line, messages=msgs, prompt_only=not _answered(msgs)) if msgs is not None else None
        if row is not None and row.prompt_only and not keep_prompts_only:
            report.prompts_only += 1
            report.skip(index, line, NO_ASSISTANT_TURN, bad=False)
            continue
        if row is None:
            report.skip(index, line, reason, detail)
            continue
        if skipped < skip:
            skipped += 1
            continue
        report.prompts_only += row.prompt_only
        report.rows_kept += 1
        yield row
        if max_samples is not None and report.rows_kept >= max_samples:
            return


def validate_dataset(
    path: str | Path,
    format: str = "auto",
    *,
    tokenizer_path: str | None = None,
    max_rows: int | None = None,
    max_length: int = 1 << 30,
    max_row_bytes: int | None = None,
) -> dict[str, Any]:
    """Cheap check of an uploaded dataset; never raises for bad data.

    Returns the ingestion report as a dict plus ``ok`` and ``error`` (a fatal problem naming the line);
    ``rows_kept`` counts the rows with an answer to train on, ``prompts_only`` the rows without one that end
    with a user turn (module docstring: usable when the job regenerates; filed under `no_assistant_turn` in
    the funnel, whose ``prompts_only`` says how many of its drops they are). A dataset of prompts only is
    ``ok``: whether a job can use it depends on its `data.regenerate` (the API's preflight checks);
    with `tokenizer_path` also ``tokens``, ``assistant_tokens`` and ``assistant_coverage`` (the fraction of
    tokens supervised) from the tokenizer's own chat template. With `max_row_bytes`, a bigger row makes the
    dataset unusable (``ok`` false, ``error`` naming the line) instead of being skipped.
    """
    limits = Limits(max_row_bytes=max_row_bytes) if max_row_bytes is not None else None
    report = IngestReport(path=str(path))
    out: dict[str, Any] = {"ok": False, "error": None}
    tok = None
    if tokenizer_path is not None:
        from transformers import AutoTokenizer  # only when asked: heavy import

        tok = AutoTokenizer.from_pretrained(tokenizer_path)
    tokens = supervised = 0
    try:
        for row in iter_rows(path, format, report, max_samples=max_rows, limits=limits):
            if tok is None:
                continue
            if row.input_ids is not None:
                tokens += len(row.input_ids)
                supervised += sum(row.loss_mask or [])
                continue
            from peagle.data.template import tokenize_conversation

            enc = tokenize_conversation(tok, row.messages or [], max_length=max_length)
            tokens += len(enc.input_ids)
            supervised += sum(enc.loss_mask)
    except DataInvalidError as exc:
        out["error"] = str(exc)
    out.update(report.to_dict())
    out["rows_skipped"] = report.rows_skipped
    if tok is not None:
        out.update(tokens=tokens, assistant_tokens=supervised, assistant_coverage=supervised / max(tokens, 1))
    big = next((b for b in report.bad_rows if b["reason"] == "row_too_large"), None)
    if out["error"] is None and limits is not None and report.skipped_by_reason["row_too_large"]:
        where = f"line {big['line']}" if big else "a row"
        out["error"] = f"{path}: {where}: row exceeds the limit of {limits.max_row_bytes} bytes per row"
    out["funnel"] = funnel(read=report.rows_read, kept=report.rows_kept, dropped_by_reason=report.skipped_by_reason,
                           train_tokens=tokens if tok is not None else None, prompts_only=report.prompts_only)
    usable = report.rows_kept + report.prompts_only
    out["ok"] = out["error"] is None and usable > 0
    if out["error"] is None and usable == 0:
        out["error"] = f"{path}: no usable row ({report.rows_read} read, all skipped)"
    return out


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m peagle.data.formats", description=validate_dataset.__doc__)
    ap.add_argument("path")
    ap.add_argument("--format", default="auto", choices=["auto", *SCHEMAS])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-rows", type=int, default=None)
    ap.add_argument("--max-row-bytes", type=int, default=None, help="a bigger row makes the dataset invalid")
    args = ap.parse_args(argv)
    rep = validate_dataset(args.path, args.format, tokenizer_path=args.tokenizer, max_rows=args.max_rows,
                           max_row_bytes=args.max_row_bytes)
    sys.stdout.write(json.dumps(rep) + "\n")
    return 0 if rep["ok"] else 4


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
