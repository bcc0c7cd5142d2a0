"""One micro-batch of P-EAGLE training: COD per row, sequence-partitioned forward+backward.

Per micro-batch (docs/algorithm.md 1.12, docs/decisions.md decisions 5 and 9):

1. each row draws its COD elements ONCE, from a `torch.Generator` seeded by (seed, epoch, index, row),
   so a resumed run and every segment see the same draw;
2. ONE loss denominator for the micro-batch: the supervised elements of all its rows (all ranks);
3. every row is split into S segments (`peagle.cod.rows.plan_segments`, the closed form of docs/algorithm.md 1.12); each
   segment ("unit") runs one forward (through `DraftObjective`, the module DDP wraps) and one backward of
   `loss_sum * scale`. Gradients add up to those of the flat forward (S = 1 is the single flat forward).
   With S > 1 the depth-0 context is CARRIED instead of recomputed with grad (the recompute form of docs/algorithm.md 1.12, as NeMo
   does it, keeps all T depth-0 elements' activations alive in the last segment, ~0.5x of S = 1 at K=8):
   one no-grad forward over the row's depth-0 elements (a causal prefix of every segment) records every
   layer's post-RoPE keys / values; the segments then run from the last one that owns a supervised
   element down to segment 0, each forwarding ONLY its owned elements, which attend to the context
   through those keys / values as leaf tensors. Each backward's gradient on the context keys / values
   is added into per-row buffers and injected into the keys / values of the depth-0 elements when the
   segment that owns them runs (`peagle.model.attention.KVCarry`), so a segment that owns nothing supervised still
   runs when later ones depended on it. Every element is forwarded with grad exactly once; exactness is
   tested against S = 1 (docs/decisions.md decision 9). Forward-only (evaluation) units keep the recompute form and skip
   segments that own nothing supervised;
4. only the supervised elements of a unit go through the final norm, `lm_head` and the KL, fused in row
   chunks (`peagle.cod.loss.head_loss_sums`: no [m, Vd] tensor).

Attention: `StepSettings.attention` (the backend the trainer chose once, `select_attention`) decides the
form of every unit's mask, built once per unit before its forward, which uses it as given. SDPA (CPU):
an additive float mask cut into `QueryGroups` (block-sparse SDPA), so no [n, n] mask stays alive during
the forward, or, when grouping would not pay, kept whole with its depth-0 prefix (`DenseMask.split`);
flex (CUDA): a `BlockMask`.

The embedding gradient is a sparse COO tensor of the looked-up rows, coalesced after every backward
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
from typing import Any, assert_never

import torch
from torch import Tensor, nn

from peagle.cod.loss import CodMetrics, head_loss_sums
from peagle.cod.mask import additive_mask, check_dense_fits
from peagle.cod.rows import (
    FlatRow,
    block_mask_for,
    build_flat_row,
    mask_for,
    plan_segments,
    segment_row,
    subset_row,
)
from peagle.cod.sampling import sample_cod
from peagle.model.attention import AttentionBackend, AttnMask, KVCarry, group_queries, prepare_dense
from peagle.model.draft import PEagleDraft

__all__ = [
    "EVAL_EPOCH",
    "DraftObjective",
    "StepSettings",
    "StepTimes",
    "UnitInputs",
    "add_feature_noise",
    "coalesce_embedding_grad",
    "cod_generator",
    "noise_generator",
    "plan_rows",
    "release_free_memory",
    "run_micro_batch",
    "sparse_embedding_grad",
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
    attention: AttentionBackend  # SDPA (dense mask) or FLEX (BlockMask); a plain "sdpa" / "flex" is converted
    autocast_dtype: torch.dtype | None  # bf16 on CUDA, None = fp32
    seed: int
    depth_decay: float = 1.0  # gamma: a depth-d element's loss weight is gamma**d (`build_flat_row`)
    # CPU: give the heap's free pages back to the OS after every unit's backward (`release_free_memory`)
    release_memory: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", AttentionBackend(self.attention))


@dataclass
class StepTimes:
    """Seconds spent per phase (summed over units)."""

    fetch: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def _row_key(seed: int, epoch: int, index: int, row: int) -> int:
    return (((seed * 1_000_003 + epoch) * 1_000_033 + index) * 65_537 + row) % (2**63 - 1)


def cod_generator(seed: int, epoch: int, index: int, row: int) -> torch.Generator:
    """CPU generator of the COD draw of global row `row` of micro-batch (epoch, index)."""
    return torch.Generator().manual_seed(_row_key(seed, epoch, index, row))


def noise_generator(seed: int, epoch: int, index: int, row: int) -> torch.Generator:
    """CPU generator of the feature noise of global row `row` of micro-batch (epoch, index): keyed like
    `cod_generator`, on a stream of its own."""
    return torch.Generator().manual_seed((_row_key(seed, epoch, index, row) * 31 + 17) % (2**63 - 1))


def add_feature_noise(aux: Tensor, amplitude: float, generators: list[torch.Generator]) -> Tensor:
    """EAGLE's training noise on the target features, scaled to each state's own size.

    Args:
        aux: [B, T, 3H] captured aux states (any float dtype; padding slots are zero).
        amplitude: a; each element gets u * a * rms, u ~ U(-1, 1), where rms is the RMS of that token's aux
            state (one of the 3) over its H channels, so a zero (padding) state stays zero.
        generators: one CPU generator per row (`noise_generator`): a row's noise does not depend on which
            rank or micro-batch holds it, so DDP, partitioning and resume see the same draw.

    Returns:
        [B, T, 3H] float32.
    """
    b, t, h3 = aux.shape
    x = aux.float().reshape(b, t, 3, h3 // 3)  # [B, T, 3, H]
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 3, 1]
    u = torch.stack([torch.rand(t, 3, h3 // 3, generator=g) for g in generators]).to(x.device) * 2 - 1
    return (x + u * amplitude * rms).reshape(b, t, h3)


class UnitInputs:
    """Inputs of one forward (a segment of a row). A plain class so DDP passes it through untouched.

    Attributes:
        input_ids, is_masked, position_ids: [1, n]; aux: [1, n, 3H]; attn_mask: the prepared mask (`_unit_mask`);
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
    attn_mask: AttnMask
    sel: Tensor
    target: Tensor
    target_index: Tensor
    weight: Tensor
    depth: Tensor
    kv: KVCarry | None = None


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    """Autocast to `dtype` on `device` (bf16 on CUDA), or nothing when `dtype` is None (fp32)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class DraftObjective(nn.Module):
    """The module DDP wraps: `forward(unit) -> (loss_sum, CodMetrics)` (sum over the charged elements)."""

    def __init__(self, draft: PEagleDraft, num_depths: int, autocast_dtype: torch.dtype | None,
                 target_temperature: float = 1.0, logit_mse: float = 0.0) -> None:
        super().__init__()
        self.draft = draft
        self.num_depths = num_depths
        self.autocast_dtype = autocast_dtype
        self.target_temperature = target_temperature  # T of the fitted target distribution (`target_log_probs`)
        self.logit_mse = logit_mse  # lambda of the logit-matching term (`kl_per_position`)

    def forward(self, unit: UnitInputs) -> tuple[Tensor, CodMetrics]:
        dev = unit.input_ids.device
        with _autocast(dev, self.autocast_dtype):
            hidden = self.draft(unit.input_ids, unit.aux, unit.is_masked, unit.position_ids, unit.attn_mask,
                                kv=unit.kv)
            if unit.sel.numel() == 0:
                # a carried segment that owns nothing supervised: its backward still has to pass on the
                # gradient later segments sent to its keys / values (`KVCarry.inject`)
                return hidden.sum() * 0.0, CodMetrics.zeros(self.num_depths, device=dev)
            x = self.draft.norm(hidden[0].index_select(0, unit.sel))  # [m, H]
            # lm_head + KL fused in row chunks: no [m, Vd] logits / probability tensor is materialised
            return head_loss_sums(
                x, self.draft.lm_head.weight, unit.target, unit.target_index, unit.weight, unit.depth,
                self.num_depths, self.target_temperature, self.logit_mse,
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
                settings.mask_token_id, settings.depth_decay,
            )
        )
    return rows


@dataclass(frozen=True)
class SegmentUnit:
    """A segment of a row forwarded whole, context included (S = 1, or forward-only evaluation)."""

    b: int  # row index
    sub: FlatRow  # the segment's input row (`segment_row`)


@dataclass(frozen=True)
class CarriedUnit:
    """One segment of a partitioned row, run with carried context keys (`run_micro_batch`).

    `sub` is the segment's input row (`segment_row`): its first `n_ctx` elements are the depth-0 context
    of earlier segments (not owned), then its owned elements, the first `n_own_d0` of them at depth 0.
    """

    b: int
    sub: FlatRow
    n_ctx: int
    n_own_d0: int
    first: bool  # the first unit of its row: runs the row's context pass


@dataclass(frozen=True)
class DummyUnit:
    """Nothing supervised on this rank: one zero-valued backward keeps DDP's collectives aligned."""


Unit = SegmentUnit | CarriedUnit | DummyUnit


def _unit_specs(rows: list[FlatRow], seq_len: int, num_segments: int) -> list[SegmentUnit]:
    """Every segment that owns at least one supervised element."""
    out = []
    for b, row in enumerate(rows):
        for seg in plan_segments(row, seq_len, num_segments):
            sub = segment_row(row, seg)
            if bool((sub.weight > 0).any()):
                out.append(SegmentUnit(b, sub))
    return out


def _unit_mask(sub: FlatRow, settings: StepSettings, n_ctx: int = 0) -> AttnMask:
    """The attention mask of a unit whose queries are `sub`'s elements from `n_ctx` on: `[n - n_ctx, n]`,
    in the form the chosen backend runs it (the forward uses it as given)."""
    if settings.attention == AttentionBackend.FLEX:
        return block_mask_for(sub, query_offset=n_ctx)
    check_dense_fits(sub.num_elements)
    # ONE additive float mask shared by every layer (and their backward): SDPA would otherwise turn
    # the bool mask into a float copy per layer and keep each for backward
    mask = additive_mask(mask_for(sub)[n_ctx:], settings.autocast_dtype or torch.float32)
    # cut into query groups here, so the full mask is freed before the forward
    if n_ctx == 0:
        return prepare_dense(mask, sub.ref_pos, sub.is_masked)
    # with carried context the queries are not the first keys: query groups or the plain mask, no prefix
    groups = group_queries(mask, sub.ref_pos[n_ctx:])
    return groups if groups is not None else mask


def _build_unit(
    batch: dict[str, Tensor], b: int, sub: FlatRow, settings: StepSettings, n_ctx: int = 0,
    kv: KVCarry | None = None,
) -> UnitInputs:
    """The inputs of one forward over `sub`'s elements from `n_ctx` on (the first `n_ctx` are context
    whose keys / values come through `kv.past`)."""
    mask = _unit_mask(sub, settings, n_ctx)
    own = sub if n_ctx == 0 else subset_row(sub, torch.arange(n_ctx, sub.num_elements, device=sub.depth.device))
    sel = torch.nonzero(own.weight > 0).reshape(-1)  # [m]
    ref_sel = own.ref_pos.index_select(0, sel)  # [m]
    return UnitInputs(
        input_ids=own.input_ids[None],
        aux=batch["aux"][b].index_select(0, own.ref_pos)[None],  # [1, n, 3H]
        is_masked=own.is_masked[None],
        position_ids=own.ref_pos[None],
        attn_mask=mask,
        sel=sel,
        target=batch["target_logits"][b],  # [T, Vd]
        target_index=ref_sel,
        weight=own.weight.index_select(0, sel),
        depth=own.depth.index_select(0, sel),
        kv=kv,
    )


def _carry_specs(rows: list[FlatRow], seq_len: int, num_segments: int) -> list[CarriedUnit]:
    """Per row, segments from the last one that owns a supervised element down to segment 0."""
    out = []
    for b, row in enumerate(rows):
        segs = plan_segments(row, seq_len, num_segments)
        subs = [segment_row(row, seg) for seg in segs]
        charged = [s for s, sub in enumerate(subs) if bool((sub.weight > 0).any())]
        if not charged:
            continue
        last = max(charged)
        for s in range(last, -1, -1):
            seg, sub = segs[s], subs[s]
            n_ctx = int((~seg.owned).sum())
            if bool(seg.owned[:n_ctx].any()) or not bool(seg.owned[n_ctx:].all()):
                raise RuntimeError("segment input is not [context ; owned]")  # plan_segments' order changed
            n_own_d0 = int((sub.depth[n_ctx:] == 0).sum())
            out.append(CarriedUnit(b, sub, n_ctx, n_own_d0, first=s == last))
    return out


def _context_pass(
    draft: PEagleDraft, batch: dict[str, Tensor], b: int, row: FlatRow, settings: StepSettings
) -> tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    """No-grad forward of row `b`'s depth-0 elements (positions 0..T-1, a causal prefix of every
    segment): per layer the post-RoPE `(k, v)` `[1, nkv, T, hd]`, and zeroed fp32 gradient buffers of
    the same shapes."""
    d0 = subset_row(row, torch.nonzero(row.depth == 0).reshape(-1))
    mask = _unit_mask(d0, settings)
    capture: list[tuple[Tensor, Tensor]] = []
    dev = row.depth.device
    with torch.no_grad(), _autocast(dev, settings.autocast_dtype):
        draft(d0.input_ids[None], batch["aux"][b].index_select(0, d0.ref_pos)[None], d0.is_masked[None],
              d0.ref_pos[None], mask, kv=KVCarry(capture=capture))
    grads = [(torch.zeros(k.shape, device=dev), torch.zeros(v.shape, device=dev)) for k, v in capture]
    return capture, grads


def _carry_inputs(
    spec: CarriedUnit, keys: list[tuple[Tensor, Tensor]], grads: list[tuple[Tensor, Tensor]]
) -> KVCarry:
    nc, nd = spec.n_ctx, spec.n_own_d0
    past = [(k[:, :, :nc].detach().requires_grad_(), v[:, :, :nc].detach().requires_grad_()) for k, v in keys]
    inject = [(gk[:, :, nc : nc + nd], gv[:, :, nc : nc + nd]) for gk, gv in grads]
    return KVCarry(past=past if nc else None, inject=inject if nd else None)


def _collect_carried(kv: KVCarry | None, grads: list[tuple[Tensor, Tensor]]) -> None:
    """Add the gradient a unit's backward sent to its context keys / values into the row's buffers."""
    if kv is None or kv.past is None:
        return
    for (k, v), (gk, gv) in zip(kv.past, grads, strict=True):
        n = k.shape[2]
        if k.grad is not None:
            gk[:, :, :n] += k.grad
        if v.grad is not None:
            gv[:, :, :n] += v.grad


def _dummy_unit(draft: PEagleDraft, device: torch.device, attention: AttentionBackend) -> UnitInputs:
    """One unsupervised element (weight 0): a zero-valued backward that touches every parameter."""
    cfg = draft.config
    pos = torch.zeros(1, 1, dtype=torch.long, device=device)
    mask: AttnMask
    if attention == AttentionBackend.FLEX:
        z = torch.zeros(1, dtype=torch.long, device=device)
        one = FlatRow(z, z, z, z, z.bool(), z.float(), z)
        mask = block_mask_for(one)
    else:
        mask = torch.ones(1, 1, dtype=torch.bool, device=device)
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
    backward = scale is not None
    carry = backward and settings.sequence_partitions > 1
    units: list[Unit] = (
        list(_carry_specs(rows, seq_len, settings.sequence_partitions))
        if carry
        else list(_unit_specs(rows, seq_len, settings.sequence_partitions))
    )
    if backward and not units and sync:
        units = [DummyUnit()]  # zero backward keeps DDP's collectives aligned
    no_sync = getattr(objective, "no_sync", None)
    grads = sparse_embedding_grad(draft) if backward else contextlib.nullcontext()
    row_keys: list[tuple[Tensor, Tensor]] = []
    row_grads: list[tuple[Tensor, Tensor]] = []
    with grads:
        for i, spec in enumerate(units):
            match spec:
                case DummyUnit():
                    unit = _dummy_unit(draft, device, settings.attention)
                case CarriedUnit():
                    if spec.first:  # a new row: its depth-0 context keys once, no grad
                        tc = time.perf_counter()
                        row_keys, row_grads = _context_pass(draft, batch, spec.b, rows[spec.b], settings)
                        if times is not None:
                            times.forward += time.perf_counter() - tc
                    unit = _build_unit(batch, spec.b, spec.sub, settings, spec.n_ctx,
                                       _carry_inputs(spec, row_keys, row_grads))
                case SegmentUnit():
                    unit = _build_unit(batch, spec.b, spec.sub, settings)
                case _:
                    assert_never(spec)
            dummy = isinstance(spec, DummyUnit)
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
                    (loss_sum * (0.0 if dummy else scale)).backward()
                    coalesce_embedding_grad(draft)
                    _collect_carried(unit.kv, row_grads)
                    _sync(device)
                t2 = time.perf_counter()
            if times is not None:
                times.forward += t1 - t0
                times.backward += t2 - t1
            if not dummy:
                metrics = metrics + m
            del unit
            if backward and settings.release_memory and device.type == "cpu":
                release_free_memory()
    return metrics
