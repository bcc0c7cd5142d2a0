"""Response regeneration: replace every assistant turn with the target's own answer (docs/engine.md 6,
docs/algorithm.md 1.2). Engine-agnostic; the engines are in `peagle.data.regenerate_engines`.

    result = regenerate_conversations(convs, tokenizer, settings, identity=target_identity(...),
                                      open_backend=lambda: open_vllm_backend(engine_config, log_path))
    result.conversations[i]   # regenerated messages, or None when dropped (result.reasons[i] says why)

Rules, per conversation (`ConversationRun`):

* a conversation that ends with a user turn (a prompts-only row: a request body, a prompt; or a multi-turn
  one whose last prompt was never answered) gets an assistant turn appended (`with_answer_slot`), so the
  target writes one more answer; its content key is then that of the same prompts with an answer, whose
  old content never counts (`peagle.data.regenerate_cache.conversation_key`), so both share a cache record;
* turns are walked in order; user/system/tool turns are kept; assistant turn j is generated from the
  already regenerated prefix ``conv[:j]``, rendered with the target's own chat template
  (`peagle.data.template.render` + generation prompt, tokenised as training tokenises it) and sent as
  token ids, with ``max_tokens = min(max_new_tokens, max_model_len - prompt_len, max_length - prompt_len +
  LENGTH_MARGIN)``: training keeps only the first `data.max_length` tokens of a conversation, so an answer is
  never generated further than that (plus a margin that keeps the end-of-turn marker of the cut answer past
  the cut, whatever the re-tokenisation of its text);
* a prompt that reaches `data.max_length` tokens (or the engine's context) ends the conversation there
  (``stop = "max_length"``): training would cut the later turns away anyway. The conversation keeps the
  turns before it (counted as `stopped_at_max_length`), or, when no answer came before, is dropped as
  `too_long_no_assistant_left`;
* an answer that reached `data.max_length` (the last clamp above was the one that cut it) is kept, whatever
  `on_length` says, and ends the conversation (``finish`` ``"max_length"``, ``stop = "max_length"``): the
  training row holds the same tokens as if it had been generated to its end;
* an answer cut by the limit (``finish_reason == "length"``): with `on_length: drop` the conversation stops
  and is dropped (`regenerated_answer_cut`); with `keep` it goes on from the cut answer (counted);
* a conversation with no non-empty assistant answer (no turn to answer in the input, or only empty
  answers) is dropped as `no_assistant_turn`;
* sampling (temperature > 0) is seeded per turn from (optim.seed, the conversation's content key, the turn),
  so an answer never depends on batch order or on which conversations share the engine.

Cache (`peagle.data.regenerate_cache`): every finished conversation is appended (locked, fsynced) to the
shared folder under its content key; cached ones are not generated again, and the engine is opened
(`open_backend`) only when something is left to generate. Progress (`peagle.data.regen_progress`: the
conversations left to generate, tokens/s as answers come back, a smoothed ETA; cached ones are done at once)
goes to the sink as a `progress` event with ``phase: regenerating`` and a log line, at most every
`PROGRESS_EVERY_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from peagle.data.regen_progress import RegenProgress
from peagle.data.regenerate_cache import RegenCache, conversation_key, group_key, regen_cache_dir
from peagle.data.regenerate_engines import TurnRequest, TurnResult
from peagle.data.template import render
from peagle.engine.aio import run_sync
from peagle.progress import ProgressSink
from peagle.spec.funnel import NO_ASSISTANT_TURN, REGEN_ANSWER_CUT, TOO_LONG

__all__ = [
    "LENGTH_MARGIN",
    "PROGRESS_EVERY_S",
    "ConversationRun",
    "RegenResult",
    "RegenSettings",
    "outcome",
    "regenerate_conversations",
    "with_answer_slot",
]

#: Least seconds between two progress records (the first and the last always go out).
PROGRESS_EVERY_S = 5.0
#: Tokens an answer may run past `data.max_length` (its text is tokenised again for training, which can
#: merge a few tokens; the margin keeps the cut answer's end-of-turn marker out of the training row).
LENGTH_MARGIN = 16
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class RegenSettings:
    """Everything the driver needs besides the conversations (from `data.regenerate`, `data.max_length`,
    `optim.seed` and the engine)."""

    engine: str  # "hf" | "vllm"
    dtype: str  # the target's dtype in that engine
    temperature: float
    max_new_tokens: int
    on_length: str  # "drop" | "keep"
    batch_size: int  # conversations in flight (vllm) / per generate() call (hf)
    max_length: int  # data.max_length: a prompt this long ends the conversation
    max_model_len: int  # the engine's context: prompt + answer
    seed: int = 0
    engine_args: tuple[str, ...] = ()  # vLLM's extra command-line arguments (a quantization changes answers)

    def key_fields(self) -> dict[str, Any]:
        """What changes an answer (the cache group). Not `on_length` (applied when reading, see
        `outcome`) nor `batch_size`; the seed only when sampling (greedy answers do not depend on it)."""
        out: dict[str, Any] = {"engine": self.engine, "dtype": self.dtype, "temperature": self.temperature,
                               "max_new_tokens": self.max_new_tokens, "max_length": self.max_length,
                               "max_model_len": self.max_model_len}
        if self.engine_args:
            out["engine_args"] = list(self.engine_args)
        if self.temperature > 0:
            out["seed"] = self.seed
        return out


def with_answer_slot(messages: Messages) -> Messages:
    """`messages` with an empty assistant turn appended when its last turn is a user turn (the target
    writes that answer); else `messages` itself.

    >>> with_answer_slot([{"role": "user", "content": "Hi"}])[-1]
    {'role': 'assistant', 'content': ''}
    """
    if messages and messages[-1]["role"] == "user":
        return [*messages, {"role": "assistant", "content": ""}]
    return messages


def turn_seed(key: str, turn: int, seed: int) -> int:
    """The sampling seed of answer `turn` of the conversation with content key `key` (31 bits)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}:{turn}".encode()).digest()[:4], "big") >> 1


class ConversationRun:
    """One conversation being regenerated: `next_request()` -> `accept(result)` until it returns None.

    Args:
        key: the conversation's content key (`conversation_key`).
        messages: its normalised turns ``{"role", "content"}``.
        settings: the regeneration settings.
        encode: messages -> prompt ids [P] (render with the generation prompt, tokenise).
    """

    def __init__(self, key: str, messages: Messages, settings: RegenSettings,
                 encode: Callable[[Messages], list[int]]) -> None:
        self.key, self.source, self.s, self.encode = key, messages, settings, encode
        self.out: Messages = []
        self.pos = 0
        self.finish: list[str] = []
        self.stop: str | None = None
        self.tokens = 0
        self.pending: TurnRequest | None = None
        self.capped = False  # the pending answer is clamped by data.max_length, not by the answer budget

    def next_request(self) -> TurnRequest | None:
        """The next answer to generate (also kept in `pending`), or None when the conversation is done."""
        self.pending = None
        if self.stop is not None:
            return None
        src = self.source
        while self.pos < len(src):
            if src[self.pos]["role"] != "assistant":
                self.out.append(dict(src[self.pos]))
            elif self.out:
                break
            self.pos += 1  # an assistant turn with nothing before it has no prompt: skipped
        if self.pos >= len(src):
            return None
        ids = self.encode(self.out)
        if len(ids) >= min(self.s.max_length, self.s.max_model_len):  # (a smaller engine context counts too)
            self.stop = "max_length"
            return None
        budget = min(self.s.max_new_tokens, self.s.max_model_len - len(ids))
        row_left = self.s.max_length - len(ids) + LENGTH_MARGIN
        limit, self.capped = min(budget, row_left), row_left < budget
        self.pending = TurnRequest(list(ids), max(limit, 1), self.s.temperature,
                                   turn_seed(self.key, len(self.finish), self.s.seed))
        return self.pending

    def accept(self, result: TurnResult) -> None:
        """Record the answer to `pending` and move past its assistant turn."""
        self.out.append({"role": "assistant", "content": result.text})
        self.pos += 1
        self.tokens += result.num_tokens
        if result.finish_reason == "length" and self.capped:  # cut where training cuts the row: not a cut answer
            self.finish.append("max_length")
            self.stop = "max_length"
            return
        self.finish.append(result.finish_reason)
        if result.finish_reason == "length" and self.s.on_length == "drop":
            self.stop = "length"  # dropped anyway: its later turns are not worth generating

    def record(self) -> dict[str, Any]:
        """The cache record (`peagle.data.regenerate_cache`)."""
        return {"key": self.key, "messages": self.out, "finish": self.finish, "stop": self.stop,
                "tokens": self.tokens}


def outcome(record: dict[str, Any], on_length: str) -> tuple[Messages | None, str | None]:
    """(messages, None) for a kept conversation, (None, funnel reason) for a dropped one."""
    msgs = record["messages"]
    if on_length == "drop" and "length" in record["finish"]:
        return None, REGEN_ANSWER_CUT
    if not any(m["role"] == "assistant" for m in msgs):
        return None, TOO_LONG if record.get("stop") == "max_length" else NO_ASSISTANT_TURN
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        return None, NO_ASSISTANT_TURN
    return msgs, None


def _usable(on_length: str) -> Callable[[dict[str, Any]], bool]:
    # a record that stopped at a cut answer (made under `drop`) lacks the later turns `keep` needs
    return lambda rec: not (on_length == "keep" and rec.get("stop") == "length")


@dataclass
class RegenResult:
    """What `regenerate_conversations` returns: per input conversation its messages or None, the drop
    reasons by input index, and a report (counts, tokens, seconds)."""

    conversations: list[Messages | None]
    reasons: dict[int, str]
    report: dict[str, Any] = field(default_factory=dict)


def _run_lockstep(runs: list[ConversationRun], backend: Any, width: int, done: Callable[[ConversationRun], None],
                  progress: RegenProgress | None = None) -> None:
    """Batches of `width` conversations, advanced together one turn per `backend.generate` call; `progress`
    counts every answer."""
    for b in range(0, len(runs), width):
        live = runs[b : b + width]
        while live:
            answers = backend.generate([r.pending for r in live])
            for run, ans in zip(live, answers, strict=True):
                run.accept(ans)
                if progress is not None:
                    progress.answered(ans.num_tokens)
                if run.next_request() is None:
                    done(run)
            if progress is not None:
                progress.tick()
            live = [r for r in live if r.pending is not None]


async def _run_concurrent(runs: list[ConversationRun], backend: Any, width: int,
                          done: Callable[[ConversationRun], None], progress: RegenProgress | None = None) -> None:
    """`width` conversations in flight; each sends its next turn as soon as its last answer is back.
    `progress` counts the answers and gets a `tick` every `progress.every_s` seconds (same thread)."""
    queue = iter(runs)
    n_workers = min(width, len(runs))
    left = [n_workers]
    ticking: list[asyncio.Task[None]] = []

    async def worker() -> None:
        try:
            for run in queue:  # one iterator shared by the workers (one thread: no two take the same run)
                while run.pending is not None:
                    ans = await backend.agenerate(run.pending)
                    run.accept(ans)
                    if progress is not None:
                        progress.answered(ans.num_tokens)
                    run.next_request()
                done(run)
        finally:
            left[0] -= 1
            if left[0] == 0:  # the last worker stops the ticker (a cancelled task is no error in a group)
                for t in ticking:
                    t.cancel()

    async def ticker(p: RegenProgress) -> None:
        while True:
            await asyncio.sleep(max(p.every_s, 0.1))
            p.tick()

    try:
        async with asyncio.TaskGroup() as group:
            if progress is not None and n_workers:
                ticking.append(group.create_task(ticker(progress)))
            for _ in range(n_workers):
                group.create_task(worker())
    except BaseExceptionGroup as eg:  # the first failure, as itself (an EngineError names the engine log)
        raise eg.exceptions[0] from None
    finally:
        await backend.aclose()


def regenerate_conversations(
    conversations: Sequence[Messages],
    tokenizer: Any,
    settings: RegenSettings,
    *,
    identity: dict[str, Any],
    open_backend: Callable[[], contextlib.AbstractContextManager[Any]],
    cache_dir: Any = None,
    sink: ProgressSink | None = None,
    clock: Callable[[], float] = time.monotonic,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> RegenResult:
    """Regenerate every assistant turn of `conversations` and answer a last user turn (module docstring),
    reusing the shared cache.

    Args:
        conversations: normalised conversations (lists of ``{"role", "content"}``).
        tokenizer: the target's tokenizer (its chat template renders every prompt).
        settings: `RegenSettings`.
        identity: `peagle.data.regenerate_cache.target_identity(...)` of the target.
        open_backend: opens the engine (a context manager yielding a `VllmBackend` or `HfBackend`); called
            only when some conversation is not cached.
        cache_dir: the cache folder; None = `regen_cache_dir()`.
        sink: optional ProgressSink (progress events and log lines).
        clock: monotonic seconds (injected by tests).
        progress_every_s: least seconds between two progress records.

    Returns:
        `RegenResult`: ``conversations[i]`` (None when dropped), ``reasons`` {i: funnel reason}, ``report``
        (``conversations``, ``cached``, ``generated``, ``kept``, ``dropped_by_reason``, ``answers_cut``,
        ``stopped_at_max_length``, ``answers_appended`` (conversations that ended with a user turn),
        ``tokens``, ``seconds``, ``tokens_per_s``, ``cache_file``).

    Raises:
        EngineError: the engine failed to start, died, or refused a request (what is done stays cached).
    """
    group = group_key(identity, settings.key_fields())
    slotted = [with_answer_slot(list(c)) for c in conversations]
    appended = sum(len(a) != len(c) for a, c in zip(slotted, conversations, strict=True))
    conversations = slotted
    keys = [conversation_key(group, c) for c in conversations]

    def encode(msgs: Messages) -> list[int]:
        text = render(tokenizer, msgs, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    t0 = clock()
    with RegenCache(regen_cache_dir() if cache_dir is None else cache_dir, group) as cache:
        records = cache.load(keys, usable=_usable(settings.on_length))
        cached = sum(k in records for k in keys)
        todo = _pending(keys, conversations, records, settings, encode)
        progress = RegenProgress(sink, len(conversations), todo, progress_every_s, clock)

        def done(run: ConversationRun) -> None:
            rec = run.record()
            cache.append(rec)
            records[run.key] = rec
            progress.add(run)

        gen_s = 0.0
        progress.begin(settings.engine)  # at once: starting an engine takes from seconds to minutes
        if todo:
            with open_backend() as backend:
                progress.start()  # 0 done: the engine is up (a bar appears; the log says so)
                t_gen = clock()
                width = max(1, settings.batch_size)
                if getattr(backend, "concurrent", False):
                    run_sync(_run_concurrent(todo, backend, width, done, progress))
                else:
                    _run_lockstep(todo, backend, width, done, progress)
                gen_s = clock() - t_gen
        path = str(cache.path)
    return _result(keys, records, todo, settings, cached=cached, appended=appended, gen_s=gen_s, path=path,
                   seconds=lambda: round(clock() - t0, 2))


def _pending(keys: list[str], conversations: Sequence[Messages], records: dict[str, Any],
             settings: RegenSettings, encode: Callable[[Messages], list[int]]) -> list[ConversationRun]:
    """The conversations the engine must answer (not in `records`, each key once), as `ConversationRun`s.

    A conversation with nothing to ask the engine (no answer, or a prompt too long) is recorded in `records`
    at once instead.
    """
    todo: list[ConversationRun] = []
    seen: set[str] = set()
    for key, conv in zip(keys, conversations, strict=True):
        if key in records or key in seen:
            continue  # a duplicate conversation is generated once
        seen.add(key)
        run = ConversationRun(key, conv, settings, encode)
        if run.next_request() is None:  # nothing to ask the engine (no answer, or the prompt is too long)
            records[key] = run.record()
        else:
            todo.append(run)
    return todo


def _result(keys: list[str], records: dict[str, Any], todo: list[ConversationRun], settings: RegenSettings, *,
            cached: int, appended: int, gen_s: float, path: str, seconds: Callable[[], float]) -> RegenResult:
    """`RegenResult` of the conversations `keys` from their `records` (the report: `regenerate_conversations`);
    `seconds` reads the elapsed time when the report is written."""
    out: list[Messages | None] = []
    reasons: dict[int, str] = {}
    for i, key in enumerate(keys):
        msgs, why = outcome(records[key], settings.on_length)
        out.append(msgs)
        if why is not None:
            reasons[i] = why
    by_reason: dict[str, int] = {}
    for why in reasons.values():
        by_reason[why] = by_reason.get(why, 0) + 1
    tokens = sum(r.tokens for r in todo)
    report = {
        "engine": settings.engine,
        "conversations": len(keys),
        "cached": cached,
        "generated": len(todo),
        "kept": len(keys) - len(reasons),
        "dropped_by_reason": dict(sorted(by_reason.items())),
        "answers_cut": sum(m is not None and "length" in records[k]["finish"] for m, k in zip(out, keys, strict=True)),
        "stopped_at_max_length": sum(m is not None and records[k].get("stop") == "max_length"
                                     for m, k in zip(out, keys, strict=True)),
        "answers_appended": appended,
        "tokens": tokens,
        "seconds": seconds(),
        "generation_seconds": round(gen_s, 2),
        "tokens_per_s": round(tokens / gen_s, 1) if gen_s > 0 else None,
        "cache_file": path,
    }
    return RegenResult(out, reasons, report)
