"""One micro-batch of P-EAGLE training: COD per row, sequence-partitioned forward+backward.

Per micro-batch (peagle.md 1.12, decisions 5 and 9):

1. each row draws its COD elements ONCE, from a `torch.Generator` seeded by (seed, epoch, index, row),
   so a resumed run and every segment see the same draw;
2. ONE loss denominator for the micro-batch: the supervised elements of all its rows (all ranks);
3. every row is split into S segments (`peagle.flat.plan_segments`); a segment that owns no supervised
   element is skipped; each remaining segment ("unit") runs one forward (through `DraftObjective`, the
   module DDP wraps) and one backward of `loss_sum * scale`. Gradients add up to those of the flat
   forward (S = 1 is the single flat forward);
4. only the supervised elements of a unit go through the final norm, `lm_head` and the KL, fused in row
   chunks (`peagle.loss.head_loss_sums`: no [m, Vd] tensor).

CPU (dense) attention: each unit's mask is built once as an additive float mask and cut into
`QueryGroups` (block-sparse SDPA) before the forward, so no [n, n] mask stays alive during it. The
embedding gradient is a sparse COO tensor of the looked-up rows, coalesced after every backward
(`sparse_embedding_grad`): no dense [V, H] gradient exists; `peagle.train.optim.RowLazyAdamW` and
`clip_grad_norm` consume it as it is. With `StepSettings.release_memory` (the trainer sets it when
`sequence_partitions > 1`), the CPU heap's free pages are returned to the OS after every unit's
backward (`release_free_memory`).

Under DDP the backward is issued on the tensor returned by the DDP forward, `no_sync` covers every unit
but the last one of the optimizer step, and a rank with nothing supervised runs one zero-valued
backward over a dummy element so the collectives stay aligned.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from peagle.cod import sample_cod
from peagle.draft import PEagleDraft, group_queries
from peagle.flat import (
    FlatRow,
    block_mask_for,
    build_flat_row,
    mask_for,
    plan_segments,
    segment_row,
)
from peagle.loss import CodMetrics, head_loss_sums
from peagle.mask import additive_mask, check_dense_fits

__all__ = [
    "EVAL_EPOCH",
    "DraftObjective",
    "StepSettings",
    "StepTimes",
    "UnitInputs",
    "coalesce_embedding_grad",
    "cod_generator",
    "plan_rows",
    "release_free_memory",
    "run_micro_batch",
    "sparse_embedding_grad",
    "weight_sum",
]

EVAL_EPOCH = 1_000_000  # COD key of held-out batches: the same draw at every evaluation


@dataclass(frozen=True)
class StepSettings:
    """Everything a micro-batch step needs besides the model and the data."""

    num_depths: int
    down_sample_ratio: float
    down_sample_ratio_min: float
    max_anchors: int | None
    sequence_partitions: int
    mask_token_id: int
    attention: str  # "sdpa" (dense bool mask) or "flex" (BlockMask)
    autocast_dtype: torch.dtype | None  # bf16 on CUDA, None = fp32
    seed: int
    # CPU: give the heap's free pages back to the OS after every unit's backward (`release_free_memory`)
    release_memory: bool = False


@dataclass
class StepTimes:
    """Seconds spent per phase (summed over units)."""

    fetch: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def cod_generator(seed: int, epoch: int, index: int, row: int) -> torch.Generator:
    """CPU generator of the COD draw of global row `row` of micro-batch (epoch, index)."""
    key = (((seed * 1_000_003 + epoch) * 1_000_033 + index) * 65_537 + row) % (2**63 - 1)
    return torch.Generator().manual_seed(key)


class UnitInputs:
    """Inputs of one forward (a segment of a row). A plain class so DDP passes it through untouched.

    Attributes:
        input_ids, is_masked, position_ids: [1, n]; aux: [1, n, 3H]; attn_mask: dense bool [n, n] or BlockMask;
        sel: [m] int64 indices of the charged (supervised, owned) elements; target: [T, Vd] target
        logits of the row (a view, not a copy); target_index: [m] int64 row of `target` of each
        charged element; weight: [m] float; depth: [m] int64.
    """

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    input_ids: Tensor
    aux: Tensor
    is_masked: Tensor
    position_ids: Tensor
    attn_mask: Any
    sel: Tensor
    target: Tensor
    target_index: Tensor
    weight: Tensor
    depth: Tensor


class DraftObjective(nn.Module):
    """The module DDP wraps: `forward(unit) -> (loss_sum, CodMetrics)` (sum over the charged elements)."""

    def __init__(self, draft: PEagleDraft, num_depths: int, autocast_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.draft = draft
        self.num_depths = num_depths
        self.autocast_dtype = autocast_dtype

    def forward(self, unit: UnitInputs) -> tuple[Tensor, CodMetrics]:
        dev = unit.input_ids.device
        ctx = (
            torch.autocast(dev.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            hidden = self.draft(unit.input_ids, unit.aux, unit.is_masked, unit.position_ids, unit.attn_mask)
            x = self.draft.norm(hidden[0].index_select(0, unit.sel))  # [m, H]
            # lm_head + KL fused in row chunks: no [m, Vd] logits / probability tensor is materialised
            return head_loss_sums(
                x, self.draft.lm_head.weight, unit.target, unit.target_index, unit.weight, unit.depth,
                self.num_depths,
            )


def plan_rows(
    batch: dict[str, Tensor], settings: StepSettings, *, epoch: int, index: int, row_ids: list[int]
) -> list[FlatRow]:
    """COD draw + flat assembly of every row of a (rank-local) micro-batch, on the batch's device.

    Args:
        batch: the micro-batch (rows = `row_ids`, global row numbers within the micro-batch).
        settings: step settings.
        epoch, index: the micro-batch's position (with `row_ids`, the key of each row's COD draw).
        row_ids: global row number of each local row.
    """
    rows = []
    for b, gid in enumerate(row_ids):
        gen = cod_generator(settings.seed, epoch, index, gid)
        anchor, depth = sample_cod(
            batch["loss_mask"][b],
            settings.num_depths,
            settings.down_sample_ratio,
            settings.down_sample_ratio_min,
            document_ids=batch["document_ids"][b],
            max_anchors=settings.max_anchors,
            generator=gen,
        )
        rows.append(
            build_flat_row(
                batch["input_ids"][b], batch["loss_mask"][b], batch["document_ids"][b], anchor, depth,
                settings.mask_token_id,
            )
        )
    return rows


def _unit_specs(rows: list[FlatRow], seq_len: int, num_segments: int) -> list[tuple[int, FlatRow]]:
    """(row index, segment row) of every segment that owns at least one supervised element."""
    out = []
    for b, row in enumerate(rows):
        for seg in plan_segments(row, seq_len, num_segments):
            sub = segment_row(row, seg)
            if bool((sub.weight > 0).any()):
                out.append((b, sub))
    return out


def _build_unit(batch: dict[str, Tensor], b: int, sub: FlatRow, settings: StepSettings) -> UnitInputs:
    if settings.attention == "sdpa":
        check_dense_fits(sub.num_elements)
        # ONE additive float mask shared by every layer (and their backward): SDPA would otherwise turn
        # the bool mask into a float copy per layer and keep each for backward
        mask: Any = additive_mask(mask_for(sub), settings.autocast_dtype or torch.float32)  # [n, n]
        # cut into query groups here, so the full [n, n] mask is freed before the forward
        mask = group_queries(mask, sub.ref_pos) or mask
    else:
        mask = block_mask_for(sub)
    sel = torch.nonzero(sub.weight > 0).reshape(-1)  # [m]
    ref_sel = sub.ref_pos.index_select(0, sel)  # [m]
    return UnitInputs(
        input_ids=sub.input_ids[None],
        aux=batch["aux"][b].index_select(0, sub.ref_pos)[None],  # [1, n, 3H]
        is_masked=sub.is_masked[None],
        position_ids=sub.ref_pos[None],
        attn_mask=mask,
        sel=sel,
        target=batch["target_logits"][b],  # [T, Vd]
        target_index=ref_sel,
        weight=sub.weight.index_select(0, sel),
        depth=sub.depth.index_select(0, sel),
    )


def _dummy_unit(draft: PEagleDraft, device: torch.device, attention: str) -> UnitInputs:
    """One unsupervised element (weight 0): a zero-valued backward that touches every parameter."""
    cfg = draft.config
    pos = torch.zeros(1, 1, dtype=torch.long, device=device)
    if attention == "sdpa":
        mask: Any = torch.ones(1, 1, dtype=torch.bool, device=device)
    else:
        z = torch.zeros(1, dtype=torch.long, device=device)
        one = FlatRow(z, z, z, z, z.bool(), z.float(), z)
        mask = block_mask_for(one)
    return UnitInputs(
        input_ids=pos, aux=torch.zeros(1, 1, 3 * cfg.hidden_size, device=device),
        is_masked=torch.zeros(1, 1, dtype=torch.bool, device=device), position_ids=pos, attn_mask=mask,
        sel=torch.zeros(1, dtype=torch.long, device=device),
        target=torch.zeros(1, cfg.draft_vocab_size, device=device), target_index=pos[0],
        weight=torch.zeros(1, device=device), depth=torch.zeros(1, dtype=torch.long, device=device),
    )


@contextlib.contextmanager
def sparse_embedding_grad(draft: PEagleDraft) -> Any:
    """Make the embedding backward yield a sparse row gradient for the duration.

    Each backward then adds only the looked-up rows (`[n, H]` values, a sparse COO tensor) to
    `embed_tokens.weight.grad` instead of a dense `[V, H]` gradient (113 MB at V = 49152, H = 576);
    `coalesce_embedding_grad` sums duplicate rows after each backward so the gradient stays as small as
    the distinct tokens seen. An existing dense `.grad` keeps accumulating densely (autograd adds the
    sparse rows into it).
    """
    weight = draft.embed_tokens.weight
    if not weight.requires_grad:
        yield
        return
    previous = draft.sparse_embedding_grad
    draft.sparse_embedding_grad = True
    try:
        yield
    finally:
        draft.sparse_embedding_grad = previous


def coalesce_embedding_grad(draft: PEagleDraft) -> None:
    """Sum the duplicate rows of a sparse embedding gradient (one row per distinct token)."""
    grad = draft.embed_tokens.weight.grad
    if grad is not None and grad.is_sparse and not grad.is_coalesced():
        draft.embed_tokens.weight.grad = grad.coalesce()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the C library the process already uses
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)  # glibc only


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim(0)`); False where unavailable.

    A unit's activations are freed after its backward, but glibc returns only the top of its heap, and
    long-lived blocks allocated between units (gradients, oneDNN kernel caches) pin the rest, so the
    resident heap of a partitioned run keeps growing from step to step (T=2048, K=8, S=4 on CPU, peak
    RSS over 6 steps: 2.4 GB without, 1.96 GB with a release after every unit). The cost is that the
    next unit faults its pages in again (+20% CPU time per step there), hence only when partitioning,
    i.e. when memory was asked for.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_micro_batch(
    objective: nn.Module,
    draft: PEagleDraft,
    batch: dict[str, Tensor],
    rows: list[FlatRow],
    settings: StepSettings,
    *,
    scale: Tensor | float | None,
    sync: bool = True,
    times: StepTimes | None = None,
) -> CodMetrics:
    """Forward (and backward when `scale` is not None) of every unit of a micro-batch.

    Args:
        objective: `DraftObjective` or its DDP wrapper (DDP: `no_sync` on all units but the last when
            `sync`, on all units otherwise).
        draft: the raw draft (for the dummy element of a rank with nothing supervised).
        batch: the rank-local micro-batch on the device.
        rows: `plan_rows(batch, ...)`.
        settings: step settings.
        scale: multiplier of each unit's loss sum before backward, i.e. world_size / (global
            denominator * grad_accumulation); None = forward only (evaluation, no grad).
        sync: whether this micro-batch ends the optimizer step (DDP all-reduces on its last unit).
        times: accumulates forward/backward seconds.

    Returns:
        The micro-batch's metric sums (rank-local).
    """
    device = batch["input_ids"].device
    seq_len = int(batch["input_ids"].shape[1])
    metrics = CodMetrics.zeros(settings.num_depths, device=device)
    units: list[tuple[int, FlatRow] | None] = list(_unit_specs(rows, seq_len, settings.sequence_partitions))
    backward = scale is not None
    if backward and not units and sync:
        units = [None]  # zero backward keeps DDP's collectives aligned
    no_sync = getattr(objective, "no_sync", None)
    grads = sparse_embedding_grad(draft) if backward else contextlib.nullcontext()
    with grads:
        for i, spec in enumerate(units):
            unit = _dummy_unit(draft, device, settings.attention) if spec is None else _build_unit(
                batch, spec[0], spec[1], settings
            )
            last = i == len(units) - 1
            ctx = no_sync() if (no_sync is not None and backward and not (sync and last)) else contextlib.nullcontext()
            with ctx:
                t0 = time.perf_counter()
                if backward:
                    loss_sum, m = objective(unit)
                else:
                    with torch.no_grad():
                        loss_sum, m = objective(unit)
                _sync(device)
                t1 = time.perf_counter()
                if backward:
                    (loss_sum * (0.0 if spec is None else scale)).backward()
                    coalesce_embedding_grad(draft)
                    _sync(device)
                t2 = time.perf_counter()
            if times is not None:
                times.forward += t1 - t0
                times.backward += t2 - t1
            if spec is not None:
                metrics = metrics + m
            del unit
            if backward and settings.release_memory and device.type == "cpu":
                release_free_memory()
    return metrics


def weight_sum(rows: list[FlatRow]) -> Tensor:
    """Total supervision weight of (rank-local) rows: float32 scalar, unclamped (0 when none).

    The micro-batch denominator is the SUM of this over ranks, clamped >= `LOSS_EPS`
    (`peagle.flat.loss_denominator` for a single process).
    """
    if not rows:
        return torch.zeros(())
    return torch.stack([r.weight.sum() for r in rows]).sum()
