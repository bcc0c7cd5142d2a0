from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(autouse=True)
def _onednn_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the oneDNN kernels, which the product uses on AMD CPUs only: force the route."""
    import peagle.model.cpu_kernels as gemm

    monkeypatch.setattr(gemm, "ONEDNN", True)


def test_the_route_follows_the_cpu_vendor_and_the_override() -> None:
    from peagle.model.cpu_kernels import choose_onednn, cpu_vendor

    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n"
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\n"
    assert cpu_vendor(amd) == "AuthenticAMD" and cpu_vendor(intel) == "GenuineIntel" and cpu_vendor("") == ""
    assert choose_onednn(None, "AuthenticAMD") and not choose_onednn(None, "GenuineIntel")
    assert not choose_onednn("auto", "")
    assert choose_onednn("onednn", "GenuineIntel") and not choose_onednn(" ATEN ", "AuthenticAMD")
    with pytest.raises(ValueError, match="PEAGLE_CPU_GEMM"):
        choose_onednn("cublas", "GenuineIntel")


def test_auto_route_is_what_uses_onednn_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    import peagle.model.cpu_kernels as gemm

    monkeypatch.setattr(gemm, "ONEDNN", None)
    x = torch.zeros(2, 3)
    assert gemm.uses_onednn(x) == (gemm.auto_onednn() and gemm._KERNEL is not None)
    monkeypatch.setattr(gemm, "ONEDNN", False)
    assert not gemm.uses_onednn(x)


@pytest.mark.parametrize("lead", [(7,), (2, 5), (1, 0)])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_linear_matches_f_linear_values_and_grads(lead: tuple[int, ...], grads: tuple[bool, bool]) -> None:
    from peagle.model.cpu_kernels import linear

    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(*lead, 24, generator=g)
    w0 = torch.randn(10, 24, generator=g)
    up = torch.randn(*lead, 10, generator=g)
    outs = []
    for fn in (linear, F.linear):
        x, w = x0.clone().requires_grad_(grads[0]), w0.clone().requires_grad_(grads[1])
        y = fn(x, w)
        (y * up).sum().backward()
        outs.append((y.detach(), x.grad, w.grad))
    (y1, gx1, gw1), (y0, gx0, gw0) = outs
    assert y1.shape == y0.shape
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    for a, b in ((gx1, gx0), (gw1, gw0)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_linear_takes_expanded_and_transposed_gradients() -> None:
    """`sum()` gives an expanded (stride 0) gradient; a transposed input gives a column-major one."""
    from peagle.model.cpu_kernels import linear

    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(16, 9, generator=g).t()  # [9, 16], column-major
    w0 = torch.randn(5, 16, generator=g)
    grads = []
    for fn in (linear, F.linear):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        fn(x, w).sum().backward()
        grads.append((x.grad, w.grad))
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mm_nt_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    import peagle.model.cpu_kernels as gemm

    g = torch.Generator().manual_seed(2)
    a = torch.randn(6, 11, generator=g)
    b = torch.randn(11, 4, generator=g).t()  # [4, 11], column-major
    torch.testing.assert_close(gemm.mm_nt(a, b), a @ b.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm.mm_nt(a.t().contiguous().t(), b), a @ b.t(), rtol=1e-5, atol=1e-5)
    a64, b64 = a.double(), b.double()  # not oneDNN: exactly the ATen product
    assert torch.equal(gemm.mm_nt(a64, b64), a64 @ b64.t())
    assert torch.equal(gemm.linear(a64, b64), F.linear(a64, b64))
    monkeypatch.setattr(gemm, "ONEDNN", False)
    assert torch.equal(gemm.linear(a, b), F.linear(a, b))
    assert torch.equal(gemm.mm_nt(a, b), a @ b.t())


def test_grouped_attention_equals_one_dense_sdpa_call() -> None:
    """fp32 values and q/k/v gradients of the oneDNN grouped kernel == SDPA with the full mask (GQA 4/2)."""
    from peagle.cod.mask import additive_mask
    from peagle.cod.rows import build_flat_row, mask_for
    from peagle.cod.sampling import sample_cod
    from peagle.model.attention import group_queries
    from peagle.model.cpu_kernels import grouped_attention, uses_onednn

    g = torch.Generator().manual_seed(3)
    t = 256
    lm = (torch.rand(t, generator=g) < 0.8).long()
    doc = torch.zeros(t, dtype=torch.long)
    doc[t // 2 :] = 1
    doc[-2:] = -1  # padding: those queries see only themselves
    anchor, depth = sample_cod(lm, 4, 0.8, 0.3, document_ids=doc, generator=g)
    row = build_flat_row(torch.zeros(t, dtype=torch.long), lm, doc, anchor, depth, 7)
    n = row.num_elements
    bool_mask = mask_for(row)  # [N, N]
    q0, k0, v0 = (torch.randn(1, h, n, 16, generator=g) for h in (4, 2, 2))
    up = torch.randn(1, 4, n, 16, generator=g)
    assert uses_onednn(q0, k0, v0)
    for mask in (bool_mask, additive_mask(bool_mask, torch.float32)):
        groups = group_queries(mask, row.ref_pos, group_size=64)
        assert groups is not None and len(groups.groups) > 1
        results = []
        for grouped in (True, False):
            q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
            if grouped:
                out = grouped_attention(q, k, v, groups.groups)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            (out * up).sum().backward()
            results.append((out.detach(), q.grad, k.grad, v.grad))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
