"""The estimated data funnel of a job and the optimizer steps it gives, before any data is read.

`data_funnel` counts what the job's data preparation would read, drop (per reason), hold out, pack and train
on, under the keys of `peagle.spec.funnel` (the ones the job's own data report and a dataset's report use).
Per source it takes, in this order: the uploaded dataset's validator report, the measured profile of a
builtin data set (`calibration.BUILTIN_PROFILE`), else assumptions it adds to `notes`.
"""

from __future__ import annotations

import math
from typing import Any

from peagle.spec import TrainSpec
from peagle.spec.funnel import DROPPED_BY_REASON, funnel
from service.estimate.calibration import AVG_TOKENS_PER_ROW, BUILTIN_PROFILE, PACKING_EFFICIENCY

__all__ = ["data_funnel", "optimizer_steps"]


def data_funnel(spec: TrainSpec, dataset_rows: dict[str, dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """The `peagle.spec.funnel` of `spec`'s data (`estimated: True`), `dataset_rows` being the validator
    reports of its `dataset:<id>` sources; each assumption made is appended to `notes`."""
    read = kept = 0
    tokens = 0.0
    reasons: dict[str, float] = {}
    cap = spec.data.max_length
    budget = spec.data.max_samples
    for src in spec.data.sources:
        report = dataset_rows.get(src.path)
        profile = BUILTIN_PROFILE.get(src.path)
        if report is not None:
            base = report.get("funnel") or {}
            avail = int(report.get("rows_kept") or 0)
            r_read = int(report.get("rows_read") or avail)
            shares = {k: v / max(r_read, 1) for k, v in (base.get(DROPPED_BY_REASON) or
                                                         report.get("skipped_by_reason") or {}).items()}
            per_kept = r_read / max(avail, 1)
            per = (int(report["tokens"]) / max(avail, 1)) if report.get("tokens") else AVG_TOKENS_PER_ROW
            too_long = 0.0
        elif profile is not None:
            avail, per_kept, shares = profile.rows, profile.read_per_kept, dict(profile.ingest_reasons)
            per, too_long = profile.tokens_per_conversation, profile.too_long_share
            if cap != profile.max_length:
                per = min(AVG_TOKENS_PER_ROW, cap * profile.tokens_per_conversation / profile.max_length)
                notes.append(f"{src.path}: drops and tokens per conversation measured at data.max_length="
                             f"{profile.max_length}, scaled to {cap}")
        else:
            avail, per_kept, shares, per, too_long = 10_000, 1.0, {}, AVG_TOKENS_PER_ROW, 0.0
            notes.append(f"rows of {src.path!r} unknown before the job reads it: assumed {avail}")
        n = max(0, avail - src.skip)
        for cap_n in (src.max_samples, budget):
            if cap_n is not None:
                n = min(n, cap_n)
        if budget is not None:
            budget -= n
        n_read = round(n * per_kept) + min(src.skip, avail)
        for k, share in shares.items():
            reasons[k] = reasons.get(k, 0.0) + share * n_read
        if src.skip:
            reasons["source_skip"] = reasons.get("source_skip", 0.0) + min(src.skip, avail)
        cut = round(n * too_long)
        if cut:
            reasons["too_long_no_assistant_left"] = reasons.get("too_long_no_assistant_left", 0.0) + cut
        read += n_read
        kept += n - cut
        tokens += (n - cut) * min(per, cap)
    whole = {k: round(v) for k, v in reasons.items()}
    # rounding may leave the sum a conversation off: give it to the largest reason, never to "unaccounted"
    gap = read - kept - sum(whole.values())
    if gap and whole:
        big = max(whole, key=lambda k: whole[k])
        whole[big] += gap
    held = min(spec.data.eval_samples, max(kept - 1, 0))
    train = kept - held
    train_tokens = int(tokens * train / max(kept, 1))
    packed = math.ceil(train_tokens / (spec.optim.pack_length * PACKING_EFFICIENCY)) if train_tokens else 0
    return funnel(read=read, kept=kept, dropped_by_reason=whole, held_out=held, packed_rows=packed,
                  train_tokens=train_tokens, estimated=True)


def optimizer_steps(spec: TrainSpec, packed_rows: int) -> int:
    """Optimizer steps over `packed_rows` training rows for `optim.epochs`, capped at `optim.max_steps`."""
    o = spec.optim
    steps = math.ceil(packed_rows / (o.micro_batch_size * o.grad_accumulation)) * o.epochs
    return min(steps, o.max_steps) if o.max_steps is not None else steps
