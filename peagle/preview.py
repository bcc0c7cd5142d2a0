"""The preview: a first training curve within minutes, from a short run on the first conversations.

    summary = run_preview(spec, base, target, run, sink=sink, device=device, aux_ids=aux_ids)

The main run's draft vocabulary counts the tokens of every regenerated answer, so its training cannot
start before the last conversation is regenerated (an hour of the demo on 2 cores). With `preview.conversations`
N > 0 the pipeline first runs the same path on the first N conversations (`preview_spec`): `prepare_data`
(their regenerated answers go to the shared content-keyed cache, `peagle.data.regenerate_cache`, so the main
run finds them there and never generates them again), a vocabulary of their own, capture, and
`preview.steps` optimizer steps of the real `Trainer`, all into RUN/preview (its own data, features and
checkpoints; no evaluation prompts, no export). Then the main run goes on as it would have without it.

What the job shows of it (`PreviewSink`): its training metrics as `preview_*` keys
(`peagle.spec.metrics.preview_key`), its log lines prefixed `preview: `, its progress (regeneration, then
steps). Nothing else leaves it: its phases are log lines, not phases of the job (the pipeline announces the
one phase `preview`), and its checkpoints, data funnel and evaluations are its own, never the job's.

The main run's results are those of the same spec without a preview: the preview runs under `kept_rng`
(the global random states as they were before it, restored after), reads nothing the main run writes and
writes nothing it reads. A finished preview leaves RUN/preview/done.json (atomic), so a resumed run skips
it; a SIGTERM during it stops the job as one during training does (`TrainingInterrupted`, its checkpoint
saved), and a resumed run continues it.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from peagle.fileio import atomic_write_json
from peagle.progress import ProgressLog, ProgressSink
from peagle.run_folder import CHECKPOINTS
from peagle.spec import TrainSpec
from peagle.spec.metrics import preview_values
from peagle.spec.preview import preview_spec
from peagle.start import build_initial_draft, warm_start

__all__ = ["DONE_FILE", "PREVIEW_DIR", "PreviewSink", "kept_rng", "preview_done", "preview_spec", "run_preview"]

#: The preview's run directory, under RUN.
PREVIEW_DIR = "preview"
#: Its marker: written (atomically) when the preview finished; a resumed run skips a finished preview.
DONE_FILE = "done.json"
#: The prefix of the preview's log lines in the job log.
LOG_PREFIX = "preview: "


def preview_done(run: Path) -> dict[str, Any] | None:
    """The summary a finished preview of RUN wrote (RUN/preview/done.json), or None."""
    try:
        found = json.loads((run / PREVIEW_DIR / DONE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


class PreviewSink:
    """What the job sees of the preview (module docstring): metrics as `preview_*` keys, log lines prefixed,
    progress events (regeneration with its phase, training steps as phase `preview`), warnings prefixed;
    every other event (phase, checkpoint, data funnel, eval, resumed) stays inside."""

    def __init__(self, sink: ProgressSink) -> None:
        self.sink = sink

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        self.sink.metric(step, epoch, preview_values(values))

    def event(self, kind: str, **fields: Any) -> None:
        if kind == "progress":
            self.sink.event(kind, **{**fields, "phase": fields.get("phase") or "preview"})
        elif kind == "warning":
            self.sink.event(kind, **{**fields, "message": f"{LOG_PREFIX}{fields.get('message', '')}"})

    def log(self, level: str, message: str) -> None:
        self.sink.log(level, f"{LOG_PREFIX}{message}")


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """The global random states (torch CPU and CUDA, Python's `random`, numpy's) as they were on entry,
    restored on exit: what runs inside consumes none of the caller's randomness."""
    import numpy as np

    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py, npy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        np.random.set_state(npy)


def run_preview(spec: TrainSpec, base: TrainSpec, target: Any, run: Path, *, sink: ProgressSink,
                device: torch.device, aux_ids: list[int], resume: str = "auto",
                dataset_root: Path | None = None) -> dict[str, Any]:
    """Run the preview of `spec` into RUN/preview and write its marker (module docstring).

    Args:
        spec: the job spec (`preview.conversations` >= 1).
        base: `spec` resolved as the pipeline resolved it (target dtype and engines decided).
        target: the loaded `TargetRuntime` (the main run's: nothing is loaded twice).
        run: RUN.
        sink: the job's sink (before the pipeline's `ProgressLog`): the preview reports through `PreviewSink`.
        device: the trainer's device.
        aux_ids: the resolved aux layer ids.
        resume: `auto` continues an interrupted preview from its checkpoint; `never` starts it again.
        dataset_root: where `dataset:<id>` sources live.

    Returns:
        Its summary (also RUN/preview/done.json): conversations, train rows, steps, last loss, seconds.

    Raises:
        What the pipeline raises (data, target, engine problems) and `TrainingInterrupted` after a SIGTERM.
    """
    from peagle.data.prepare import prepare_data
    from peagle.target.runtime import feature_sources
    from peagle.train.checkpoint import find_resumable
    from peagle.train.loop import Trainer

    out = run / PREVIEW_DIR
    out.mkdir(parents=True, exist_ok=True)
    pspec, pbase = preview_spec(spec), preview_spec(base)
    psink = ProgressLog(PreviewSink(sink))  # its own step lines and ETA, prefixed
    t0 = time.monotonic()
    with kept_rng():
        torch.manual_seed(pspec.optim.seed)
        regen = pbase.data.regenerate
        by_engine = regen.enabled is True and regen.engine == "vllm"
        prepared = prepare_data(
            pbase, target.tokenizer, out, target_vocab_size=target.vocab_size, dataset_root=dataset_root,
            sink=psink, model=target.model if regen.enabled is True and regen.engine == "hf" else None,
            **({"regen_engine": target.engine_config(pbase)} if by_engine else {}),
        )
        vocab, mask_token_id = prepared.vocab, int(prepared.mask_token_id)
        warm = None
        if pspec.draft.init_from:  # the same start as the main run: the parent's weights and vocabulary
            own = (find_resumable(out / CHECKPOINTS, warn=lambda m: psink.event("warning", message=m))
                   if resume == "auto" else None)
            warm = warm_start(pspec, target.parts.config.to_dict(), target.vocab_size, source=own)
            vocab, mask_token_id = warm.vocab, warm.mask_token_id
        psink.event("phase", phase="capturing", message=f"target features ({pbase.resources.capture}, {target.engine})")
        with feature_sources(target, pbase, prepared, out, vocab=vocab, aux_ids=aux_ids, sink=psink) as (source, _):
            resume_from = (find_resumable(out / CHECKPOINTS, warn=lambda m: psink.event("warning", message=m))
                           if resume == "auto" else None)
            draft = build_initial_draft(pspec, target.parts, vocab, mask_token_id, aux_ids, source,
                                        from_checkpoint=resume_from is not None,
                                        init_weights=warm.state if warm is not None and resume_from is None else None)
            trainer = Trainer(pspec, draft, source, run_dir=out, sink=psink, device=device, resume=resume,
                              resume_from=resume_from)
            result = trainer.train()
    summary = {
        "conversations": int(prepared.report.get("rows_read", 0)),
        "train_conversations": int(prepared.report.get("train_conversations", 0)),
        "train_rows": len(prepared.train),
        "steps": int(result.step),
        "loss": result.losses[-1] if result.losses else result.metrics.get("loss"),
        "seconds": round(time.monotonic() - t0, 1),
        "draft_vocab_size": int(vocab.draft_vocab_size),
    }
    atomic_write_json(out / DONE_FILE, summary, indent=2, sort_keys=True, newline=True)
    return summary
