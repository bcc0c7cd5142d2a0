"""Row-lazy AdamW (== dense AdamW), sparse-aware clipping, checkpoint round trip, heap release."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
from torch import nn
from train_helpers import tiny_draft, tiny_source, tiny_spec

import peagle.train.loop as loop_mod
import peagle.train.step as step_mod
from peagle.cod.rows import loss_denominator
from peagle.train.loop import Trainer
from peagle.train.optim import RowLazyAdamW, clip_grad_norm, grad_rows
from peagle.train.step import DraftObjective, StepSettings, plan_rows, release_free_memory, run_micro_batch

V, H = 97, 24


def _sparse_rows(gen: torch.Generator, step: int, n: int = 30) -> torch.Tensor:
    """An uncoalesced sparse row gradient over a growing subset of the rows (duplicates included)."""
    ids = torch.randint(0, min(V, 20 + 12 * step), (n,), generator=gen)
    return torch.sparse_coo_tensor(ids[None], torch.randn(n, H, generator=gen), (V, H), check_invariants=True)


def _pair(kind: str, wd: float) -> tuple[Any, Any, list[torch.Tensor], list[torch.Tensor]]:
    """Dense torch AdamW and RowLazyAdamW over the same initial table + one ordinary parameter."""
    g = torch.Generator().manual_seed(0)
    table, other = torch.randn(V, H, generator=g), torch.randn(5, 7, generator=g)
    a = [nn.Parameter(table.clone()), nn.Parameter(other.clone())]
    b = [nn.Parameter(table.clone()), nn.Parameter(other.clone())]
    kw: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    kw.update({"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[kind])
    dense = torch.optim.AdamW([{"params": a, "weight_decay": wd}], **kw)
    lazy = RowLazyAdamW([{"params": b, "weight_decay": wd}], row_lazy=[b[0]], **kw)
    return dense, lazy, a, b


@pytest.mark.parametrize("kind", ["fused", "foreach", "loop"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_row_lazy_adamw_equals_dense_adamw(kind: str, wd: float) -> None:
    dense, lazy, a, b = _pair(kind, wd)
    gen = torch.Generator().manual_seed(1)
    for step in range(7):
        sparse = _sparse_rows(gen, step) if step != 3 else torch.sparse_coo_tensor(
            torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, H), (V, H), check_invariants=True)  # no row at all
        other = torch.randn(5, 7, generator=gen)
        b[0].grad, b[1].grad = sparse, other.clone()
        a[0].grad, a[1].grad = sparse.coalesce().to_dense(), other.clone()  # the same values, dense
        dense.step()
        lazy.step()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), step
    state = lazy.state[b[0]]
    # moments only for the rows that ever had a gradient, and fewer than V of them
    ever = torch.nonzero(dense.state[a[0]]["exp_avg_sq"].ne(0).any(1)).reshape(-1)
    assert torch.equal(torch.sort(state["rows"]).values, ever) and state["rows"].numel() < V
    assert state["exp_avg"].shape == (ever.numel(), H) and float(state["step"]) == 7
    order = state["rows"]
    assert torch.equal(state["exp_avg"], dense.state[a[0]]["exp_avg"][order])
    assert torch.equal(state["exp_avg_sq"], dense.state[a[0]]["exp_avg_sq"][order])


def test_row_lazy_takes_a_dense_gradient_too() -> None:
    dense, lazy, a, b = _pair("fused", 0.1)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        g = _sparse_rows(gen, step).coalesce().to_dense()
        a[0].grad, b[0].grad = g.clone(), g.clone()
        a[1].grad, b[1].grad = torch.zeros(5, 7), torch.zeros(5, 7)
        dense.step()
        lazy.step()
    assert torch.equal(a[0], b[0])
    rows, values = grad_rows(b[0].grad)
    assert torch.equal(values, b[0].grad[rows]) and bool(b[0].grad[rows].ne(0).any(1).all())


def _saved(opt: torch.optim.Optimizer) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_row_lazy_state_round_trips_and_resumes_exactly() -> None:
    _, lazy, _, b = _pair("fused", 0.1)
    gen = torch.Generator().manual_seed(3)
    grads = [(_sparse_rows(gen, s), torch.randn(5, 7, generator=gen)) for s in range(6)]
    for g0, g1 in grads[:3]:
        b[0].grad, b[1].grad = g0, g1
        lazy.step()
    saved = _saved(lazy)
    assert saved["state"][0]["rows"].dtype == torch.int64
    resumed_params = [nn.Parameter(p.detach().clone()) for p in b]
    resumed = RowLazyAdamW([{"params": resumed_params, "weight_decay": 0.1}], row_lazy=[resumed_params[0]],
                           lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    resumed.load_state_dict(saved)
    assert resumed.state[resumed_params[0]]["rows"].dtype == torch.int64  # not cast to the param dtype
    for g0, g1 in grads[3:]:
        b[0].grad, b[1].grad = g0, g1
        resumed_params[0].grad, resumed_params[1].grad = g0, g1
        lazy.step()
        resumed.step()
    assert torch.equal(b[0], resumed_params[0]) and torch.equal(b[1], resumed_params[1])


def test_plain_adamw_checkpoint_is_converted() -> None:
    dense, _, a, _ = _pair("fused", 0.1)
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        a[0].grad, a[1].grad = _sparse_rows(gen, step).coalesce().to_dense(), torch.randn(5, 7, generator=gen)
        dense.step()
    b = [nn.Parameter(p.detach().clone()) for p in a]
    lazy = RowLazyAdamW([{"params": b, "weight_decay": 0.1}], row_lazy=[b[0]], lr=1e-2, betas=(0.9, 0.95),
                        eps=1e-8, fused=True)
    lazy.load_state_dict(_saved(dense))
    assert lazy.state[b[0]]["exp_avg"].shape[0] < V  # dense moments -> rows with moments only
    for step in range(3, 6):
        sparse, other = _sparse_rows(gen, step), torch.randn(5, 7, generator=gen)
        a[0].grad, a[1].grad = sparse.coalesce().to_dense(), other.clone()
        b[0].grad, b[1].grad = sparse, other.clone()
        dense.step()
        lazy.step()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("max_norm", [None, 1e6, 0.5])
def test_clip_grad_norm_counts_sparse_rows_exactly(max_norm: float | None) -> None:
    gen = torch.Generator().manual_seed(5)
    sparse = _sparse_rows(gen, 4, n=60)
    others = [torch.randn(5, 7, generator=gen), torch.randn(11, generator=gen)]
    ref = [nn.Parameter(torch.zeros(V, H)), *(nn.Parameter(torch.zeros_like(o)) for o in others)]
    ours = [nn.Parameter(torch.zeros(V, H)), *(nn.Parameter(torch.zeros_like(o)) for o in others)]
    for p, g in zip(ref, [sparse.coalesce().to_dense(), *others], strict=True):
        p.grad = g.clone()
    for p, g in zip(ours, [sparse, *others], strict=True):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm is not None else float("inf"))
    norm = clip_grad_norm(ours, max_norm)
    assert ours[0].grad.is_sparse and ours[0].grad.is_coalesced()  # coalesced in place
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for r, o in zip(ref, ours, strict=True):
        torch.testing.assert_close(o.grad.to_dense(), r.grad, rtol=1e-6, atol=1e-9)
    if max_norm == 0.5:
        assert float(clip_grad_norm(ours, None)) == pytest.approx(0.5, rel=1e-5)


def test_trainer_step_equals_dense_embedding_adamw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sparse embedding grad + row-lazy AdamW + sparse-aware clipping == dense grad + torch AdamW + torch
    clipping, over steps with grad accumulation, active clipping and weight decay."""
    spec = tiny_spec(optim={"max_steps": 3, "epochs": 10, "grad_accumulation": 2, "grad_clip": 0.05,
                            "weight_decay": 0.1}, peagle={"sequence_partitions": 2})
    ours = Trainer(spec, tiny_draft(), tiny_source(num_batches=3))
    assert isinstance(ours.optimizer, RowLazyAdamW)
    ours_result = ours.train()
    assert ours_result.metrics["grad_norm"] > 0.05  # clipping was active
    state = ours.optimizer.state[ours.draft.embed_tokens.weight]
    assert 0 < state["rows"].numel() < ours.draft.embed_tokens.weight.shape[0]

    def dense_adamw(model: nn.Module, optim: Any) -> torch.optim.AdamW:
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() == 2 and n != "mask_hidden"]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and not (p.dim() == 2 and n != "mask_hidden")]
        return torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}],
                                 lr=optim.lr, betas=tuple(optim.betas), eps=1e-8, fused=True)

    monkeypatch.setattr(loop_mod, "build_optimizer", dense_adamw)
    monkeypatch.setattr(loop_mod, "clip_grad_norm", lambda params, clip: torch.nn.utils.clip_grad_norm_(
        params, clip if clip is not None else float("inf"), foreach=True))
    monkeypatch.setattr(step_mod, "sparse_embedding_grad", lambda draft: contextlib.nullcontext())
    ref = Trainer(spec, tiny_draft(), tiny_source(num_batches=3))
    ref_result = ref.train()
    assert not ref.draft.embed_tokens.weight.requires_grad or "rows" not in ref.optimizer.state[
        ref.draft.embed_tokens.weight]
    torch.testing.assert_close(torch.tensor(ours_result.losses), torch.tensor(ref_result.losses), rtol=1e-5, atol=0)
    for name, value in ref.draft.state_dict().items():
        torch.testing.assert_close(ours.draft.state_dict()[name], value, rtol=1e-4, atol=1e-6, msg=name)


def _settings(release: bool) -> StepSettings:
    return StepSettings(
        num_depths=4, down_sample_ratio=0.8, down_sample_ratio_min=0.3, max_anchors=None, sequence_partitions=3,
        mask_token_id=3, attention="sdpa", autocast_dtype=None, seed=7, release_memory=release,
    )


def test_heap_is_released_after_every_unit_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(step_mod, "release_free_memory", lambda: calls.append(1) or True)
    draft = tiny_draft()
    batch = tiny_source(seq_len=48).batch(0, 0)
    for release in (False, True):
        settings = _settings(release)
        rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
        units = sum(1 for b, row in enumerate(rows) for _ in step_mod._unit_specs([row], 48, 3))
        calls.clear()
        run_micro_batch(DraftObjective(draft, 4, None), draft, batch, rows, settings,
                        scale=1.0 / loss_denominator(rows))
        assert len(calls) == (units if release else 0) and units >= 4
        calls.clear()
        run_micro_batch(DraftObjective(draft, 4, None), draft, batch, rows, settings, scale=None)  # eval
        assert not calls
    assert Trainer(tiny_spec(peagle={"sequence_partitions": 2}), tiny_draft(), tiny_source()).settings.release_memory
    assert not Trainer(tiny_spec(), tiny_draft(), tiny_source()).settings.release_memory


def test_release_free_memory_runs_on_glibc() -> None:
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert release_free_memory() is True


def test_trainer_takes_depth_decay_from_the_spec() -> None:
    assert Trainer(tiny_spec(peagle={"depth_decay": 0.5}), tiny_draft(), tiny_source()).settings.depth_decay == 0.5
    assert Trainer(tiny_spec(), tiny_draft(), tiny_source()).settings.depth_decay == 1.0


def test_trainer_takes_target_temperature_from_the_spec() -> None:
    assert Trainer(tiny_spec(peagle={"target_temperature": 0}), tiny_draft(), tiny_source()).objective \
        .target_temperature == 0.0
    assert Trainer(tiny_spec(), tiny_draft(), tiny_source()).objective.target_temperature == 1.0


def test_trainer_takes_logit_mse_from_the_spec() -> None:
    assert Trainer(tiny_spec(peagle={"logit_mse": 2.0}), tiny_draft(), tiny_source()).objective.logit_mse == 2.0
    assert Trainer(tiny_spec(), tiny_draft(), tiny_source()).objective.logit_mse == 0.0


def test_layer_lr_scale_scales_the_decoder_layers_steps_only() -> None:
    """One AdamW step moves each parameter by lr * (wd * p + m_hat / (sqrt(v_hat) + eps)): at the same start
    and data, a layer's step at `layer_lr_scale` s is s times its step at 1, and every other parameter's
    step is unchanged."""
    def one_step(scale: float) -> tuple[dict[str, torch.Tensor], Trainer]:
        spec = tiny_spec(optim={"max_steps": 1, "warmup_ratio": 0.0, "weight_decay": 0.1, "layer_lr_scale": scale})
        trainer = Trainer(spec, tiny_draft(), tiny_source(num_batches=1))
        start = {n: p.detach().clone() for n, p in trainer.draft.named_parameters()}
        trainer.train()
        return {n: p.detach() - start[n] for n, p in trainer.draft.named_parameters()}, trainer

    base, plain = one_step(1.0)
    scaled, split = one_step(0.25)
    assert len(plain.optimizer.param_groups) == 2  # the groups of every earlier run (their checkpoints load)
    assert sorted(g["initial_lr"] for g in split.optimizer.param_groups) == pytest.approx([2.5e-4, 2.5e-4, 1e-3, 1e-3])
    layers = [n for n in base if n.startswith("layers.")]
    assert layers and len(layers) < len(base) and any("fc" in n for n in base if n not in layers)
    for name, delta in base.items():
        assert delta.abs().max() > 0, name  # every parameter moved, so the comparison below means something
        want = delta * 0.25 if name.startswith("layers.") else delta
        torch.testing.assert_close(scaled[name], want, rtol=1e-3, atol=1e-9, msg=name)


def test_build_optimizer_keeps_two_groups_unless_layers_are_scaled() -> None:
    from peagle.train.optim import build_optimizer

    draft = tiny_draft()
    assert [len(g["params"]) for g in build_optimizer(draft, tiny_spec().optim).param_groups] == [
        sum(1 for n, p in draft.named_parameters() if p.dim() == 2 and n != "mask_hidden"),
        sum(1 for n, p in draft.named_parameters() if not (p.dim() == 2 and n != "mask_hidden"))]
    groups = build_optimizer(draft, tiny_spec(optim={"layer_lr_scale": 3.0}).optim).param_groups
    by_id = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert len(by_id) == sum(1 for _ in draft.parameters())  # every parameter once
    for name, p in draft.named_parameters():
        assert by_id[id(p)] == pytest.approx(3e-3 if name.startswith("layers.") else 1e-3), name
