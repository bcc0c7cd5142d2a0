"""Offline fixtures: real SmolLM2 folder, tiny target, ShareGPT and HumanEval from wheels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle import builtin


def test_smollm2_folder_is_a_real_llama(smollm2_path: Path) -> None:
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["hidden_size"] == 576 and cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152
    assert (smollm2_path / "model.safetensors").stat().st_size > 100_000_000
    assert (smollm2_path / ".complete").exists()
    # idempotent: a second call returns the same folder without rebuilding
    assert builtin.smollm2_dir() == smollm2_path


def test_smollm2_chat_template_renders(smollm2_tokenizer) -> None:
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], tokenize=False
    )
    assert "<|im_start|>assistant" in text and "hello<|im_end|>" in text


def test_tiny_target_loads(tiny_target_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_path), dtype=torch.float32)
    assert model.config.num_hidden_layers == 4
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, model.config.vocab_size)


def test_build_tiny_llama_is_deterministic() -> None:
    import torch

    a = builtin.build_tiny_llama(vocab_size=128, seed=3)
    b = builtin.build_tiny_llama(vocab_size=128, seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)


def test_sharegpt_and_humaneval_data() -> None:
    path = builtin.sharegpt_path()
    assert path.stat().st_size > 100_000_000
    with path.open("rb") as fh:
        assert fh.read(1) == b"["
    prompts = builtin.humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0]["task_id"] == "HumanEval/0" and "def " in prompts[0]["prompt"]
    assert len(builtin.humaneval_prompts(limit=5)) == 5


def test_resolvers(tmp_path: Path) -> None:
    assert builtin.resolve_data_path("builtin:sharegpt") == builtin.sharegpt_path()
    assert builtin.resolve_data_path("dataset:ds_1", tmp_path) == tmp_path / "ds_1" / "data"
    with pytest.raises(ValueError, match="no dataset root"):
        builtin.resolve_data_path("dataset:ds_1")
    with pytest.raises(ValueError, match="unknown builtin"):
        builtin.resolve_target("builtin:nope")
    assert builtin.resolve_target("org/model-on-hub") == "org/model-on-hub"
    assert builtin.resolve_target(str(tmp_path)) == tmp_path


def test_concurrent_builds_are_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    calls = []

    def build(d: Path) -> None:
        calls.append(1)
        (d / "f").write_text("x")

    dest = tmp_path / "thing"
    threads = [threading.Thread(target=builtin._build_once, args=(dest, build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert (dest / "f").read_text() == "x" and (dest / ".complete").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def build(d: Path) -> None:
        (d / "half").write_text("x")
        raise RuntimeError("boom")

    dest = tmp_path / "thing"
    with pytest.raises(RuntimeError):
        builtin._build_once(dest, build)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["thing.lock"]
