"""Flat-input assembly for one packed row, and the sequence-partition plan (docs/algorithm.md 1.8, 1.12).

The trainer's contract, per micro-batch (B rows) and step::

    anchor, depth = sample_cod(loss_mask[b], K, r, r_min, document_ids=doc[b], generator=g)
    row  = build_flat_row(ids[b], loss_mask[b], doc[b], anchor, depth, mask_token_id)
    den  = loss_denominator([row_0, ..., row_{B-1}])        # ONE denominator for the micro-batch
    for seg in plan_segments(row, T, S):                      # S = 1: one segment with everything
        sub  = segment_row(row, seg)                          # weight zeroed where not owned
        check_dense_fits(sub.num_elements)                    # CPU only (peagle.cod.mask)
        mask = additive_mask(mask_for(sub), q_dtype)          # [n, n] for SDPA, once for all layers
                                                              # (CUDA: block_mask_for(sub) + flex)
        # draft input: embed(sub.input_ids), fc(where(sub.is_masked, mask_hidden, aux[sub.ref_pos])),
        #              position_ids = sub.ref_pos; target rows z'[sub.ref_pos]
        sel  = sub.weight > 0                                 # lm_head + KL only for charged elements
        loss_sum, metrics = cod_loss_sums(draft_logits[sel], target[sel], sub.weight[sel], sub.depth[sel], K)
                                                              # (trainer: lm_head + KL fused, `head_loss_sums`)
        (loss_sum / den).backward()                           # summed over segments == flat loss

Worked example (T=8 all supervised, K=4, r=r_min=1, docs/algorithm.md 1.12): the row has N=26 elements,
anchors `[0..7, 0..6, 0..5, 0..4]`, depths `[0]*8+[1]*7+[2]*6+[3]*5`. With S=2 the segments
(closed form `floor(p*S/T)`, p = anchor for depth 0, anchor+1 deeper) are
`[0,0,0,0,1,1,1,1, 0,0,0,1,1,1,1, 0,0,0,1,1,1, 0,0,0,1,1]`. Segment 0 owns 4+3+3+3 = 13 elements
and its input is exactly those 13 (every depth-0 element it needs, anchors 0..3, it owns). Segment 1
owns the other 13 and its input adds the depth-0 context with segment <= 1, i.e. anchors 0..3 at depth 0
(not owned, weight 0): 17 elements. Each owned query only sees depth-0 anchors <= its own anchor and its
own chain, all of which are in its segment's input (closure), so the hidden states are identical to the
flat forward and the segment losses sum to the flat loss.

The loop above is the plain form (NeMo's phase 3: the context is recomputed with grad in every
segment). The trainer computes the same gradients with less memory: it forwards each segment's owned
elements only and carries the depth-0 context's keys / values and their gradients between segments
(`peagle.train.step`, `peagle.model.attention.KVCarry`, `block_mask_for(..., query_offset=)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

from peagle.cod.loss import LOSS_EPS
from peagle.cod.mask import dense_mask_from_element_docs, mask_mod_from_element_docs
from peagle.cod.sampling import assign_segments

__all__ = [
    "FlatRow",
    "Segment",
    "block_mask_for",
    "build_flat_row",
    "loss_denominator",
    "mask_for",
    "plan_segments",
    "segment_row",
    "subset_row",
    "weight_sum",
]


@dataclass(frozen=True)
class FlatRow:
    """One packed row's COD elements (N = number of elements), in COD order.

    COD order = grouped by depth (all depth 0 first), sorted by anchor within a depth; a subset
    (segment) keeps that order, so every visible key has a flat index <= its query's.

    Attributes:
        anchor_pos: `[N]` int64 anchor a_e (a position of the shifted row).
        depth: `[N]` int64 depth d_e in `[0, K)`.
        ref_pos: `[N]` int64 reference position o_e = a_e + d_e: the RoPE position id, the row of the
            target logits z' and (depth 0) the row of the aux features g'.
        input_ids: `[N]` int64 draft input token: ids'[o_e] at depth 0, mask_token_id at depth >= 1.
        is_masked: `[N]` bool, depth >= 1 (aux input = `mask_hidden` instead of g'[o_e]).
        weight: `[N]` float32 supervision weight loss_mask'[o_e] * depth_decay**d_e (0 on padding; a depth >= 1
            element is always supervised).
        doc: `[N]` int64 document id of the anchor (-1 = padding).
    """

    anchor_pos: Tensor
    depth: Tensor
    ref_pos: Tensor
    input_ids: Tensor
    is_masked: Tensor
    weight: Tensor
    doc: Tensor

    @property
    def num_elements(self) -> int:
        """N, the flat length."""
        return int(self.anchor_pos.numel())

    def to(self, device: torch.device | str) -> FlatRow:
        """The same row with every tensor moved to `device`."""
        return FlatRow(**{k: getattr(self, k).to(device) for k in _FIELDS})


_FIELDS = ("anchor_pos", "depth", "ref_pos", "input_ids", "is_masked", "weight", "doc")


def build_flat_row(
    input_ids: Tensor,
    loss_mask: Tensor,
    document_ids: Tensor | None,
    anchor_pos: Tensor,
    depth: Tensor,
    mask_token_id: int,
    depth_decay: float = 1.0,
) -> FlatRow:
    """Assemble the flat COD input of one row (docs/algorithm.md 1.8).

    Args:
        input_ids: `[T]` (or `[1, T]`) shifted draft input ids, ids'[i] = x[i+1].
        loss_mask: `[T]` shifted loss mask m'[i] = m[i+1] (0/1, any dtype).
        document_ids: `[T]` int64 document of each position, -1 for padding; None = one document.
        anchor_pos: `[N]` int64 from `peagle.cod.sampling.sample_cod`.
        depth: `[N]` int64 from `peagle.cod.sampling.sample_cod`.
        mask_token_id: token id placed in every masked (depth >= 1) slot.
        depth_decay: gamma in (0, 1]; a depth-d element's weight is multiplied by gamma**d
            (docs/decisions.md decision 15; 1 = the count-normalised loss of speculators and NeMo).

    Returns:
        The `FlatRow`. Worked example: T=4, ids' = [10, 11, 12, 13], m' = [0, 1, 1, 1], elements
        (a, d) = (0,0) (1,0) (2,0) (3,0) (1,1) (2,1) (1,2), mask id 99 ->
        ref_pos [0,1,2,3,2,3,3], input_ids [10,11,12,13,99,99,99], weight [0,1,1,1,1,1,1];
        with depth_decay 0.5 the weights are [0,1,1,1,0.5,0.5,0.25].
    """
    if not 0.0 < depth_decay <= 1.0:
        raise ValueError(f"depth_decay must be in (0, 1], got {depth_decay}")
    ids = input_ids.reshape(-1)  # [T]
    lm = loss_mask.reshape(-1)  # [T]
    t = ids.numel()
    doc_t = (
        torch.zeros(t, dtype=torch.long, device=ids.device)
        if document_ids is None
        else document_ids.reshape(-1).to(device=ids.device, dtype=torch.long)
    )
    anchor = anchor_pos.to(device=ids.device, dtype=torch.long)
    dep = depth.to(device=ids.device, dtype=torch.long)
    ref = anchor + dep  # [N]
    if ref.numel() and (int(ref.max()) >= t or int(anchor.min()) < 0):
        raise ValueError(f"COD elements out of range for a row of length {t}")
    is_masked = dep > 0  # [N]
    tok = torch.where(is_masked, torch.full_like(ref, mask_token_id), ids[ref].long())  # [N]
    doc = doc_t[anchor]  # [N]
    # gamma**d is exactly 1.0 everywhere when gamma = 1: the plain count-normalised weights, bit for bit
    weight = (lm[ref] != 0).to(torch.float32) * (doc >= 0).to(torch.float32) * depth_decay ** dep.float()  # [N]
    return FlatRow(anchor, dep, ref, tok, is_masked, weight, doc)


def subset_row(row: FlatRow, index: Tensor) -> FlatRow:
    """The elements `index` (`[n]` int64, sorted ascending to keep COD order) of `row`."""
    return FlatRow(**{k: getattr(row, k)[index] for k in _FIELDS})


@dataclass(frozen=True)
class Segment:
    """One sequence partition of a row (docs/algorithm.md 1.12, causal completion).

    Attributes:
        index: `[n_s]` int64 sorted indices into the row's elements that form this segment's input:
            its owned elements plus every depth-0 element of segment <= s (causal context).
        owned: `[n_s]` bool, True for elements assigned to this segment (only these are charged loss).
    """

    index: Tensor
    owned: Tensor


def plan_segments(row: FlatRow, seq_len: int, num_segments: int) -> list[Segment]:
    """Partition a row's elements into `num_segments` segments (closed form of docs/algorithm.md 1.12).

    Args:
        row: the flat row.
        seq_len: T, the padded row length (the boundaries are multiples of T/S).
        num_segments: S >= 1. S = 1 gives one segment holding every element, all owned.

    Returns:
        S segments (some may own nothing when S is large; the caller may skip those that own no
        supervised element). Every element is owned by exactly one segment.

    Raises:
        ValueError: `num_segments < 1`.
    """
    seg = assign_segments(row.anchor_pos, row.depth, seq_len, num_segments)  # [N]
    is_d0 = row.depth == 0  # [N]
    out = []
    for s in range(num_segments):
        owned = seg == s  # [N]
        take = owned | (is_d0 & (seg <= s))  # [N]
        index = torch.nonzero(take).reshape(-1)  # [n_s], ascending
        out.append(Segment(index=index, owned=owned[index]))
    return out


def segment_row(row: FlatRow, segment: Segment) -> FlatRow:
    """The segment's input row, with `weight` zeroed on the elements it does not own.

    Summing losses (or metrics) over `weight > 0` elements of every segment row counts each
    supervised element of `row` exactly once.
    """
    sub = subset_row(row, segment.index)
    w = sub.weight * segment.owned.to(sub.weight.dtype)  # [n_s]
    return FlatRow(sub.anchor_pos, sub.depth, sub.ref_pos, sub.input_ids, sub.is_masked, w, sub.doc)


def loss_denominator(rows: Sequence[FlatRow]) -> Tensor:
    """The ONE count denominator of a micro-batch: total supervision weight, clamped >= 1e-5.

    Pass the full rows (not segment rows). Scalar float32 tensor on the rows' device.
    """
    return weight_sum(rows).clamp_min(LOSS_EPS)


def weight_sum(rows: Sequence[FlatRow]) -> Tensor:
    """Total supervision weight of (rank-local) rows: float32 scalar, unclamped (0 when none).

    Under DDP the micro-batch denominator is the SUM of this over ranks, clamped >= `LOSS_EPS`
    (`loss_denominator` for a single process).
    """
    if not rows:
        return torch.zeros(())
    return torch.stack([r.weight.sum() for r in rows]).sum()


def mask_for(row: FlatRow, *, pad_self: bool = True) -> Tensor:
    """Dense `[N, N]` bool visibility mask (True = may attend) of a (segment) row, for SDPA.

    Padding queries see only themselves when `pad_self` (no all-masked softmax row, so no NaN);
    their weight is 0, so they never reach the loss. See `peagle.cod.mask.dense_mask`.
    """
    return dense_mask_from_element_docs(row.anchor_pos, row.depth, row.doc, pad_self=pad_self)


def block_mask_for(row: FlatRow, *, block_size: int = 128, query_offset: int = 0) -> BlockMask:
    """Flex-attention `BlockMask` of a (segment) row on the row's device (use on CUDA).

    `query_offset` = Nc > 0: only the elements from Nc on are queries (the first Nc are carried context
    keys, `peagle.model.attention.KVCarry.past`): a `[N - Nc, N]` mask.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    n = row.num_elements
    mod = mask_mod_from_element_docs(row.anchor_pos, row.depth, row.doc)
    if query_offset:
        base = mod

        def mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return base(b, h, q_idx + query_offset, kv_idx)

    return create_block_mask(
        mod, None, None, n - query_offset, n, device=row.anchor_pos.device, BLOCK_SIZE=block_size
    )
