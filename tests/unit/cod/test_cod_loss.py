"""KL loss and count-based COD metrics (docs/decisions.md decision 5, docs/algorithm.md 1.11)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.cod.loss import LOSS_EPS, CodMetrics, cod_loss_sums, kl_per_position, tau_sim
from peagle.cod.rows import FlatRow, build_flat_row, loss_denominator


def test_kl_shapes_zero_and_formula() -> None:
    g = torch.Generator().manual_seed(0)
    d = torch.randn(2, 3, 11, generator=g)
    t = torch.randn(2, 3, 11, generator=g)
    kl = kl_per_position(d, t)
    assert kl.shape == (2, 3) and kl.dtype == torch.float32
    p = t.softmax(-1)
    expected = (p * (t.log_softmax(-1) - d.log_softmax(-1))).sum(-1)
    torch.testing.assert_close(kl, expected)
    assert bool((kl > 0).all())
    torch.testing.assert_close(kl_per_position(t, t), torch.zeros(2, 3))
    assert kl_per_position(d.bfloat16(), t.bfloat16()).dtype == torch.float32
    # a target with zero-probability entries (-inf logits) contributes 0 there, not NaN
    t_inf = t.clone()
    t_inf[..., 0] = float("-inf")
    assert torch.isfinite(kl_per_position(d, t_inf)).all()


def test_tau_sim() -> None:
    assert float(tau_sim(torch.tensor([0.5, 0.4, 0.2]))) == pytest.approx(0.74)
    assert float(tau_sim(torch.ones(4))) == 4.0
    assert float(tau_sim(torch.tensor([0.0, 1.0]))) == 0.0


def test_worked_example() -> None:
    # logits chosen so that KL values are whatever they are; accuracy pattern [hit, miss, hit]
    draft = torch.tensor([[2.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    target = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    weight = torch.ones(3)
    depth = torch.tensor([0, 0, 1])
    loss_sum, m = cod_loss_sums(draft, target, weight, depth, 2)
    kl = kl_per_position(draft, target)
    assert float(loss_sum) == pytest.approx(float(kl.sum()))
    assert m.acc_sum.tolist() == [1.0, 1.0] and m.acc_total.tolist() == [2.0, 1.0]
    out = m.finalize()
    assert out["loss"] == pytest.approx(float(kl.sum()) / 3)
    assert out["acc_0"] == 0.5 and out["acc_1"] == 1.0
    assert out["full_acc"] == pytest.approx(2 / 3) and out["tau_sim"] == pytest.approx(1.0)
    assert set(out) == {"loss", "acc_0", "acc_1", "full_acc", "tau_sim"}


def test_supervision_independent_of_draft_vocab() -> None:
    # SF's case: draft logits over a 2-token draft vocab; the target's full-vocab argmax of the third
    # element is outside the draft vocab. NeMo/our rule: it is still supervised (counted).
    draft = torch.tensor([[0.0, 4.0], [4.0, 0.0], [0.0, 4.0]])
    target_full = torch.tensor([[0.0, 5.0, 1.0, 0.0], [0.0, 1.0, 5.0, 0.0], [5.0, 0.0, 1.0, 0.0]])
    t2d = torch.tensor([False, True, True, False])
    target = target_full[:, t2d]  # restricted to the draft vocab, renormalised by the softmax
    _, m = cod_loss_sums(draft, target, torch.ones(3), torch.zeros(3, dtype=torch.long), 1)
    assert m.acc_total.tolist() == [3.0]
    assert target.argmax(-1).tolist() == [0, 1, 1] and draft.argmax(-1).tolist() == [1, 0, 1]
    assert m.acc_sum.tolist() == [1.0]  # SF would drop element 2 (count 2); we keep it (count 3)


def test_zero_supervision_is_finite() -> None:
    m = CodMetrics.zeros(3)
    out = m.finalize()
    assert out == {"loss": 0.0, "acc_0": 0.0, "acc_1": 0.0, "acc_2": 0.0, "full_acc": 0.0, "tau_sim": 0.0}
    empty = FlatRow(*(torch.zeros(0, dtype=torch.long) for _ in range(7)))
    assert float(loss_denominator([empty])) == pytest.approx(LOSS_EPS)
    assert float(loss_denominator([])) == pytest.approx(LOSS_EPS)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), k=st.integers(1, 5), split=st.integers(0, 30), seed=st.integers(0, 2**31 - 1))
def test_sums_are_additive(n: int, k: int, split: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    draft, target = torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)
    weight = (torch.rand(n, generator=g) < 0.7).float()
    depth = torch.randint(0, k, (n,), generator=g)
    whole_sum, whole = cod_loss_sums(draft, target, weight, depth, k)
    split = min(split, n)
    a_sum, a = cod_loss_sums(draft[:split], target[:split], weight[:split], depth[:split], k)
    b_sum, b = cod_loss_sums(draft[split:], target[split:], weight[split:], depth[split:], k)
    torch.testing.assert_close(a_sum + b_sum, whole_sum)
    merged = CodMetrics.from_stacked(a.stacked() + b.stacked())
    assert torch.equal(merged.acc_sum, whole.acc_sum) and torch.equal(merged.acc_total, whole.acc_total)
    fin, fin_whole = merged.finalize(), whole.finalize()
    assert fin.keys() == fin_whole.keys()
    for key, value in fin.items():
        assert value == pytest.approx(fin_whole[key], rel=1e-5, abs=1e-7)
    total = float(weight.sum())
    assert fin["loss"] == pytest.approx(float(whole_sum) / max(total, LOSS_EPS), rel=1e-5, abs=1e-7)
    acc = [fin[f"acc_{d}"] for d in range(k)]
    assert fin["tau_sim"] == pytest.approx(sum(math.prod(acc[: i + 1]) for i in range(k)), rel=1e-6, abs=1e-9)


def test_denominator_is_shared_over_rows() -> None:
    ids = torch.arange(6)
    rows = [
        build_flat_row(ids, torch.tensor(m), None, torch.arange(6), torch.zeros(6, dtype=torch.long), 9)
        for m in ([0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0])
    ]
    assert float(loss_denominator(rows)) == 7.0
