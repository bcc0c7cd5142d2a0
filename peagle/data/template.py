"""Chat templating with the target's own template and assistant-only loss masks (torch-free).

Render-boundary method (docs/algorithm.md 1.2, speculators HEAD), one row per conversation: for each
assistant turn j, the supervised text starts where ``render(conv[:j], add_generation_prompt=True)`` ends
(or at the common prefix with ``render(conv[:j+1])`` when the generation prompt diverges, e.g. a
pre-filled ``<think>``) and ends where ``render(conv[:j+1])`` ends, minus trailing whitespace (so the
end-of-turn token such as ``<|im_end|>`` is supervised but the newline the template adds after it is not).
The full conversation is rendered and tokenised once; a token is supervised when its first character lies
in an assistant span. Worked example (SmolLM2)::

    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n
    mask 0 ..................................................................... 1 .... 1 ........ 0

`<think>` traces (`DataSpec.think`): ``keep`` = supervised like any assistant text; ``mask`` = in the row
but not supervised; ``drop`` = removed from the assistant content before rendering.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Encoded", "drop_think", "generation_prompt_ids", "render", "tokenize_conversation", "tokenize_many"]

_THINK = re.compile(r"<think>.*?(?:</think>\s*|$)", re.DOTALL)


@dataclass
class Encoded:
    """One tokenised conversation: ids and assistant mask (same length), before any shift."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


def drop_think(text: str) -> str:
    """Remove ``<think>...</think>`` blocks (and the whitespace after them) from assistant text."""
    return _THINK.sub("", text)


def render(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
    """The target tokenizer's own chat template, as text."""
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return out if isinstance(out, str) else str(out)


def generation_prompt_ids(tokenizer: Any, turns: list[dict[str, str]]) -> list[int]:
    """`turns` through the tokenizer's chat template with the generation prompt (what a server is sent for
    the next answer), as token ids; a tokenizer without a chat template gets the turns' text as it is."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer("".join(m["content"] for m in turns))["input_ids"]
    return [int(i) for i in ids]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], *, full: str | None = None, limit: int | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The full render and the [start, end) character spans of the assistant turns (render boundary).

    `limit` (a character offset) stops at the first assistant turn starting at or after it (truncation).
    """
    full = render(tokenizer, messages) if full is None else full
    spans: list[tuple[int, int]] = []
    for j, msg in enumerate(messages):
        if msg["role"] != "assistant" or j == 0:
            continue
        prompt = render(tokenizer, messages[:j], add_generation_prompt=True)
        upto = render(tokenizer, messages[: j + 1])
        start = len(prompt) if upto.startswith(prompt) else _common_prefix(prompt, upto)
        if limit is not None and start >= limit:
            break
        end = len(upto.rstrip())
        if not full.startswith(upto[:end]):  # template renders turns depending on later ones: fall back
            end = min(end, _common_prefix(full, upto))
        if end > start:
            spans.append((start, end))
    return full, spans


def _think_spans(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in spans:
        out.extend((s + m.start(), s + m.end()) for m in _THINK.finditer(text[s:e]))
    return out


def _mark(mask: list[int], starts: list[int], spans: list[tuple[int, int]], value: int) -> None:
    """Set mask[t] = value for every token whose first character lies in a span (starts ascending)."""
    for s, e in spans:
        lo, hi = bisect.bisect_left(starts, s), bisect.bisect_left(starts, e)
        mask[lo:hi] = [value] * (hi - lo)


_PREFIX_MARGIN = 32  # tokens: a text cut only changes the tokens around the cut (one pre-token word)
_CHARS_PER_TOKEN = 8  # generous: English ~4, code ~3


def _encode_prefix(tokenizer: Any, text: str, n: int) -> Any:
    """The first `n` tokens (+ offsets) of `text`, tokenising only a prefix of it when that suffices."""
    kwargs = {
        "add_special_tokens": False,
        "return_offsets_mapping": True,
        "truncation": True,
        "max_length": n,
    }
    budget = (n + _PREFIX_MARGIN) * _CHARS_PER_TOKEN
    if len(text) > budget:
        enc = tokenizer(text[:budget], **{**kwargs, "max_length": n + _PREFIX_MARGIN})
        if len(enc["input_ids"]) >= n + _PREFIX_MARGIN:  # the first n tokens are unaffected by the cut
            return {k: enc[k][:n] for k in ("input_ids", "offset_mapping")}
    return tokenizer(text, **kwargs)


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], *, max_length: int, think: str = "keep"
) -> Encoded:
    """Render + tokenise one conversation with its assistant mask, truncated to `max_length` tokens.

    Args:
        tokenizer: a fast HF tokenizer with a chat template (offsets mapping needed).
        messages: normalised turns ``{"role", "content"}`` (see `peagle.data.formats`).
        max_length: keep the first `max_length` tokens.
        think: ``keep`` | ``mask`` | ``drop`` for ``<think>`` traces in assistant turns.

    Returns:
        `Encoded` with ``input_ids`` [T] and ``loss_mask`` [T] (1 = assistant content / end-of-turn).
    """
    if think == "drop":
        messages = [
            {**m, "content": drop_think(m["content"])} if m["role"] == "assistant" else m for m in messages
        ]
    full = render(tokenizer, messages)
    enc = _encode_prefix(tokenizer, full, max_length + 1)
    truncated = len(enc["input_ids"]) > max_length
    ids: list[int] = list(enc["input_ids"][:max_length])
    starts = [a for a, _b in enc["offset_mapping"][:max_length]]
    limit = enc["offset_mapping"][len(ids) - 1][1] if ids else 0
    _full, spans = assistant_spans(tokenizer, messages, full=full, limit=limit if truncated else None)
    mask = [0] * len(ids)
    _mark(mask, starts, spans, 1)
    if think == "mask":
        _mark(mask, starts, _think_spans(full, spans), 0)
    return Encoded(ids, mask, truncated)


# ---------------------------------------------------------------------------------------------------
# Many conversations on all cores
# ---------------------------------------------------------------------------------------------------

_WORKER_TOKENIZER: list[Any] = []  # per worker process, set by the pool initializer


def _init_worker(tokenizer: Any) -> None:
    import os

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER[:] = [tokenizer]


def _encode_chunk(args: tuple[list[list[dict[str, str]]], int, str]) -> list[Encoded]:
    convs, max_length, think = args
    tok = _WORKER_TOKENIZER[0]
    return [tokenize_conversation(tok, c, max_length=max_length, think=think) for c in convs]


def tokenize_many(
    tokenizer: Any,
    conversations: list[list[dict[str, str]]],
    *,
    max_length: int,
    think: str = "keep",
    workers: int | None = None,
    chunk_size: int = 128,
) -> list[Encoded]:
    """`tokenize_conversation` over many conversations, in order, on `workers` processes (default: all cores).

    With one worker (or few conversations) it runs in this process.
    """
    import os

    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers <= 1 or len(conversations) < 2 * chunk_size:
        return [
            tokenize_conversation(tokenizer, c, max_length=max_length, think=think) for c in conversations
        ]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    chunks = [
        (conversations[i : i + chunk_size], max_length, think)
        for i in range(0, len(conversations), chunk_size)
    ]
    ctx = mp.get_context("forkserver")
    out: list[Encoded] = []
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer,)
    ) as pool:
        for part in pool.map(_encode_chunk, chunks):
            out.extend(part)
    return out
