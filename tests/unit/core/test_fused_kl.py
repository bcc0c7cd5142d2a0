from __future__ import annotations

import torch


def test_fused_kl_matches_autograd_reference() -> None:
    import torch.nn.functional as F

    from peagle.loss import kl_per_position

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
