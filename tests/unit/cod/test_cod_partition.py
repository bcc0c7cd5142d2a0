"""Segment assignment, the partition plan, closure, and exact loss/gradient equality across S."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from peagle.cod.loss import CodMetrics, cod_loss_sums
from peagle.cod.mask import additive_mask
from peagle.cod.rows import (
    FlatRow,
    build_flat_row,
    loss_denominator,
    mask_for,
    plan_segments,
    segment_row,
    subset_row,
)
from peagle.cod.sampling import assign_segments, sample_cod

DET_A = [*range(8), *range(7), *range(6), *range(5)]
DET_D = [0] * 8 + [1] * 7 + [2] * 6 + [3] * 5


def _t(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def test_assign_segments_examples() -> None:
    seg = assign_segments(_t([*range(8), 3, 3]), _t([0] * 8 + [1, 2]), 8, 2)
    assert seg.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    seg = assign_segments(torch.arange(12), torch.zeros(12, dtype=torch.long), 12, 4)
    assert bool(((seg >= 0) & (seg < 4)).all())
    assert assign_segments(_t([12]), _t([0]), 12, 4).tolist() == [3]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_segments"):
            assign_segments(_t([0]), _t([0]), 12, bad)


def test_worked_example_s2_s3() -> None:
    a, d = sample_cod(torch.ones(8), 4, 1.0, 1.0, generator=torch.Generator().manual_seed(0))
    assert a.tolist() == DET_A and d.tolist() == DET_D
    s2 = [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1]
    s3 = [0, 0, 0, 1, 1, 1, 2, 2, 0, 0, 1, 1, 1, 2, 2, 0, 0, 1, 1, 1, 2, 0, 0, 1, 1, 1]
    assert assign_segments(a, d, 8, 2).tolist() == s2
    assert assign_segments(a, d, 8, 3).tolist() == s3
    row = build_flat_row(torch.arange(8), torch.ones(8), None, a, d, mask_token_id=50)
    segs = plan_segments(row, 8, 2)
    assert [int(s.owned.sum()) for s in segs] == [13, 13]
    assert [s.index.numel() for s in segs] == [13, 17]
    assert segs[1].index[~segs[1].owned].tolist() == [0, 1, 2, 3]
    one = plan_segments(row, 8, 1)
    assert len(one) == 1 and one[0].index.tolist() == list(range(26)) and bool(one[0].owned.all())
    with pytest.raises(ValueError, match="num_segments"):
        plan_segments(row, 8, 0)


def test_build_flat_row_example() -> None:
    a, d = _t([0, 1, 2, 3, 1, 2, 1]), _t([0, 0, 0, 0, 1, 1, 2])
    row = build_flat_row(_t([10, 11, 12, 13]), _t([0, 1, 1, 1]), None, a, d, mask_token_id=99)
    assert row.ref_pos.tolist() == [0, 1, 2, 3, 2, 3, 3]
    assert row.input_ids.tolist() == [10, 11, 12, 13, 99, 99, 99]
    assert row.weight.tolist() == [0, 1, 1, 1, 1, 1, 1] and row.weight.dtype == torch.float32
    assert row.is_masked.tolist() == [False] * 4 + [True] * 3
    assert row.doc.tolist() == [0] * 7 and row.num_elements == 7
    sub = subset_row(row, _t([1, 4]))
    assert sub.anchor_pos.tolist() == [1, 1] and sub.depth.tolist() == [0, 1]
    with pytest.raises(ValueError, match="out of range"):
        build_flat_row(_t([1, 2]), _t([1, 1]), None, _t([0, 1, 1]), _t([0, 0, 1]), mask_token_id=9)


def test_depth_decay_weights_deeper_elements() -> None:
    a, d = _t([0, 1, 2, 3, 1, 2, 1]), _t([0, 0, 0, 0, 1, 1, 2])
    row = build_flat_row(_t([10, 11, 12, 13]), _t([0, 1, 1, 1]), None, a, d, mask_token_id=99, depth_decay=0.5)
    assert row.weight.tolist() == [0, 1, 1, 1, 0.5, 0.5, 0.25]  # an unsupervised element stays at 0
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="depth_decay"):
            build_flat_row(_t([10, 11]), _t([1, 1]), None, _t([0]), _t([0]), mask_token_id=99, depth_decay=bad)


@st.composite
def packed(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    lengths = draw(st.lists(st.integers(1, 10), min_size=1, max_size=3))
    pad = draw(st.integers(0, 4))
    docs = _t([i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * pad)
    mask = torch.tensor(draw(st.lists(st.integers(0, 1), min_size=len(docs), max_size=len(docs))))
    return mask * (docs >= 0), docs, draw(st.integers(1, 6)), draw(st.integers(0, 2**31 - 1))


def _row(
    mask: torch.Tensor, docs: torch.Tensor, k: int, seed: int, max_anchors: int | None = None
) -> FlatRow:
    g = torch.Generator().manual_seed(seed)
    a, d = sample_cod(mask, k, 0.8, 0.3, document_ids=docs, max_anchors=max_anchors, generator=g)
    ids = torch.randint(0, 20, (mask.numel(),), generator=g)
    return build_flat_row(ids, mask, docs, a, d, mask_token_id=20)


@settings(max_examples=60, deadline=None)
@given(case=packed(), s=st.integers(1, 5))
def test_segment_closure_and_ownership(case: tuple[torch.Tensor, torch.Tensor, int, int], s: int) -> None:
    mask, docs, k, seed = case
    t = mask.numel()
    row = _row(mask, docs, k, seed)
    full = mask_for(row, pad_self=False)  # [N, N]
    segs = plan_segments(row, t, s)
    assert len(segs) == s
    owner_count = torch.zeros(row.num_elements, dtype=torch.long)
    for seg in segs:
        assert torch.equal(seg.index, seg.index.sort().values)
        owner_count[seg.index[seg.owned]] += 1
        present = torch.zeros(row.num_elements, dtype=torch.bool)
        present[seg.index] = True
        # closure: every key visible to any element of the segment's input is in the input
        assert not bool((full[seg.index] & ~present[None, :]).any())
        # the segment's own mask is the flat mask restricted to its elements
        assert torch.equal(mask_for(subset_row(row, seg.index)), mask_for(row)[seg.index][:, seg.index])
    assert bool((owner_count == 1).all())
    charged = sum(float(segment_row(row, seg).weight.sum()) for seg in segs)
    assert charged == float(row.weight.sum())


class ToyDraft(nn.Module):
    """A tiny differentiable stand-in for the draft: embeddings + aux/mask_hidden + 2 attention layers."""

    def __init__(self, vocab: int = 21, dim: int = 8, t: int = 40) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(vocab, dim, generator=g, dtype=torch.float64))
        self.fc = nn.Parameter(torch.randn(dim, 3 * dim, generator=g, dtype=torch.float64) / 4)
        self.mask_hidden = nn.Parameter(torch.randn(3 * dim, generator=g, dtype=torch.float64))
        self.pos = nn.Parameter(torch.randn(t, dim, generator=g, dtype=torch.float64) / 4)
        self.qkv = nn.ParameterList(
            [nn.Parameter(torch.randn(3, dim, dim, generator=g, dtype=torch.float64) / 3) for _ in range(2)]
        )
        self.head = nn.Parameter(torch.randn(7, dim, generator=g, dtype=torch.float64))

    def forward(self, row: FlatRow, aux: torch.Tensor) -> torch.Tensor:
        hid = torch.where(row.is_masked[:, None], self.mask_hidden[None, :], aux[row.ref_pos])  # [n, 3D]
        x = self.embed[row.input_ids] + hid @ self.fc.T + self.pos[row.ref_pos]  # [n, D]
        m = additive_mask(mask_for(row), torch.float64)  # [n, n]
        for w in self.qkv:
            q, k, v = (x @ w[i] for i in range(3))
            x = x + F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=m)[0]
        return x @ self.head.T  # [n, 7]


def _step(model: ToyDraft, rows, auxes, targets, s: int, t: int, k: int):
    model.zero_grad()
    den = loss_denominator(rows)
    total, metrics = 0.0, CodMetrics.zeros(k)
    for row, aux, tgt in zip(rows, auxes, targets, strict=True):
        for seg in plan_segments(row, t, s):
            sub = segment_row(row, seg)
            sel = sub.weight > 0
            if not bool(sel.any()):
                continue
            logits = model(sub, aux)[sel]
            loss_sum, mets = cod_loss_sums(logits, tgt[sub.ref_pos[sel]], sub.weight[sel], sub.depth[sel], k)
            part = loss_sum / den
            part.backward()
            total += float(part.detach())
            metrics = metrics + mets
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads, metrics


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), k=st.integers(2, 5), max_anchors=st.one_of(st.none(), st.integers(2, 8))
)
def test_segment_losses_and_grads_equal_flat(seed: int, k: int, max_anchors: int | None) -> None:
    t = 24
    g = torch.Generator().manual_seed(seed)
    docs = [_t([0] * 10 + [1] * 9 + [-1] * 5), _t([0] * 24)]
    masks = [(torch.rand(t, generator=g) < 0.75).long() * (doc >= 0) for doc in docs]
    rows = [
        _row(m, doc, k, seed + i, max_anchors) for i, (m, doc) in enumerate(zip(masks, docs, strict=True))
    ]
    auxes = [torch.randn(t, 24, generator=g, dtype=torch.float64) for _ in rows]
    targets = [torch.randn(t, 7, generator=g, dtype=torch.float64) for _ in rows]
    model = ToyDraft(t=t)
    ref_loss, ref_grads, ref_metrics = _step(model, rows, auxes, targets, 1, t, k)
    assert set(ref_grads) == {n for n, _ in model.named_parameters()}  # mask_hidden stays in the graph
    for s in (2, 3, 4):
        loss, grads, metrics = _step(model, rows, auxes, targets, s, t, k)
        assert loss == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-8, atol=1e-10)
        assert torch.equal(metrics.acc_total, ref_metrics.acc_total)
        assert torch.equal(metrics.acc_sum, ref_metrics.acc_sum)
    assert float(ref_metrics.acc_total.sum()) == pytest.approx(float(loss_denominator(rows)))
