"""Fixtures of the data/target tests: a tiny in-memory target and small dataset files."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model():
    """4-layer random Llama (hidden 64, vocab 49152 = SmolLM2's tokenizer), fp32, eval."""
    from peagle.builtin import build_tiny_llama

    return build_tiny_llama(vocab_size=49152, seed=0)


@pytest.fixture(scope="session")
def sharegpt_rows() -> list[dict]:
    """The first 40 real ShareGPT rows, read by streaming."""
    from peagle.builtin import sharegpt_path
    from peagle.data.formats import iter_rows

    try:
        path = sharegpt_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return [r.messages for r in iter_rows(path, "auto", max_samples=40)]
