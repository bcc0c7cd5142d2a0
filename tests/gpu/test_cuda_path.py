"""The CUDA training path (compiled flex attention, bf16 autocast), checked on a lent GPU machine.

Skipped where there is no CUDA device (CI, these CPU machines); `bash bench/gpu.sh` runs it there.
The draft has head_dim 32, so flex attention goes through the compiled (Inductor) kernel, not eager flex.
What is compared, all on the GPU:
- flex (BlockMask) against the dense-mask SDPA path: the same loss and gradients in fp32;
- S=4 sequence partitions against S=1 with flex: the same loss and gradients (exact partitioning);
- bf16 autocast against fp32: the loss within 2%, gradients pointing the same way;
- the Trainer end to end on CUDA (flex + bf16): it learns a learnable source.
"""

from __future__ import annotations

import pytest
import torch

from peagle.builtin import build_tiny_llama
from peagle.cod.rows import loss_denominator
from peagle.model.draft import DraftConfig, PEagleDraft
from peagle.model.initialization import init_from_target
from peagle.spec import parse_spec
from peagle.train.batch import SyntheticBatchSource
from peagle.train.loop import Trainer
from peagle.train.step import DraftObjective, StepSettings, plan_rows, run_micro_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu.sh)"),
    # Dynamo reads `.grad` of a non-leaf while it traces flex_attention's input checks (torch 2.11)
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"),
]

V, VD, H, HEADS, KV_HEADS = 512, 128, 128, 4, 2  # head_dim 32: the compiled flex kernel
CUDA = torch.device("cuda")


def _draft(seed: int = 0) -> PEagleDraft:
    target = build_tiny_llama(vocab_size=V, hidden_size=H, num_heads=HEADS, num_kv_heads=KV_HEADS,
                              num_layers=2, seed=seed)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:: V // VD] = True
    cfg = DraftConfig.from_target(target.config, num_layers=2, draft_vocab_size=VD, mask_token_id=3,
                                  aux_layer_ids=[0, 1, 1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = PEagleDraft(cfg)
    init_from_target(draft, target, t2d)
    return draft.to(CUDA)


def _source(num_batches: int = 2, seq_len: int = 256, learnable: bool = False) -> SyntheticBatchSource:
    return SyntheticBatchSource(num_batches=num_batches, batch_size=2, seq_len=seq_len, hidden_size=H,
                                vocab_size=V, draft_vocab_size=VD, seed=0, num_docs=3, pad=5,
                                learnable=learnable)


def _settings(attention: str, segments: int = 1, dtype: torch.dtype | None = None) -> StepSettings:
    return StepSettings(num_depths=4, down_sample_ratio=0.8, down_sample_ratio_min=0.3, max_anchors=None,
                        sequence_partitions=segments, mask_token_id=3, attention=attention,
                        autocast_dtype=dtype, seed=7)


def _loss_and_grads(draft: PEagleDraft, settings: StepSettings) -> tuple[float, dict[str, torch.Tensor]]:
    batch = {k: v.to(CUDA) for k, v in _source().batch(0, 0).items()}
    draft.zero_grad(set_to_none=True)
    objective = DraftObjective(draft, settings.num_depths, settings.autocast_dtype)
    rows = plan_rows(batch, settings, epoch=0, index=0, row_ids=[0, 1])
    den = loss_denominator(rows)
    m = run_micro_batch(objective, draft, batch, rows, settings, scale=1.0 / den)
    torch.cuda.synchronize()
    grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad).float().clone()
             for n, p in draft.named_parameters() if p.grad is not None}
    return float(m.loss_sum / den), grads


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_flex_matches_the_dense_mask_in_fp32() -> None:
    draft = _draft()
    loss_sdpa, g_sdpa = _loss_and_grads(draft, _settings("sdpa"))
    loss_flex, g_flex = _loss_and_grads(draft, _settings("flex"))
    assert loss_flex == pytest.approx(loss_sdpa, rel=1e-4)
    assert set(g_flex) == set(g_sdpa) == {n for n, _ in draft.named_parameters()}
    for name in g_sdpa:
        torch.testing.assert_close(g_flex[name], g_sdpa[name], rtol=1e-3, atol=1e-6, msg=name)


def test_flex_partitions_are_exact() -> None:
    draft = _draft()
    loss1, g1 = _loss_and_grads(draft, _settings("flex", segments=1))
    loss4, g4 = _loss_and_grads(draft, _settings("flex", segments=4))
    assert loss4 == pytest.approx(loss1, rel=1e-4)
    for name in g1:
        assert torch.isfinite(g1[name]).all(), name
        torch.testing.assert_close(g4[name], g1[name], rtol=1e-3, atol=1e-6, msg=name)


def test_bf16_autocast_tracks_fp32() -> None:
    draft = _draft()
    loss32, g32 = _loss_and_grads(draft, _settings("flex"))
    loss16, g16 = _loss_and_grads(draft, _settings("flex", dtype=torch.bfloat16))
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    for name in g32:
        assert g16[name].dtype == torch.float32, name  # fp32 master weights
        if g32[name].norm() > 0:
            assert _cos(g16[name], g32[name]) > 0.98, name


def test_trainer_learns_on_cuda_with_flex_and_bf16() -> None:
    spec = parse_spec({
        "target": {"model": "builtin:tiny-llama"},
        "data": {"sources": [{"path": "builtin:sharegpt"}], "max_length": 256},
        "draft": {"num_layers": 2, "draft_vocab_size": VD},
        "peagle": {"num_depths": 2, "sequence_partitions": 2},
        "optim": {"lr": 1e-2, "epochs": 30, "pack_length": 256, "schedule": "constant", "warmup_ratio": 0.0,
                  "micro_batch_size": 2},
        "checkpoints": {"every_steps": 1_000_000},
        "eval": {"prompt_sets": []},
        "resources": {"device": "cuda", "gpus": 1, "attention": "flex", "precision": "bf16"},
    })
    result = Trainer(spec, _draft(), _source(num_batches=1, learnable=True), device="cuda").train()
    assert len(result.losses) == 30
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert result.losses[-1] < 0.75 * result.losses[0]
