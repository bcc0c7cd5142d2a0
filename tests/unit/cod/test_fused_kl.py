from __future__ import annotations

import torch


def _head_case(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """37 elements (x [37, 8]) over an lm_head [40, 8], picking 11 shared target rows; K = 3; fp64."""
    m, h, vd, rows, k = 37, 8, 40, 11, 3
    x0 = torch.randn(m, h, generator=g, dtype=torch.float64)
    w0 = torch.randn(vd, h, generator=g, dtype=torch.float64)
    target = torch.randn(rows, vd, generator=g, dtype=torch.float64)
    index = torch.randint(0, rows, (m,), generator=g)
    weight = (torch.rand(m, generator=g) < 0.8).double()
    depth = torch.randint(0, k, (m,), generator=g)
    return x0, w0, target, index, weight, depth, k


def test_fused_kl_matches_autograd_reference() -> None:
    import torch.nn.functional as F

    from peagle.cod.loss import kl_per_position

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        d = torch.randn(7, 33, generator=g, dtype=dtype, requires_grad=True)
        t = torch.randn(7, 33, generator=g, dtype=dtype)
        t[0, 3] = float("-inf")  # a zero-probability target entry
        w = torch.rand(7, generator=g, dtype=dtype)
        fused = kl_per_position(d, t)
        (fused * w).sum().backward()
        g_fused = d.grad.clone()
        d.grad = None
        log_q = F.log_softmax(d, -1)
        p = F.softmax(t, -1)
        ref = torch.where(p > 0, p * (torch.log(p) - log_q), torch.zeros_like(p)).sum(-1)
        (ref * w).sum().backward()
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        assert torch.allclose(fused, ref, rtol=tol, atol=tol)
        assert torch.allclose(g_fused, d.grad, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=tol)


def test_fused_head_matches_materialised_logits(monkeypatch) -> None:
    """lm_head + KL in row chunks == `cod_loss_sums` on the full logits: loss, metrics, both gradients."""
    import peagle.cod.loss as loss_mod
    from peagle.cod.loss import cod_loss_sums, head_loss_sums

    monkeypatch.setattr(loss_mod, "HEAD_CHUNK_BYTES", 16 * 4 * 40)  # 16-row chunks of a 40-wide vocab
    g = torch.Generator().manual_seed(1)
    m, h, vd, t, k = 53, 12, 40, 30, 3  # 53 rows: 3 full chunks + a partial one
    x0 = torch.randn(m, h, generator=g, dtype=torch.float64)
    w0 = torch.randn(vd, h, generator=g, dtype=torch.float64)
    target = torch.randn(t, vd, generator=g, dtype=torch.float64)
    target[4, 7] = float("-inf")  # zero-probability entry
    index = torch.randint(0, t, (m,), generator=g)
    index[0] = 4
    weight = (torch.rand(m, generator=g) < 0.8).double()
    depth = torch.randint(0, k, (m,), generator=g)
    for head_grad in (True, False):  # trainable / frozen lm_head
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_(head_grad)
        ref_loss, ref_m = cod_loss_sums(x @ w.t(), target[index], weight, depth, k)
        (ref_loss * 0.7).backward()
        ref_gx, ref_gw = x.grad, w.grad
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_(head_grad)
        loss, mets = head_loss_sums(x, w, target, index, weight, depth, k)
        (loss * 0.7).backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        for a, b in ((mets.loss_sum, ref_m.loss_sum), (mets.acc_sum, ref_m.acc_sum), (mets.acc_total, ref_m.acc_total)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, ref_gx, rtol=1e-10, atol=1e-12)
        if head_grad:
            torch.testing.assert_close(w.grad, ref_gw, rtol=1e-10, atol=1e-12)
        else:
            assert w.grad is None
    with torch.no_grad():  # forward only (evaluation): same values, no graph
        loss, mets = head_loss_sums(x0, w0, target[index], None, weight, depth, k)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)


def test_target_temperature_fits_a_sharpened_target_or_its_argmax(monkeypatch) -> None:
    """`peagle.target_temperature`: T = 0 is the cross-entropy on the target's argmax, other T the KL to
    softmax(z / T); the fused KL and the fused lm_head + KL match independent autograd references (loss and
    gradients), and the accuracy metric is unchanged (argmax of z / T is argmax of z)."""
    import pytest
    import torch.nn.functional as F

    import peagle.cod.loss as loss_mod
    from peagle.cod.loss import head_loss_sums, kl_per_position, target_log_probs

    z = torch.tensor([[2.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(target_log_probs(z, torch.float64, 0.0), torch.tensor([[0.0, -torch.inf, -torch.inf]],
                                                                                      dtype=torch.float64))
    torch.testing.assert_close(target_log_probs(z, torch.float64, 0.5), F.log_softmax(2 * z, -1))
    torch.testing.assert_close(target_log_probs(z, torch.float64, 1.0), F.log_softmax(z, -1))
    with pytest.raises(ValueError, match="temperature"):
        target_log_probs(z, torch.float64, -0.1)

    def reference(logits, t, temperature):  # plain autograd, written out
        if temperature == 0:
            return F.cross_entropy(logits, t.argmax(-1), reduction="none")
        p = F.softmax(t / temperature, -1)
        return (p * (F.log_softmax(t / temperature, -1) - F.log_softmax(logits, -1))).sum(-1)

    g = torch.Generator().manual_seed(2)
    d0 = torch.randn(9, 21, generator=g, dtype=torch.float64)
    t = torch.randn(9, 21, generator=g, dtype=torch.float64)
    w = torch.rand(9, generator=g, dtype=torch.float64)
    for temperature in (0.0, 0.5, 2.0):
        d = d0.clone().requires_grad_()
        fused = kl_per_position(d, t, temperature)
        (fused * w).sum().backward()
        d_ref = d0.clone().requires_grad_()
        ref = reference(d_ref, t, temperature)
        (ref * w).sum().backward()
        torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(d.grad, d_ref.grad, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(kl_per_position(d0, t, 0.0), kl_per_position(d0, t, 1.0))

    monkeypatch.setattr(loss_mod, "HEAD_CHUNK_BYTES", 16 * 4 * 40)  # several chunks, shared target rows
    x0, w0, target, index, weight, depth, k = _head_case(g)
    accs = []
    for temperature in (0.0, 0.5, 1.0):
        x, head = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss, mets = head_loss_sums(x, head, target, index, weight, depth, k, temperature)
        loss.backward()
        xr, hr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ref = (weight * reference(xr @ hr.t(), target[index], temperature)).sum()
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(head.grad, hr.grad, rtol=1e-10, atol=1e-12)
        accs.append(mets.acc_sum)
    torch.testing.assert_close(accs[0], accs[2])
    torch.testing.assert_close(accs[1], accs[2])


def test_logit_mse_adds_centred_logit_matching(monkeypatch) -> None:
    """`peagle.logit_mse`: each element's loss is KL + lambda * mean_v d_v^2 with d the row-centred gap between
    draft and target logits; the fused KL and the fused lm_head + KL match a plain autograd reference (loss and
    both gradients, with the target rows shared by several elements), the term ignores a logit row's constant
    shift (which no softmax sees), and the accuracy metric does not change."""
    import pytest
    import torch.nn.functional as F

    import peagle.cod.loss as loss_mod
    from peagle.cod.loss import centred_logit_gap, head_loss_sums, kl_per_position

    torch.testing.assert_close(
        centred_logit_gap(torch.tensor([[1.0, 2.0, 3.0]]), torch.zeros(1, 3), torch.float32),
        torch.tensor([[-1.0, 0.0, 1.0]]),
    )

    def reference(logits, t, lam):  # plain autograd, written out
        kl = (F.softmax(t, -1) * (F.log_softmax(t, -1) - F.log_softmax(logits, -1))).sum(-1)
        gap = logits - t
        return kl + lam * (gap - gap.mean(-1, keepdim=True)).pow(2).mean(-1)

    g = torch.Generator().manual_seed(3)
    d0 = torch.randn(9, 21, generator=g, dtype=torch.float64)
    t = torch.randn(9, 21, generator=g, dtype=torch.float64)
    w = torch.rand(9, generator=g, dtype=torch.float64)
    for lam in (0.5, 4.0):
        d = d0.clone().requires_grad_()
        fused = kl_per_position(d, t, 1.0, lam)
        (fused * w).sum().backward()
        d_ref = d0.clone().requires_grad_()
        ref = reference(d_ref, t, lam)
        (ref * w).sum().backward()
        torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(d.grad, d_ref.grad, rtol=1e-10, atol=1e-12)
        with torch.no_grad():  # the unfused (no-grad) path gives the same values
            torch.testing.assert_close(kl_per_position(d0, t, 1.0, lam), ref.detach(), rtol=1e-12, atol=1e-12)
    plain = kl_per_position(d0, t)
    assert (kl_per_position(d0, t, 1.0, 1.0) > plain).all()
    # a constant shift of a row changes neither its softmax nor the centred gap: the loss does not move
    torch.testing.assert_close(kl_per_position(d0 + 5.0, t, 1.0, 2.0), kl_per_position(d0, t, 1.0, 2.0))
    with pytest.raises(ValueError, match="logit_mse"):
        kl_per_position(d0, t, 1.0, -1.0)

    monkeypatch.setattr(loss_mod, "HEAD_CHUNK_BYTES", 16 * 4 * 40)  # several chunks, shared target rows
    x0, w0, target, index, weight, depth, k = _head_case(g)
    accs = []
    for lam in (0.0, 3.0):
        x, head = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss, mets = head_loss_sums(x, head, target, index, weight, depth, k, 1.0, lam)
        loss.backward()
        xr, hr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        ref = (weight * reference(xr @ hr.t(), target[index], lam)).sum()
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mets.loss_sum, ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(head.grad, hr.grad, rtol=1e-10, atol=1e-12)
        accs.append(mets.acc_sum)
        with torch.no_grad():  # forward only (evaluation), unsorted target rows
            loss_eval, _ = head_loss_sums(x0, w0, target[index], None, weight, depth, k, 1.0, lam)
        torch.testing.assert_close(loss_eval, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(accs[0], accs[1])
    with pytest.raises(ValueError, match="logit_mse"):
        head_loss_sums(x0, w0, target, index, weight, depth, k, 1.0, -0.5)
