"""COD sampling and sequence-partition assignment (docs/decisions.md decisions 3 and 9, docs/algorithm.md 1.7 and 1.12).

A COD element e = (anchor a_e, depth d_e) has the reference position o_e = a_e + d_e. Depth 0 holds
every position of the row; a depth-d element (d >= 1) extends a chain a, a+1, ..., a+d whose
references a+1..a+d are supervised positions of the same document as a.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["assign_segments", "sample_cod"]


def _randperm(n: int, generator: torch.Generator | None) -> Tensor:
    """`torch.randperm(n)` from `generator` (or the global RNG when None), on CPU."""
    if generator is None:
        return torch.randperm(n)
    return torch.randperm(n, generator=generator)


def sample_cod(
    loss_mask: Tensor,
    num_depths: int,
    down_sample_ratio: float = 0.7,
    down_sample_ratio_min: float = 0.2,
    *,
    document_ids: Tensor | None = None,
    max_anchors: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Draw the COD elements of one row (NeMo variant + same-document rule + `max_anchors`).

    Algorithm (one random draw per depth, in this order; loops over depths only):

    1. `valid` = supervised positions (loss_mask != 0 and document id != -1), ascending.
       `seeds` = `valid`, or, if `max_anchors < |valid|`, a sorted random subset of `max_anchors`
       of them (`randperm(|valid|)[:max_anchors]`, drawn before any depth).
    2. depth-1 pool = seeds o with o >= 1 and doc(o-1) == doc(o) (no negative anchor, no chain
       starting in the previous document).
    3. For d = 1..K-1: `n_keep = floor(max(0, |seeds| - d) * max(r**d, r_min))`; stop when 0.
       If `|pool| >= n_keep`: chosen = sorted `pool[randperm(|pool|)[:n_keep]]`, else chosen = pool.
       Emit (chosen - d, d). Next pool = {o + 1 : o in chosen, o + 1 < T, valid(o+1),
       doc(o+1) == doc(o)}.

    With one document this is exactly the reference sampler of docs/algorithm.md 1.7 (there position 0 is
    filtered from the depth-1 pool and `(o + 1) mod T == 0` is dropped, the same sets).

    Worked example: T=8, loss_mask all ones, K=4, r = r_min = 1 (deterministic, every draw is a
    full permutation of the pool): seeds = 0..7, pool = 1..7. d=1: n_keep = 7*1 = 7 = |pool|, chosen
    1..7 -> anchors 0..6; next pool = 2..7 (8 is out of the row). d=2: n_keep = 6, chosen 2..7 ->
    anchors 0..5; d=3: n_keep = 5, chosen 3..7 -> anchors 0..4. Output anchors
    `[0..7, 0..6, 0..5, 0..4]`, depths `[0]*8 + [1]*7 + [2]*6 + [3]*5`. With two documents
    `[0,0,0,1,1,1]` (K=3, r=r_min=1) position 3 leaves the depth-1 pool (doc(2) != doc(3)) and the
    chain at reference 2 stops at depth 1 (doc(3) != doc(2)): anchors `[0..5, 0,1,3,4, 0,3]`.

    Args:
        loss_mask: `[T]` or `[1, T]` shifted loss mask (0/1, any dtype).
        num_depths: K >= 1.
        down_sample_ratio: r in (0, 1].
        down_sample_ratio_min: r_min in [0, 1].
        document_ids: `[T]` (or `[1, T]`) int64 document of each position, -1 for padding; None =
            one document spanning the row.
        max_anchors: cap on chains (seeds) per row; None = no cap.
        generator: CPU `torch.Generator` for reproducible draws; None = the global RNG.

    Returns:
        `(anchor_pos, depth)`: int64 `[N]` on `loss_mask.device`, grouped by depth (depth 0 =
        `arange(T)` first), sorted by anchor within a depth.
    """
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    if max_anchors is not None and max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1 or None, got {max_anchors}")
    device = loss_mask.device
    lm = loss_mask.detach().reshape(-1).cpu()  # [T]
    t = lm.numel()
    if document_ids is None:
        doc = torch.zeros(t, dtype=torch.long)  # [T]
    else:
        doc = document_ids.detach().reshape(-1).cpu().long()  # [T]
        if doc.numel() != t:
            raise ValueError(f"document_ids has {doc.numel()} positions, loss_mask has {t}")
    sup = (lm != 0) & (doc >= 0)  # [T] bool
    valid = torch.nonzero(sup).reshape(-1)  # [V] ascending
    seeds = valid
    if max_anchors is not None and valid.numel() > max_anchors:
        pick = _randperm(valid.numel(), generator)[:max_anchors]
        seeds = valid[pick].sort().values  # [max_anchors]
    # doc(o-1) == doc(o), evaluated at o >= 1 only (position 0 has no predecessor).
    same_as_prev = torch.zeros(t, dtype=torch.bool)  # [T]
    same_as_prev[1:] = doc[1:] == doc[:-1]
    pool = seeds[same_as_prev[seeds]]  # [P] depth-1 reference candidates

    anchors = [torch.arange(t, dtype=torch.long)]
    depths = [torch.zeros(t, dtype=torch.long)]
    n_seeds = int(seeds.numel())
    for d in range(1, num_depths):
        n_keep = math.floor(max(0, n_seeds - d) * max(down_sample_ratio**d, down_sample_ratio_min))
        if n_keep <= 0:
            break
        if pool.numel() >= n_keep:
            pick = _randperm(int(pool.numel()), generator)[:n_keep]
            chosen = pool[pick].sort().values  # [n_keep]
        else:
            chosen = pool
        if chosen.numel() == 0:
            break
        anchors.append(chosen - d)
        depths.append(torch.full_like(chosen, d))
        nxt = chosen + 1  # [n] candidate references one deeper, same chains
        nxt = nxt[nxt < t]
        pool = nxt[sup[nxt] & same_as_prev[nxt]]
    anchor_pos = torch.cat(anchors).to(device)  # [N]
    depth = torch.cat(depths).to(device)  # [N]
    return anchor_pos, depth


def assign_segments(anchor_pos: Tensor, depth: Tensor, seq_len: int, num_segments: int) -> Tensor:
    """Segment of every COD element: `clamp(floor(p * S / T), 0, S - 1)` (docs/algorithm.md 1.12 closed form).

    `p = a` for depth 0 and `p = a + 1` for depth >= 1: a depth-1 element is bucketed by its
    reference position and deeper elements inherit their depth-1 ancestor's bucket (same anchor).

    Worked example (T=8, S=3; boundaries 0, 8/3, 16/3, 8): depth-0 anchors 0..7 -> p*3//8 =
    0,0,0,1,1,1,2,2; depth-1 anchor 2 -> p=3 -> 9//8 = 1; depth-3 anchor 2 -> also p=3 -> 1;
    depth-1 anchor 4 -> p=5 -> 15//8 = 1; an out-of-row anchor 8 at depth 0 -> 24//8 = 3 -> clamped 2.

    Args:
        anchor_pos: `[N]` int64.
        depth: `[N]` int64.
        seq_len: T >= 1, the padded row length.
        num_segments: S >= 1.

    Returns:
        `[N]` int64 segment ids in `[0, S)`.

    Raises:
        ValueError: `num_segments < 1` or `seq_len < 1`.
    """
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    p = anchor_pos.long() + (depth > 0).long()  # [N]
    return torch.div(p * num_segments, seq_len, rounding_mode="floor").clamp(0, num_segments - 1)
