"""The COD attention mask (docs/decisions.md decision 4, docs/algorithm.md 1.9): one predicate, two realisations.

    visible(q, k) = doc(a_q) != -1 AND doc(a_q) == doc(a_k)
                    AND ( (d_k == 0 AND a_k <= a_q)        # causal real context
                          OR (a_k == a_q AND d_k <= d_q) ) # own chain, shallower or equal depth

* `cod_mask_mod` / `block_mask`: flex-attention `mask_mod` and its `BlockMask` (CUDA; flex attention
  has no backward on CPU in torch 2.13/2.14).
* `dense_mask`: the same predicate as a dense `[N, N]` bool tensor for SDPA (CPU). Padding query rows
  see only themselves (`pad_self=True`) so the softmax never runs over an all-masked row (NaN in eager
  and math attention, and NaN * 0 weight is still NaN; torch 2.13's CPU flash SDPA happens to return 0,
  other backends and versions need not); their weight is 0 so they never reach the loss. It is built
  from the COD structure (a range test on the T0 depth-0 columns plus <= K-1 own-chain keys per query),
  about 1.4 s for N = 18k on 2 busy cores, and written once per (segment) row.

CPU memory limit of the dense path (measured with torch 2.13 CPU SDPA, fwd+bwd, GQA 9/3 heads, d=64).
SDPA stores the mask it was given for backward, and a bool mask is first turned into an additive float
mask of the query dtype: passing the same bool mask to L layers keeps L float copies (4 L N^2 bytes:
+0.30 GB for N=4096, L=4). Convert ONCE with `additive_mask` and give that tensor to every layer: then
the row costs 4 N^2 bytes (fp32) plus the transient N^2 bool (measured +0.04 GB for N=4096, L=4, on top
of the 0.07 GB mask). At N = 27,600 (T = 8192, K = 8, r = 0.7, all supervised) that is 3.8 GB.
`MAX_DENSE_ELEMENTS = 32768` elements per (segment) row, about 5.4 GB of masks, leaves room on a 24 GB
machine for the draft's activations and other processes; rows above it are refused by
`check_dense_fits`, whose message suggests `peagle.sequence_partitions` or `peagle.max_anchors`.
In row lengths (K = 8, r = 0.7, r_min = 0.2): N = 3.37 T with every position supervised, 2.53 T for a
realistic packed chat row (68 % supervised; bench/bench_core.py), so unpartitioned rows up to
T = 9,700 (all supervised) to 12,900 (typical) fit; with S sequence partitions the largest segment is
about T (1 + 2.37 / S) elements (all supervised), e.g. T = 16,384 with S = 4.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

from peagle.errors import ResourceError

__all__ = [
    "MAX_DENSE_ELEMENTS",
    "additive_mask",
    "block_mask",
    "check_dense_fits",
    "cod_mask_mod",
    "dense_mask",
    "dense_mask_from_element_docs",
    "mask_mod_from_element_docs",
]

MAX_DENSE_ELEMENTS = 32768
"""Largest flat length N one dense-mask (SDPA, CPU) attention call accepts (about 5 N^2 bytes)."""

_ROW_CHUNK = 2048  # dense mask rows built per step: bounds the temporaries to a few chunk x N tensors


def _element_docs(anchor_pos: Tensor, document_ids: Tensor | None) -> Tensor:
    """`[N]` document of each element's anchor (zeros when `document_ids` is None)."""
    if document_ids is None:
        return torch.zeros_like(anchor_pos, dtype=torch.long)
    return document_ids.reshape(-1).to(device=anchor_pos.device, dtype=torch.long)[anchor_pos.long()]


def mask_mod_from_element_docs(anchor_pos: Tensor, depth: Tensor, element_doc: Tensor) -> Callable:
    """`mask_mod(b, h, q, kv)` of docs/algorithm.md 1.9 given the per-element documents `element_doc` `[N]`."""
    anchor = anchor_pos.long()
    dep = depth.long()
    edoc = element_doc.long()

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        aq, ak = anchor[q_idx], anchor[kv_idx]
        dq, dk = dep[q_idx], dep[kv_idx]
        same_doc = (edoc[q_idx] != -1) & (edoc[q_idx] == edoc[kv_idx])
        context = (dk == 0) & (ak <= aq)
        own_chain = (ak == aq) & (dk <= dq)
        return same_doc & (context | own_chain)

    return mask_mod


def cod_mask_mod(anchor_pos: Tensor, depth: Tensor, document_ids: Tensor | None) -> Callable:
    """Flex-attention `mask_mod(b, h, q_idx, kv_idx) -> bool` of the COD visibility predicate.

    Worked example (SPEC docstring layout, T=6, one document): anchors
    `[0,1,2,3,4,5, 0,1,3,4, 0,3, 0]`, depths `[0]*6 + [1]*4 + [2]*2 + [3]`.
    Element 8 = (a=3, d=1) sees depth-0 anchors <= 3 -> {0,1,2,3} and its own chain at depth <= 1
    -> {8}: {0,1,2,3,8}. Element 11 = (3, 2) adds element 8 (same anchor, depth 1 <= 2) and itself:
    {0,1,2,3,8,11}. Element 12 = (0, 3) sees depth-0 anchor 0 and its chain (0,1), (0,2), (0,3):
    {0,6,10,12}. Element 1 = (1, 0) does not see element 6 = (0, 1) (depth 0 never sees deeper slots).

    Args:
        anchor_pos: `[N]` int64 element anchors.
        depth: `[N]` int64 element depths.
        document_ids: `[T]` int64 document of each row position (-1 padding); None = one document.

    Returns:
        The mask_mod closure (tensors captured on their device).
    """
    return mask_mod_from_element_docs(anchor_pos, depth, _element_docs(anchor_pos, document_ids))


def block_mask(
    anchor_pos: Tensor,
    depth: Tensor,
    document_ids: Tensor | None,
    *,
    device: torch.device | str | None = None,
    block_size: int = 128,
) -> BlockMask:
    """Flex-attention `BlockMask` of the COD predicate (`B=None, H=None, Q_LEN=KV_LEN=N`).

    Meant for CUDA (compiled flex attention). It also builds on CPU, where flex attention runs only
    forward.

    Args:
        anchor_pos: `[N]` int64.
        depth: `[N]` int64.
        document_ids: `[T]` int64 or None (one document).
        device: where to build it; default = `anchor_pos.device`.
        block_size: flex block size.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    dev = anchor_pos.device if device is None else torch.device(device)
    anchor, dep = anchor_pos.to(dev), depth.to(dev)
    docs = None if document_ids is None else document_ids.to(dev)
    n = int(anchor.numel())
    mod = cod_mask_mod(anchor, dep, docs)
    return create_block_mask(mod, None, None, n, n, device=dev, BLOCK_SIZE=block_size)


def _dense_generic(anchor: Tensor, dep: Tensor, edoc: Tensor) -> Tensor:
    """The predicate by broadcasting, in blocks of rows (any element order)."""
    n = int(anchor.numel())
    out = torch.empty(n, n, dtype=torch.bool, device=anchor.device)  # [N, N]
    k_ctx_anchor = torch.where(dep == 0, anchor, torch.full_like(anchor, torch.iinfo(torch.long).max))  # [N]
    for start in range(0, n, _ROW_CHUNK):  # loop over row blocks, vectorised inside
        sl = slice(start, min(start + _ROW_CHUNK, n))
        aq, dq, docq = anchor[sl, None], dep[sl, None], edoc[sl, None]  # [c, 1]
        blk = k_ctx_anchor[None, :] <= aq  # [c, N] depth-0 keys with a_k <= a_q
        blk |= (anchor[None, :] == aq) & (dep[None, :] <= dq)  # own chain
        blk &= edoc[None, :] == docq
        blk &= docq != -1
        out[sl] = blk
    return out


def _context_ranges(anchor: Tensor, dep: Tensor, edoc: Tensor) -> tuple[int, Tensor, Tensor] | None:
    """Depth-0 key range `[lo_q, hi_q]` (in anchors) of every query, if the layout allows it.

    Needs COD order: the depth-0 elements are the first T0 elements, with strictly increasing anchors,
    and each document's depth-0 elements form ONE contiguous run (packed rows). Then the depth-0 keys
    visible to q are exactly the first T0 columns whose anchor lies in
    `[run_start(doc_q), min(a_q, run_end(doc_q))]`. Returns None when the layout does not hold.

    Worked example: depth-0 anchors 0..5 with documents [0,0,0,1,1,-1]: runs doc 0 -> anchors [0,2],
    doc 1 -> [3,4], doc -1 -> [5,5]. Query (a=4, d=2) of doc 1: lo=3, hi=min(4,4)=4 -> columns 3, 4.
    Query (a=1, d=0) of doc 0: lo=0, hi=1 -> columns 0, 1. A padding query gets lo > hi (nothing).
    """
    is0 = dep == 0
    t0 = int(is0.sum())
    if t0 == 0 or not bool(is0[:t0].all()):
        return None
    a0, doc0 = anchor[:t0], edoc[:t0]  # [T0]
    if t0 > 1 and not bool((a0[1:] > a0[:-1]).all()):
        return None
    vals, counts = torch.unique_consecutive(doc0, return_counts=True)  # runs
    if torch.unique(vals).numel() != vals.numel():
        return None  # a document split into several runs
    ends = torch.cumsum(counts, 0) - 1  # [R] index of each run's last element
    run_lo, run_hi = a0[ends - counts + 1], a0[ends]  # [R] anchors
    sorted_vals, order = vals.sort()
    pos = torch.searchsorted(sorted_vals, edoc).clamp(max=vals.numel() - 1)  # [N]
    found = (sorted_vals[pos] == edoc) & (edoc != -1)  # [N]
    run = order[pos]  # [N]
    lo = torch.where(found, run_lo[run], torch.full_like(anchor, 1))  # [N]
    hi = torch.where(found, torch.minimum(anchor, run_hi[run]), torch.zeros_like(anchor))  # [N]
    return t0, lo, hi


def _dense_structured(
    anchor: Tensor, dep: Tensor, edoc: Tensor, ranges: tuple[int, Tensor, Tensor]
) -> Tensor | None:
    """The predicate built from the COD structure (elements in COD order, see `_context_ranges`).

    1. Depth-0 queries x depth-0 keys: block-diagonal causal, one lower-triangular block per document
       run (row q of run [s, e) sees columns s..q = anchors run_start..a_q). Loop over documents.
    2. A deep query's depth-0 columns equal the row of the depth-0 element at its anchor (same anchor,
       same document): copied; computed from `[lo, hi]` only if that element is absent.
    3. Own chain: query (a, d) sees (a, j) for 1 <= j <= d, looked up in an (anchor, depth) -> index
       table. Loop over depths.

    Worked example (SPEC layout, T=6, one document): step 1 fills rows 0..5 with tril(6x6); step 2
    copies row 3 (anchor 3) into rows 8 and 11 -> {0,1,2,3}; step 3 adds j=1 -> element 8 to rows 8
    and 11, j=2 -> element 11 to row 11: row 11 = {0,1,2,3,8,11}.

    Returns:
        `[N, N]` bool, or None if an (anchor, depth) pair repeats (not a COD draw).
    """
    t0, lo, hi = ranges
    n = int(anchor.numel())
    dev = anchor.device
    deep = torch.nonzero(dep > 0).reshape(-1)  # [M] flat indices of depth >= 1
    k = int(dep.max()) + 1
    table = torch.full((int(anchor.max()) + 1, k), -1, dtype=torch.long, device=dev)  # (a, d) -> index
    table[anchor[deep], dep[deep]] = deep
    if int((table >= 0).sum()) != deep.numel():
        return None
    out = torch.zeros(n, n, dtype=torch.bool, device=dev)  # [N, N]
    vals, counts = torch.unique_consecutive(edoc[:t0], return_counts=True)
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    for v, s, e in zip(vals.tolist(), bounds[:-1], bounds[1:], strict=True):  # 1. loop over documents
        if v != -1:
            out[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool, device=dev).tril_()
    a0 = anchor[:t0]  # [T0]
    src = torch.searchsorted(a0, anchor[deep]).clamp(max=t0 - 1)  # [M]
    has_row = a0[src] == anchor[deep]  # [M]
    dst, src = deep[has_row], src[has_row]
    for start in range(0, dst.numel(), _ROW_CHUNK):  # 2. row blocks
        out[dst[start : start + _ROW_CHUNK], :t0] = out[src[start : start + _ROW_CHUNK], :t0]
    missing = deep[~has_row]  # [M'] (only in subsets without the anchor's depth-0 element)
    for start in range(0, missing.numel(), _ROW_CHUNK):
        rows = missing[start : start + _ROW_CHUNK]  # [c]
        out[rows, :t0] = (a0[None, :] >= lo[rows, None]) & (a0[None, :] <= hi[rows, None])
    q = deep[edoc[deep] != -1]  # [M'] real deep queries
    for j in range(1, k):  # 3. loop over depths: q sees its chain's depth-j slot when d_q >= j
        qj = q[dep[q] >= j]
        key = table[anchor[qj], j]  # [m]; -1 where the chain has no depth-j slot (not a COD draw)
        ok = key >= 0
        out[qj[ok], key[ok]] = True
    return out


def dense_mask_from_element_docs(
    anchor_pos: Tensor, depth: Tensor, element_doc: Tensor, *, pad_self: bool = True
) -> Tensor:
    """Dense `[N, N]` bool mask from per-element documents (see `dense_mask`).

    Uses the COD structure (`_context_ranges`, `_dense_structured`) when the elements are in COD
    order with contiguous documents, which every `sample_cod` row and every segment of it is; falls back
    to plain broadcasting otherwise. Both give the predicate exactly (tested against `cod_mask_mod`).
    """
    anchor, dep, edoc = anchor_pos.long(), depth.long(), element_doc.long()
    out = None
    ranges = _context_ranges(anchor, dep, edoc) if anchor.numel() else None
    if ranges is not None:
        out = _dense_structured(anchor, dep, edoc, ranges)
    if out is None:
        out = _dense_generic(anchor, dep, edoc)
    if pad_self:
        pad = torch.nonzero(edoc == -1).reshape(-1)  # [P]
        out[pad, pad] = True
    return out


def dense_mask(
    anchor_pos: Tensor, depth: Tensor, document_ids: Tensor | None, *, pad_self: bool = True
) -> Tensor:
    """The COD predicate as a dense `[N, N]` bool tensor (True = may attend) for SDPA.

    Equal to `cod_mask_mod` evaluated at every (q, kv) pair, except that with `pad_self` a padding
    query (anchor document -1) sees itself, so SDPA returns a finite row (its weight is 0).
    Built from the COD structure (a few memory passes over the N^2 output, no per-pair arithmetic);
    peak extra memory is a few `[2048, N]` bool tensors.

    Worked example (NEMO padding case): anchors `[0,1,2,3]`, depth 0, documents `[0,0,-1,-1]`:
    rows 0, 1 are causal within document 0 ([T,F,F,F], [T,T,F,F]); rows 2, 3 are padding
    queries: [F,F,T,F], [F,F,F,T] with `pad_self`, all False without.

    Args:
        anchor_pos: `[N]` int64.
        depth: `[N]` int64.
        document_ids: `[T]` int64 document of each row position (-1 padding); None = one document.
        pad_self: let padding queries see themselves (no NaN rows).

    Returns:
        `[N, N]` bool on `anchor_pos.device`.
    """
    edoc = _element_docs(anchor_pos, document_ids)
    return dense_mask_from_element_docs(anchor_pos, depth, edoc, pad_self=pad_self)


def additive_mask(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """`[N, N]` additive float mask (0 where visible, -inf elsewhere) of a bool mask, for SDPA.

    Build it once per (segment) row and pass it to every layer: SDPA keeps the mask for backward and
    would otherwise keep one converted float copy per layer (see the module docstring). `dtype` must
    be the query dtype SDPA sees (bf16 under bf16 autocast: then it is 2 N^2 bytes).
    """
    out = torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device)
    return out.masked_fill_(mask, 0.0)


def check_dense_fits(num_elements: int, *, limit: int = MAX_DENSE_ELEMENTS) -> None:
    """Refuse a (segment) row too long for the dense CPU mask path.

    Args:
        num_elements: N, the flat length of the row or segment about to run with a dense mask.
        limit: the largest accepted N (default `MAX_DENSE_ELEMENTS`).

    Raises:
        ResourceError: N > limit; the message names the knobs that shrink N.
    """
    if num_elements > limit:
        gb = 5 * num_elements**2 / 1e9
        raise ResourceError(
            f"flat COD row of {num_elements} elements needs a dense {num_elements}x{num_elements} attention "
            f"mask (~{gb:.1f} GB with SDPA's float copy) on CPU, above the limit of {limit} elements: "
            "set peagle.sequence_partitions (each segment is shorter), peagle.max_anchors (fewer chains) "
            "or a smaller optim.pack_length, or train on a GPU (flex attention)"
        )
