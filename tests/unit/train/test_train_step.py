"""The partitioned step: exactness (S=4 == S=1), checkpointing parity, mask_hidden grads, refusals."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from train_helpers import tiny_draft, tiny_source

import peagle.train.step as step_mod
from peagle.cod.mask import check_dense_fits
from peagle.cod.rows import loss_denominator
from peagle.errors import ResourceError
from peagle.model.draft import PEagleDraft
from peagle.train.step import (
    DraftObjective,
    StepSettings,
    add_feature_noise,
    cod_generator,
    noise_generator,
    plan_rows,
    run_micro_batch,
)


def _settings(num_segments: int, num_depths: int = 4) -> StepSettings:
    return StepSettings(
        num_depths=num_depths, down_sample_ratio=0.8, down_sample_ratio_min=0.3, max_anchors=None,
        sequence_partitions=num_segments, mask_token_id=3, attention="sdpa", autocast_dtype=None, seed=7,
    )


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.is_sparse else grad.clone()


def _loss_and_grads(draft: PEagleDraft, settings: StepSettings, batch: dict) -> tuple[float, dict, torch.Tensor]:
    draft.zero_grad(set_to_none=True)
    objective = DraftObjective(draft, settings.num_depths, None)
    rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
    den = loss_denominator(rows)
    m = run_micro_batch(objective, draft, batch, rows, settings, scale=1.0 / den)
    emb = draft.embed_tokens.weight.grad
    assert emb.is_sparse and emb.is_coalesced()  # row gradient, duplicates summed after every backward
    grads = {n: _dense(p.grad) for n, p in draft.named_parameters()}
    return float(m.loss_sum / den), grads, m.acc_total


def test_partitioned_step_equals_flat_forward() -> None:
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)
    loss1, g1, tot1 = _loss_and_grads(draft, _settings(1), batch)
    loss4, g4, tot4 = _loss_and_grads(draft, _settings(4), batch)
    assert torch.equal(tot1, tot4)  # every supervised element charged exactly once
    assert loss4 == pytest.approx(loss1, rel=1e-5)
    assert set(g1) == set(g4) and len(g1) == len(list(draft.parameters()))
    for name in g1:
        assert torch.isfinite(g1[name]).all(), name
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("segments", [1, 3])
def test_bf16_features_train_exactly_like_their_fp32_copy(segments: int) -> None:
    """A bf16 target's features (kept bf16 in the batch) give the loss and gradients of their fp32 copy:
    the draft upcasts aux, the loss takes the target logits in fp32 chunk by chunk."""
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    up = {k: v.float() if v.is_floating_point() else v for k, v in low.items()}
    assert low["aux"].dtype == low["target_logits"].dtype == torch.bfloat16
    loss_low, g_low, tot_low = _loss_and_grads(draft, _settings(segments), low)
    loss_up, g_up, tot_up = _loss_and_grads(draft, _settings(segments), up)
    assert torch.equal(tot_low, tot_up)
    assert loss_low == loss_up
    for name in g_up:
        assert g_low[name].dtype == torch.float32, name
        assert torch.equal(g_low[name], g_up[name]), name


def _count_grad_forwards(calls: list) -> object:
    # the no-grad context pass of a partitioned row (`KVCarry`) is never checkpointed: count the others
    return lambda *a: calls.append(1) if torch.is_grad_enabled() else None


def test_gradient_checkpointing_is_identical() -> None:
    draft = tiny_draft()
    batch = tiny_source().batch(0, 1)
    loss_off, g_off, _ = _loss_and_grads(draft, _settings(2), batch)
    calls = []
    hook = draft.layers[1].register_forward_pre_hook(_count_grad_forwards(calls))
    draft.gradient_checkpointing = True
    draft.train()
    loss_on, g_on, _ = _loss_and_grads(draft, _settings(2), batch)
    hook.remove()
    assert loss_on == loss_off
    for name in g_off:
        torch.testing.assert_close(g_on[name], g_off[name], rtol=0, atol=0, msg=name)
    units = len(calls)
    calls.clear()
    hook = draft.layers[1].register_forward_pre_hook(_count_grad_forwards(calls))
    draft.gradient_checkpointing = False
    _loss_and_grads(draft, _settings(2), batch)
    hook.remove()
    assert units == 2 * len(calls)  # recomputed in backward


def test_mask_hidden_gets_finite_nonzero_grad_when_k_ge_2() -> None:
    draft = tiny_draft()
    batch = tiny_source().batch(0, 0)
    _, grads, _ = _loss_and_grads(draft, _settings(1, num_depths=2), batch)
    g = grads["mask_hidden"]
    assert g.shape == (1, 1, 96) and torch.isfinite(g).all() and g.abs().sum() > 0
    _, grads1, _ = _loss_and_grads(draft, _settings(1, num_depths=1), batch)
    assert torch.count_nonzero(grads1["mask_hidden"]) == 0  # in the graph, but no masked slot


def _objective_run(draft: Any, batch: dict[str, torch.Tensor], segments: int,
                   **objective: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One K = 2 micro-batch of rows 0 and 1 through `DraftObjective(**objective)`: (acc_sum, acc_total,
    loss_sum, the lm_head's gradient)."""
    settings = _settings(segments, num_depths=2)
    draft.zero_grad(set_to_none=True)
    rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
    m = run_micro_batch(DraftObjective(draft, 2, None, **objective), draft, batch, rows, settings, scale=1.0)
    return m.acc_sum, m.acc_total, m.loss_sum, _dense(draft.lm_head.weight.grad)


def test_target_temperature_reaches_the_step() -> None:
    """T = 0 through `DraftObjective`: the same elements and hits as T = 1, a different (cross-entropy) loss
    and gradient; partitioning stays exact."""
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)

    def run(temperature: float, segments: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _objective_run(draft, batch, segments, target_temperature=temperature)

    hit1, tot1, loss1, g1 = run(1.0)
    hit0, tot0, loss0, g0 = run(0.0)
    torch.testing.assert_close(tot0, tot1)
    torch.testing.assert_close(hit0, hit1)
    assert float(loss0) != pytest.approx(float(loss1), rel=1e-3)
    assert not torch.allclose(g0, g1)
    _, _, loss0s, g0s = run(0.0, segments=3)
    assert float(loss0s) == pytest.approx(float(loss0), rel=1e-5)
    torch.testing.assert_close(g0s, g0, rtol=1e-4, atol=1e-6)


def test_logit_mse_reaches_the_step() -> None:
    """lambda > 0 through `DraftObjective`: the same elements and hits, a larger loss and another gradient;
    partitioning stays exact."""
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)

    def run(lam: float, segments: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _objective_run(draft, batch, segments, logit_mse=lam)

    hit0, tot0, loss0, g0 = run(0.0)
    hit2, tot2, loss2, g2 = run(2.0)
    torch.testing.assert_close(tot2, tot0)
    torch.testing.assert_close(hit2, hit0)
    assert float(loss2) > float(loss0) * 1.01
    assert not torch.allclose(g2, g0)
    _, _, loss2s, g2s = run(2.0, segments=3)
    assert float(loss2s) == pytest.approx(float(loss2), rel=1e-5)
    torch.testing.assert_close(g2s, g2, rtol=1e-4, atol=1e-6)


def test_depth_decay_reaches_the_step() -> None:
    """gamma = 0.5 through `StepSettings`: each depth's charged weight is gamma**d times the plain count, the
    per-depth accuracies stay the same, and with K = 2 (only depth-1 slots read `mask_hidden`) the
    unnormalised mask_hidden gradient is exactly gamma times the plain one; partitioning stays exact."""
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)

    def run(gamma: float, segments: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        settings = dataclasses.replace(_settings(segments, num_depths=2), depth_decay=gamma)
        draft.zero_grad(set_to_none=True)
        rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
        m = run_micro_batch(DraftObjective(draft, 2, None), draft, batch, rows, settings, scale=1.0)
        return m.acc_sum, m.acc_total, m.loss_sum, _dense(draft.mask_hidden.grad)

    hit1, tot1, loss1, g1 = run(1.0)
    hit5, tot5, loss5, g5 = run(0.5)
    scale = torch.tensor([1.0, 0.5], dtype=tot1.dtype)
    torch.testing.assert_close(tot5, tot1 * scale)
    torch.testing.assert_close(hit5 / tot5, hit1 / tot1)
    assert float(loss5) < float(loss1)
    assert g1.abs().sum() > 0
    torch.testing.assert_close(g5, 0.5 * g1, rtol=1e-5, atol=1e-9)
    _, tot5s, loss5s, g5s = run(0.5, segments=3)
    torch.testing.assert_close(tot5s, tot5)
    assert float(loss5s) == pytest.approx(float(loss5), rel=1e-5)
    torch.testing.assert_close(g5s, g5, rtol=1e-4, atol=1e-8)


def test_zero_backward_when_nothing_is_supervised() -> None:
    draft = tiny_draft()
    batch = tiny_source().batch(0, 0)
    batch["loss_mask"].zero_()
    settings = _settings(2)
    rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
    m = run_micro_batch(DraftObjective(draft, 4, None), draft, batch, rows, settings, scale=1.0)
    assert float(m.acc_total.sum()) == 0
    for name, p in draft.named_parameters():
        assert p.grad is not None and torch.count_nonzero(_dense(p.grad)) == 0, name


def test_rows_too_large_for_the_dense_mask_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_mod, "check_dense_fits", functools.partial(check_dense_fits, limit=40))
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)
    settings = _settings(1)
    rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
    with pytest.raises(ResourceError, match="sequence_partitions"):
        run_micro_batch(DraftObjective(draft, 4, None), draft, batch, rows, settings, scale=1.0)


def test_cod_draw_is_keyed_by_position() -> None:
    batch = tiny_source().batch(0, 0)
    a = plan_rows(batch, _settings(1), epoch=0, index=0, row_ids=[0, 1])
    b = plan_rows(batch, _settings(1), epoch=0, index=0, row_ids=[0, 1])
    c = plan_rows(batch, _settings(1), epoch=1, index=0, row_ids=[0, 1])
    assert all(torch.equal(x.anchor_pos, y.anchor_pos) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x.anchor_pos, y.anchor_pos) for x, y in zip(a, c, strict=True))


def _reference_loss_and_grads(draft: PEagleDraft, settings: StepSettings, batch: dict) -> tuple[float, dict]:
    """The step written plainly: one bool-mask forward per row, materialised logits, dense embedding grad."""
    from peagle.cod.loss import cod_loss_sums
    from peagle.cod.rows import mask_for

    draft.zero_grad(set_to_none=True)
    rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
    den = loss_denominator(rows)
    total = torch.zeros(())
    for b, row in enumerate(rows):
        hidden = draft(row.input_ids[None], batch["aux"][b][row.ref_pos][None], row.is_masked[None],
                       row.ref_pos[None], mask_for(row)[None, None])  # [1, 1, N, N]: never grouped
        sel = torch.nonzero(row.weight > 0).reshape(-1)
        logits = draft.compute_logits(hidden[0][sel])  # [m, Vd]
        target = batch["target_logits"][b][row.ref_pos[sel]]
        loss_sum, _ = cod_loss_sums(logits, target, row.weight[sel], row.depth[sel], settings.num_depths)
        total = total + loss_sum
    (total / den).backward()
    return float(total.detach() / den), {n: p.grad.clone() for n, p in draft.named_parameters()}


def test_fast_paths_equal_the_plain_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Query-grouped attention, fused lm_head + KL and the sparse (row) embedding gradient change no number."""
    import peagle.model.attention as attention_mod

    monkeypatch.setattr(attention_mod, "GROUP_MIN_ELEMENTS", 16)  # tiny rows: group them too
    monkeypatch.setattr(attention_mod, "GROUP_QUERIES", 16)
    grouped = []
    real_group = attention_mod.group_queries

    def spy(*a, **k):
        grouped.append(real_group(*a, **k))
        return grouped[-1]

    # units without carried context group through `prepare_dense`, carried ones in the step itself
    monkeypatch.setattr(attention_mod, "group_queries", spy)
    monkeypatch.setattr(step_mod, "group_queries", spy)
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 2)
    ref_loss, ref_grads = _reference_loss_and_grads(draft, _settings(1), batch)
    assert draft.sparse_embedding_grad is False
    for segments in (1, 4):
        grouped.clear()
        loss, grads, _ = _loss_and_grads(draft, _settings(segments), batch)
        # every unit grouped at S=1; at S=4 a small unit may not be worth it (work > 0.8 of its mask)
        assert grouped and sum(g is not None for g in grouped) >= (len(grouped) if segments == 1 else 2)
        assert not draft.sparse_embedding_grad  # only on inside the step
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-7, msg=name)


def test_carried_context_is_exact_when_early_segments_own_nothing_supervised() -> None:
    """Segments that own no supervised element still pass on the gradient later segments sent to their
    depth-0 keys / values (`KVCarry.inject`); dropping them would lose every gradient of the context."""
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 1)
    batch["loss_mask"][:, :36] = 0  # supervision only in the last quarter: segments 0-2 own none of it
    batch["loss_mask"][:, 36:] = 1
    batch["document_ids"].zero_()  # one document: the early rows are context of the supervised ones
    loss1, g1, tot1 = _loss_and_grads(draft, _settings(1), batch)
    rows = plan_rows(batch, _settings(4), epoch=0, index=0, row_ids=[0, 1])
    specs = step_mod._carry_specs(rows, 48, 4)
    assert [s.n_ctx for s in specs[:4]] == [36, 24, 12, 0] and not bool((specs[1].sub.weight > 0).any())
    loss4, g4, tot4 = _loss_and_grads(draft, _settings(4), batch)
    assert torch.equal(tot1, tot4) and loss4 == pytest.approx(loss1, rel=1e-5)
    for name in g1:
        assert torch.count_nonzero(g1[name]) > 0 or name == "mask_hidden", name
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-4, atol=1e-7, msg=name)


def test_partitioned_units_keep_only_their_own_rows() -> None:
    """With carried context keys a unit's forward runs only over the elements it owns (plus the no-grad
    depth-0 pass per row), so no unit holds activations for the whole depth-0 context."""
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)
    settings = _settings(4)
    rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
    sizes: list[tuple[bool, int]] = []
    hook = draft.layers[0].register_forward_pre_hook(
        lambda _m, args: sizes.append((torch.is_grad_enabled(), int(args[0].shape[1])))
    )
    run_micro_batch(DraftObjective(draft, 4, None), draft, batch, rows, settings, scale=1.0)
    hook.remove()
    grad_sizes = [n for g, n in sizes if g]
    assert sum(grad_sizes) == sum(r.num_elements for r in rows)  # every element forwarded with grad once
    assert [n for g, n in sizes if not g] == [48, 48]  # one context pass per row
    assert max(grad_sizes) < max(r.num_elements for r in rows) // 2


def test_inject_grad_adds_to_the_leading_rows() -> None:
    from peagle.model.attention import _InjectGrad

    x = torch.randn(1, 2, 5, 3, requires_grad=True)
    g = torch.randn(1, 2, 2, 3)
    y = _InjectGrad.apply(x, g)
    (y * 2).sum().backward()
    expect = torch.full_like(x, 2.0)
    expect[:, :, :2] += g
    torch.testing.assert_close(x.grad, expect)


def test_feature_noise_is_relative_bounded_keyed_and_spares_padding() -> None:
    """`add_feature_noise`: |noise| <= a x the RMS of each token's aux state; a zero (padding) state stays
    zero; scaling the features scales the noise; a row's draw depends only on its key."""
    torch.manual_seed(0)
    aux = torch.randn(2, 5, 3 * 8) * torch.tensor([0.1, 1.0, 30.0]).repeat_interleave(8)  # 3 states, 3 sizes
    aux[1, 4] = 0.0  # padding
    gens = lambda: [noise_generator(0, 1, 2, r) for r in (7, 8)]  # noqa: E731
    out = add_feature_noise(aux, 0.2, gens())
    x, y = aux.reshape(2, 5, 3, 8), out.reshape(2, 5, 3, 8)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = y - x
    assert bool((noise.abs() <= 0.2 * rms + 1e-6).all())
    assert float(noise.abs().max()) > 0.1 * float(rms.max())  # it is there, not vanishingly small
    assert bool((out[1, 4] == 0).all())
    torch.testing.assert_close(add_feature_noise(aux * 4, 0.2, gens()), out * 4)
    torch.testing.assert_close(add_feature_noise(aux, 0.2, gens()), out)
    # the draw is keyed by the row's id, not by its slot in the batch
    swapped = add_feature_noise(aux, 0.2, [noise_generator(0, 1, 2, r) for r in (8, 7)])
    torch.testing.assert_close(swapped[:1], add_feature_noise(aux[:1], 0.2, [noise_generator(0, 1, 2, 8)]))
    assert not torch.allclose(swapped[0], out[0])
    assert cod_generator(0, 1, 2, 7).initial_seed() != noise_generator(0, 1, 2, 7).initial_seed()
