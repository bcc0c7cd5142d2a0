"""Issue 39: `peagle validate` says when this machine's vLLM cannot run a valid export (vLLM 0.32's CPU
attention takes only some head sizes; the `tiny` preset's head_dim 16 is not one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle.engine.locate import vllm_python
from peagle.engine.machine import (
    CPU_ATTENTION_HEAD_SIZES,
    cpu_head_problems,
    vllm_here_problems,
    vllm_runs_on_cpu,
)
from peagle.export.rules import validate_export
from tests.lane import vllm_python_to_read


def test_head_sizes_match_vllm_cpu_attention() -> None:
    """The table is vLLM's own (`CPUAttentionBackend.get_supported_head_sizes`), read from its source."""
    python = vllm_python_to_read()
    src = None if python is None else next(python.parent.parent.glob(
        "lib/python*/site-packages/vllm/v1/attention/backends/cpu_attn.py"), None)
    if src is None:
        pytest.skip("no vLLM CPU venv here (make vllm-env)")
    text = src.read_text()
    assert f"return {list(CPU_ATTENTION_HEAD_SIZES)}" in text


def test_cpu_head_problems_name_the_model_and_head_dim() -> None:
    tiny = {"hidden_size": 64, "num_attention_heads": 4}
    smol = {"hidden_size": 576, "num_attention_heads": 9}
    got = cpu_head_problems(draft_layer=tiny, verifier=tiny, verifier_name="builtin:tiny-llama")
    assert len(got) == 2 and "builtin:tiny-llama's head_dim 16" in got[0] and "draft layer's head_dim 16" in got[1]
    assert cpu_head_problems(draft_layer=smol, verifier=smol, verifier_name="x") == []
    assert cpu_head_problems(draft_layer={**tiny, "head_dim": 64}, verifier=None, verifier_name=None) == []


def test_valid_export_with_head_dim_16_is_not_runnable_on_cpu_vllm(export_dir: Path) -> None:
    assert validate_export(export_dir) == []  # valid as an export
    python = vllm_python()
    if python is None or not vllm_runs_on_cpu(python):
        assert vllm_here_problems(export_dir) == []
        pytest.skip("this machine's vLLM runs on a GPU (or there is none): nothing to refuse")
    got = vllm_here_problems(export_dir)
    assert any("head_dim 16" in p and "verifier" in p for p in got), got
    assert any("draft layer's head_dim 16" in p for p in got), got
