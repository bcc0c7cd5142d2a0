"""One entry for the pipeline: spec -> packed train/eval rows, draft vocab, mask token, report.

Steps: stream every source (`peagle.data.formats`), optionally regenerate assistant turns with the target
(`peagle.data.regenerate`: vLLM or transformers, cached by content in a folder shared by jobs; its drops go
into the funnel; prompts-only rows, with no answer and a user turn last, are kept only then: the target
writes their answer; without regeneration a source left with nothing but them is refused, naming it), hold
out `data.eval_samples` conversations (seeded), template + mask on all cores
(`peagle.data.template`), drop rows with fewer than `data.min_assistant_tokens` supervised tokens
(reported), count assistant tokens of the TRAIN rows for the draft vocab (docs/decisions.md decision 7), choose the mask
token (docs/decisions.md decision 8, proven unused in train+eval rows), pack (seeded). Results go to ``RUN/data/``
(``prepared.pt``, ``vocab.safetensors``, ``report.json``) keyed by the spec hash of the sections that
produce them, so a resumed run reloads them.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from peagle.builtin import resolve_data_path
from peagle.data.formats import IngestReport, Row, iter_rows
from peagle.data.packing import PackedRows, pack_documents
from peagle.data.regenerate import RegenSettings, regenerate_conversations
from peagle.data.regenerate_cache import group_key, target_identity
from peagle.data.template import tokenize_many
from peagle.data.vocab import (
    DraftVocab,
    build_draft_vocab,
    count_assistant_tokens,
    load_vocab,
    resolve_mask_token_id,
    save_vocab,
)
from peagle.errors import DataInvalidError
from peagle.fileio import atomic_path
from peagle.progress import ProgressSink
from peagle.spec import TrainSpec
from peagle.spec.funnel import (
    DROPPED,
    DROPPED_BY_REASON,
    REASONS,
    SOURCE_SKIP,
    TOKEN_OUT_OF_RANGE,
    TOO_FEW_ASSISTANT_TOKENS,
    TOO_LONG,
    funnel,
)

__all__ = ["PreparedData", "RegenPlan", "data_cache_key", "data_funnel", "prepare_data", "regeneration_plan",
           "resolve_regeneration"]

CACHE_VERSION = 4  # 2: the data report carries the funnel (peagle.spec.funnel); 3: content-keyed regeneration;
# 4: prompts-only rows are kept and answered when regenerating (the funnel counts them)


@dataclass
class PreparedData:
    """What `prepare_data` returns: packed train/eval rows, vocab, mask token, report, data dir."""

    train: PackedRows
    eval: PackedRows
    vocab: DraftVocab
    mask_token_id: int
    report: dict[str, Any]
    data_dir: Path

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab.draft_vocab_size


def data_cache_key(spec: TrainSpec, regen: str | None = None) -> str:
    """Hash of everything that determines the prepared data.

    Args:
        spec: the job spec.
        regen: the regeneration's cache group (`RegenPlan.group`: target identity with its weight files'
            fingerprint, engine, dtype, settings) when regeneration is on; None when it is off.
    """
    blob = {
        "v": CACHE_VERSION,
        "target": spec.target.model_dump(mode="json"),
        "data": spec.data.model_dump(mode="json"),
        "vocab": [spec.draft.draft_vocab_size, spec.draft.mask_token_id],
        "pack": [spec.optim.pack_length, spec.optim.seed],
        "regen": regen,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class RegenPlan:
    """How this job regenerates: settings, target identity, cache group, and what opens the engine."""

    settings: RegenSettings
    identity: dict[str, Any]
    group: str
    open_backend: Callable[[], AbstractContextManager[Any]]


def resolve_regeneration(spec: TrainSpec, *, vllm: bool | None = None) -> tuple[bool, str]:
    """(enabled, engine) of `data.regenerate` with every `auto` resolved (`TrainSpec.resolve`; whether vLLM is
    there is asked only when needed). The string "auto" never counts as enabled."""
    regen = spec.data.regenerate
    enabled, engine = regen.enabled, regen.engine
    if enabled == "auto" or engine == "auto":
        if vllm is None:
            from peagle.engine.locate import vllm_available

            vllm = vllm_available()
        resolved = spec.resolve(cuda_available=False, vllm_available=vllm).data.regenerate
        enabled, engine = resolved.enabled, resolved.engine
    return enabled is True, str(engine)


def regeneration_plan(spec: TrainSpec, tokenizer: Any, run_dir: str | Path, *, model: Any = None,
                      regen_engine: Any = None) -> RegenPlan | None:
    """The job's `RegenPlan`, or None when regeneration is off.

    Raises:
        DataInvalidError: regeneration is on but its engine was not given (`model` for hf, `regen_engine`
            for vllm).
    """
    from peagle.data.regenerate_engines import HfBackend, open_vllm_backend

    enabled, engine = resolve_regeneration(spec, vllm=True if regen_engine is not None else None)
    if not enabled:
        return None
    d, r = spec.data, spec.data.regenerate
    open_backend: Callable[[], AbstractContextManager[Any]]
    if engine == "vllm":
        if regen_engine is None:
            raise DataInvalidError("data.regenerate.engine resolved to vllm: pass regen_engine= (an EngineConfig)")
        dtype, max_model_len = str(regen_engine.dtype), regen_engine.max_model_len or d.max_length + r.max_new_tokens
        extra = tuple(regen_engine.extra_args)
        log = Path(run_dir) / "logs" / "engine-regenerate.log"
        open_backend = partial(open_vllm_backend, regen_engine, log)
    else:
        if model is None:
            raise DataInvalidError("data.regenerate.enabled needs the target model (pass model=)")
        dtype, max_model_len, extra = str(model.dtype).removeprefix("torch."), d.max_length + r.max_new_tokens, ()
        open_backend = partial(nullcontext, HfBackend(model, tokenizer))
    settings = RegenSettings(engine=engine, dtype=dtype, temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                             on_length=r.on_length, batch_size=r.batch_size, max_length=d.max_length,
                             max_model_len=int(max_model_len), seed=spec.optim.seed, engine_args=extra)
    identity = target_identity(spec.target.model, spec.target.revision)
    return RegenPlan(settings, identity, group_key(identity, settings.key_fields()), open_backend)


def _emit(sink: ProgressSink | None, kind: str, **fields: Any) -> None:
    if sink is not None:
        sink.event(kind, **fields)


def _log(sink: ProgressSink | None, msg: str) -> None:
    if sink is not None:
        sink.log("info", msg)


def _read_sources(spec: TrainSpec, dataset_root: Path | None, *, keep_prompts_only: bool
                  ) -> tuple[list[Row], list[dict[str, Any]]]:
    """Every source's usable rows and ingestion report; prompts-only rows kept with `keep_prompts_only`
    (regeneration on).

    Raises:
        DataInvalidError: a source that cannot be read, or (regeneration off) one whose rows are all
            prompts-only, named by its field (``data.sources.K.path``).
    """
    rows: list[Row] = []
    reports = []
    for k, src in enumerate(spec.data.sources):
        try:
            path = resolve_data_path(src.path, dataset_root)
        except (ValueError, FileNotFoundError) as exc:
            raise DataInvalidError(f"data.sources.{k}.path: {exc}") from None
        rep = IngestReport()
        caps = [src.max_samples]
        if spec.data.max_samples is not None:
            caps.append(spec.data.max_samples - len(rows))
        cap = min((c for c in caps if c is not None), default=None)
        if cap is not None and cap <= 0:
            break
        for row in iter_rows(path, src.format, rep, skip=src.skip, max_samples=cap,
                             keep_prompts_only=keep_prompts_only):
            row.source = k
            rows.append(row)
        if rep.rows_kept == 0 and rep.prompts_only and not keep_prompts_only:
            raise DataInvalidError(
                f"data.sources.{k}.path: {rep.prompts_only} of {rep.rows_read} rows end with a user turn and have "
                "no answer to train on; turn on data.regenerate.enabled so the target writes them")
        reports.append({"source": k, **rep.to_dict()})
    return rows, reports


def prepare_data(
    spec: TrainSpec,
    tokenizer: Any,
    run_dir: str | Path,
    *,
    target_vocab_size: int,
    dataset_root: Path | None = None,
    sink: ProgressSink | None = None,
    model: Any = None,
    regen_engine: Any = None,
    workers: int | None = None,
) -> PreparedData:
    """Prepare the training data of `spec` into ``run_dir/data`` (cached by spec hash).

    Args:
        spec: the resolved job spec (data, draft vocab/mask token, optim.pack_length/seed).
        tokenizer: the target's HF tokenizer (its chat template is used).
        run_dir: RUN directory; outputs go to ``RUN/data``.
        target_vocab_size: V = rows of the target embedding (may exceed len(tokenizer)).
        dataset_root: where ``dataset:<id>`` sources live.
        sink: optional ProgressSink (phase events ``preparing_data``, ``regenerating``, ``building_vocab``,
            regeneration progress, logs).
        model: the in-process target (HF causal LM), needed when regeneration runs with transformers.
        regen_engine: the vLLM engine (`peagle.engine.server.EngineConfig`, generation only) when regeneration
            runs in vLLM: started only when some conversation is not in the regeneration cache, logging to
            ``RUN/logs/engine-regenerate.log``, stopped when done.
        workers: processes for templating (default: all cores).

    `data.regenerate.enabled` / `engine` may still be `auto` (`resolve_regeneration`).

    Raises:
        DataInvalidError: unreadable source, no usable conversation, mask token in the data.
        EngineError: the regeneration engine failed (what it finished stays cached).
    """
    data_dir = Path(run_dir) / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    plan = regeneration_plan(spec, tokenizer, run_dir, model=model, regen_engine=regen_engine)
    key = data_cache_key(spec, regen=plan.group if plan is not None else None)
    reloaded = _reload(data_dir, key, sink)
    if reloaded is not None:
        return reloaded
    d = spec.data
    _emit(sink, "phase", phase="preparing_data", message="reading, templating and packing the data")
    rows, src_reports = _read_sources(spec, dataset_root, keep_prompts_only=plan is not None)
    if not rows:
        raise DataInvalidError("no usable conversation in data.sources: " + json.dumps(src_reports)[:2000])
    chat = [i for i, r in enumerate(rows) if r.messages is not None]
    convs = [m for m in (rows[i].messages for i in chat) if m is not None]
    regen_dropped: dict[int, str] = {}
    regen_report: dict[str, Any] | None = None
    if plan is not None and chat:
        if spec.resources.engine is not None and plan.settings.engine == "vllm":
            _regenerate_on_engine_workers(spec, plan, convs, Path(run_dir), sink)
        regen_dropped, regen_report, chat, convs = _regenerate(plan, tokenizer, chat, convs, sink)
    docs, truncated, cut = _encode(rows, chat, convs, tokenizer, spec, workers=workers)
    valid, skipped, bad_rows = _screen(rows, docs, cut, regen_dropped, spec, target_vocab_size)
    keep_train, keep_eval = _hold_out(valid, d.eval_samples, spec.optim.seed)
    if not keep_train:
        raise DataInvalidError(f"no training conversation left after templating: skipped {skipped}")

    _emit(sink, "phase", phase="building_vocab", message="draft vocabulary and mask token")
    counts, vocab, mask_id, how = _vocab_and_mask(spec, tokenizer, docs, keep_train, keep_eval, target_vocab_size)
    save_vocab(vocab, data_dir / "vocab.safetensors")

    train = pack_documents([docs[i] for i in keep_train], spec.optim.pack_length, spec.optim.seed)
    evalr = pack_documents([docs[i] for i in keep_eval], spec.optim.pack_length, spec.optim.seed)
    report = _data_report(src_reports, skipped, bad_rows, truncated=truncated, keep_train=keep_train,
                          keep_eval=keep_eval, train=train, evalr=evalr, counts=counts, vocab=vocab,
                          mask_id=mask_id, how=how, regen_report=regen_report)
    (data_dir / "report.json").write_text(json.dumps(report, indent=1))
    with atomic_path(data_dir / "prepared.pt") as tmp:
        torch.save(
            {
                "key": key,
                "train": [train.input_ids, train.loss_mask, train.document_ids],
                "eval": [evalr.input_ids, evalr.loss_mask, evalr.document_ids],
                "mask_token_id": mask_id,
            },
            tmp,
        )
    fun = report["funnel"]
    why = ", ".join(f"{n} {k}" for k, n in fun[DROPPED_BY_REASON].items()) or "none"
    _emit(sink, "data", message=f"data: {fun['read']} read, {fun['kept']} kept, {fun[DROPPED]} dropped ({why})",
          funnel=fun)
    _log(
        sink,
        f"data: {fun['read']} read, {fun['kept']} kept, {fun[DROPPED]} dropped ({why}); "
        f"{len(keep_train)} train / {len(keep_eval)} eval conversations -> {len(train)} rows; "
        f"Vd={vocab.draft_vocab_size}, mask token {mask_id} ({how})",
    )
    return PreparedData(train, evalr, vocab, mask_id, report, data_dir)


def _reload(data_dir: Path, key: str, sink: ProgressSink | None) -> PreparedData | None:
    """The prepared data in `data_dir` when it was prepared under the same cache `key`, else None."""
    cached = data_dir / "prepared.pt"
    if not (cached.exists() and (data_dir / "vocab.safetensors").exists()):
        return None
    blob = torch.load(cached, weights_only=True)
    if blob.get("key") != key:
        return None
    _log(sink, "prepared data reloaded from RUN/data (same spec hash)")
    report = json.loads((data_dir / "report.json").read_text())
    _emit(sink, "data", message="data funnel (reloaded)", funnel=report.get("funnel"))
    return PreparedData(
        PackedRows(*blob["train"]),
        PackedRows(*blob["eval"]),
        load_vocab(data_dir / "vocab.safetensors"),
        int(blob["mask_token_id"]),
        report,
        data_dir,
    )


def _encode(rows: list[Row], chat: list[int], convs: list[Any], tokenizer: Any, spec: TrainSpec, *,
            workers: int | None) -> tuple[dict[int, tuple[list[int], list[int]]], int, set[int]]:
    """Template + mask the conversations `convs` (of the rows `chat`) and cut the pre-tokenised rows at
    `data.max_length`: (row index -> (input ids, loss mask), truncated conversations, the cut rows' indices)."""
    d = spec.data
    encoded = tokenize_many(tokenizer, convs, max_length=d.max_length, think=d.think, workers=workers)
    docs: dict[int, tuple[list[int], list[int]]] = {}
    for i, enc in zip(chat, encoded, strict=True):
        docs[i] = (enc.input_ids, enc.loss_mask)
    truncated = sum(e.truncated for e in encoded)
    cut = {i for i, enc in zip(chat, encoded, strict=True) if enc.truncated}
    for i, r in enumerate(rows):
        if r.input_ids is not None:
            assert r.loss_mask is not None, "a pre-tokenised row carries its loss mask"
            truncated += len(r.input_ids) > d.max_length
            if len(r.input_ids) > d.max_length:
                cut.add(i)
            docs[i] = (r.input_ids[: d.max_length], r.loss_mask[: d.max_length])
    return docs, truncated, cut


def _screen(rows: list[Row], docs: dict[int, tuple[list[int], list[int]]], cut: set[int],
            regen_dropped: dict[int, str], spec: TrainSpec, target_vocab_size: int,
            ) -> tuple[list[int], dict[str, int], list[dict[str, Any]]]:
    """(indices of the rows kept, dropped rows by reason, the first 100 dropped rows with their reason).

    A row is dropped when regeneration dropped it, when it was cut before any assistant token, when it has
    fewer than `data.min_assistant_tokens` supervised tokens, or when a token id is not in the target's vocab.
    """
    d = spec.data
    skipped: dict[str, int] = {}
    bad_rows: list[dict[str, Any]] = []
    valid = []
    for i in range(len(rows)):
        reason = None
        ids, mask = docs.get(i, ([], []))
        if i in regen_dropped:
            reason = f"{regen_dropped[i]} (regeneration: {REASONS[regen_dropped[i]]})"
        elif sum(mask) == 0 and i in cut:
            reason = f"{TOO_LONG} (cut at data.max_length={d.max_length} before any assistant token)"
        elif sum(mask) < d.min_assistant_tokens:
            reason = f"{TOO_FEW_ASSISTANT_TOKENS} (< {d.min_assistant_tokens} after templating/truncation)"
        elif max(ids) >= target_vocab_size:
            reason = f"{TOKEN_OUT_OF_RANGE} (id {max(ids)} >= {target_vocab_size})"
        if reason:
            short = reason.split(" ")[0]
            skipped[short] = skipped.get(short, 0) + 1
            if len(bad_rows) < 100:
                bad_rows.append(
                    {"source": rows[i].source, "line": rows[i].line, "index": rows[i].index, "reason": reason}
                )
            continue
        valid.append(i)
    return valid, skipped, bad_rows


def _hold_out(valid: list[int], eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, held-out rows) of `valid`, in their order: `eval_samples` rows drawn with `seed`, at most
    all but one (at least one conversation stays for training)."""
    held = list(valid)
    random.Random(seed).shuffle(held)
    n_eval = min(eval_samples, max(len(valid) - 1, 0))  # at least one conversation stays for training
    eval_idx = set(held[:n_eval])
    return [i for i in valid if i not in eval_idx], [i for i in valid if i in eval_idx]


def _vocab_and_mask(spec: TrainSpec, tokenizer: Any, docs: dict[int, tuple[list[int], list[int]]],
                    keep_train: list[int], keep_eval: list[int], target_vocab_size: int,
                    ) -> tuple[torch.Tensor, DraftVocab, int, str]:
    """(assistant token counts of the train rows `[V]`, the draft vocab, the mask token id, how it was chosen).

    The vocab counts TRAIN rows only (docs/decisions.md decision 7); the mask token is proven unused in the
    train and held-out rows (docs/decisions.md decision 8).
    """
    as_t = {i: (torch.tensor(docs[i][0]), torch.tensor(docs[i][1])) for i in keep_train + keep_eval}
    counts = count_assistant_tokens((as_t[i] for i in keep_train), target_vocab_size)
    vocab = build_draft_vocab(counts, spec.draft.draft_vocab_size)
    used = torch.zeros(target_vocab_size, dtype=torch.bool)
    for row_ids, _m in as_t.values():
        used[row_ids] = True
    mask_id, how = resolve_mask_token_id(spec.draft.mask_token_id, tokenizer, target_vocab_size, used)
    return counts, vocab, mask_id, how


def _data_report(src_reports: list[dict[str, Any]], skipped: dict[str, int], bad_rows: list[dict[str, Any]], *,
                 truncated: int, keep_train: list[int], keep_eval: list[int], train: PackedRows, evalr: PackedRows,
                 counts: torch.Tensor, vocab: DraftVocab, mask_id: int, how: str,
                 regen_report: dict[str, Any] | None) -> dict[str, Any]:
    """RUN/data/report.json: what was read, kept and dropped (by reason), packed rows, vocab, mask token, the
    regeneration's report (when on) and the funnel (`data_funnel`)."""
    sup = int(counts.sum())
    report = {
        "sources": src_reports,
        "rows_read": sum(r["rows_read"] for r in src_reports),
        "rows_kept": len(keep_train) + len(keep_eval),
        "rows_skipped": sum(r["rows_skipped"] for r in src_reports) + sum(skipped.values()),
        "skipped_by_reason": _merge([r["skipped_by_reason"] for r in src_reports] + [skipped]),
        "bad_rows": [b for r in src_reports for b in r["bad_rows"]][:100] + bad_rows,
        "train_conversations": len(keep_train),
        "eval_conversations": len(keep_eval),
        "truncated_conversations": int(truncated),
        "train_rows": len(train),
        "eval_rows": len(evalr),
        "train_tokens": train.num_tokens(),
        "train_assistant_tokens": sup,
        "pack_fill": train.num_tokens() / max(train.input_ids.numel(), 1),
        "draft_vocab_size": vocab.draft_vocab_size,
        "draft_vocab_coverage": float(counts[vocab.selected].sum()) / max(sup, 1),
        "mask_token_id": mask_id,
        "mask_token_source": how,
    }
    if regen_report is not None:
        report["regeneration"] = regen_report
    report["funnel"] = data_funnel(report, src_reports, len(keep_eval))
    return report


def _regenerate_on_engine_workers(spec: TrainSpec, plan: RegenPlan, convs: list[Any], run: Path,
                                   sink: ProgressSink | None) -> None:
    """A split job (`resources.engine`): the conversations the cache lacks are answered by the engine
    workers (`peagle.data.remote_regen`), their answers merged into the cache; `_regenerate` then finds
    every one cached and starts no engine."""
    from peagle.data.regenerate import _usable, with_answer_slot
    from peagle.data.regenerate_cache import RegenCache, conversation_key, regen_cache_dir
    from peagle.data.remote_regen import merge_chunks, wait_for_regen
    from peagle.split.protocol import regen_dir, regen_plan, remote_dir, write_regen_plan

    slotted = [with_answer_slot(list(c)) for c in convs]
    keys = [conversation_key(plan.group, c) for c in slotted]
    cache_dir = regen_cache_dir()
    with RegenCache(cache_dir, plan.group) as cache:
        have = cache.load(keys, usable=_usable(plan.settings.on_length))
    todo: dict[str, list[dict[str, str]]] = {}
    for k, c in zip(keys, slotted, strict=True):
        if k not in have:
            todo.setdefault(k, c)
    if not todo:
        return
    assert spec.resources.engine is not None
    replicas = int(spec.resources.engine.replicas)
    size = max(1, min(32, -(-len(todo) // (2 * replicas))))
    rplan = regen_plan(keys=list(todo), settings=plan.settings, identity=plan.identity, group=plan.group,
                       spec=spec.model_dump(mode="json"), chunk_size=size)
    d = regen_dir(run)
    remote_dir(run).mkdir(parents=True, exist_ok=True)  # where the dispatcher writes failed.json
    _emit(sink, "phase", phase="regenerating",
          message=f"regenerating the answers of {len(todo)} conversations on engine workers "
                  f"({len(rplan['chunks'])} chunks)")
    write_regen_plan(d, rplan, list(todo.values()))
    wait_for_regen(d, failed_dir=remote_dir(run))
    n = merge_chunks(d, cache_dir)
    _log(sink, f"regeneration on engine workers: {n} answers merged into the cache")


def _regenerate(plan: RegenPlan, tokenizer: Any, chat: list[int], convs: list[Any], sink: ProgressSink | None
                ) -> tuple[dict[int, str], dict[str, Any], list[int], list[Any]]:
    """Run the regeneration: (row index -> drop reason, its report, kept row indices, their conversations)."""
    s = plan.settings
    _emit(sink, "phase", phase="regenerating",
          message=f"regenerating the answers of {len(convs)} conversations with the target ({s.engine})")
    res = regenerate_conversations(convs, tokenizer, s, identity=plan.identity, open_backend=plan.open_backend,
                                   sink=sink)
    rep = res.report
    why = ", ".join(f"{n} {k}" for k, n in rep["dropped_by_reason"].items()) or "none"
    rate = f" at {rep['tokens_per_s']:.0f} tokens/s" if rep["tokens_per_s"] else ""
    _log(sink, f"regeneration ({s.engine}): {rep['generated']} generated ({rep['tokens']} tokens{rate}), "
               f"{rep['cached']} from the cache; {rep['kept']} kept, dropped: {why}; "
               f"{rep['answers_appended']} ended with a user turn (answer appended); "
               f"{rep['answers_cut']} kept with a cut answer, {rep['stopped_at_max_length']} stopped at data.max_length")
    dropped = {chat[i]: r for i, r in res.reasons.items()}
    kept = [(chat[i], m) for i, m in enumerate(res.conversations) if m is not None]
    return dropped, rep, [i for i, _m in kept], [m for _i, m in kept]


def data_funnel(report: dict[str, Any], src_reports: list[dict[str, Any]], held_out: int) -> dict[str, Any]:
    """The job's funnel (`peagle.spec.funnel`) from its data report: every dropped conversation has a reason.

    Rows passed over by ``data.sources[].skip`` are read but neither kept nor skipped by ingestion; they are
    filed as `SOURCE_SKIP`.
    """
    reasons = dict(report["skipped_by_reason"])
    passed_over = sum(r["rows_read"] - r["rows_kept"] - r["rows_skipped"] for r in src_reports)
    if passed_over:
        reasons[SOURCE_SKIP] = reasons.get(SOURCE_SKIP, 0) + passed_over
    return funnel(read=report["rows_read"], kept=report["rows_kept"], dropped_by_reason=reasons,
                  held_out=held_out, packed_rows=report["train_rows"], train_tokens=report["train_tokens"],
                  truncated=report["truncated_conversations"],
                  prompts_only=sum(int(r.get("prompts_only", 0)) for r in src_reports))


def _merge(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for dct in dicts:
        for k, v in dct.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))
