"""`TrainSpec.resolve`: the one place derived spec values are decided."""

from __future__ import annotations

import pytest

from peagle.spec import parse_spec, preset


def _spec(**over):
    return parse_spec({"target": {"model": "builtin:tiny-llama"}, **over})


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_values_follow_the_device(cuda: bool) -> None:
    r = _spec().resolve(cuda_available=cuda)
    if cuda:
        assert (r.resources.device, r.resources.precision, r.resources.attention, r.target.dtype) == (
            "cuda", "bf16", "flex", "bfloat16")
    else:
        assert (r.resources.device, r.resources.precision, r.resources.attention, r.target.dtype) == (
            "cpu", "fp32", "sdpa", "float32")
    assert r.eval.num_speculative_tokens == r.peagle.num_depths


def test_explicit_values_win_and_the_input_is_not_changed() -> None:
    spec = _spec(resources={"device": "cpu", "attention": "sdpa"}, target={"model": "x", "dtype": "bfloat16"},
                 eval={"num_speculative_tokens": 2})
    r = spec.resolve(cuda_available=True)
    assert (r.resources.device, r.target.dtype, r.eval.num_speculative_tokens) == ("cpu", "bfloat16", 2)
    assert r.resources.precision == "fp32"  # follows the explicit cpu device, not the available CUDA
    assert spec.resources.precision == "auto" and spec.draft.aux_layer_ids == "auto"


def test_data_facts_and_aux_layers() -> None:
    r = preset("tiny").resolve(cuda_available=False, target_num_layers=30, mask_token_id=7,
                               draft_vocab_size=300, max_steps=9)
    assert r.draft.aux_layer_ids == [2, 15, 27]
    assert (r.draft.mask_token_id, r.draft.draft_vocab_size, r.optim.max_steps) == (7, 300, 9)
    assert preset("tiny").resolve(cuda_available=False, target_num_layers=4).draft.aux_layer_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="outside"):
        _spec(draft={"aux_layer_ids": [1, 2, 40]}).resolve(cuda_available=False, target_num_layers=30)


def test_callers_use_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's device, the target dtype and the API's estimate all come from `resolve`."""
    import torch

    from peagle.spec.hardware import CPU_BF16_FLAGS, read_cpu_flags
    from peagle.spec.schema import TrainSpec
    from peagle.target.loader import resolve_dtype
    from peagle.train.loop import resolve_device
    from service.estimate import estimate

    calls = []
    real = TrainSpec.resolve

    def spy(self, **kw):
        calls.append(kw)
        return real(self, **kw)

    monkeypatch.setattr(TrainSpec, "resolve", spy)
    spec = _spec()
    assert resolve_device(spec).type == ("cuda" if torch.cuda.is_available() else "cpu")
    native_bf16 = bool(read_cpu_flags() & CPU_BF16_FLAGS)  # auto: bf16 only where this CPU runs it natively
    assert resolve_dtype(spec, torch.device("cpu")) == (torch.bfloat16 if native_bf16 else torch.float32)
    n = len(calls)
    estimate(spec, dataset_rows={}, queue="cpu", queue_position=0)
    assert len(calls) > n >= 2
