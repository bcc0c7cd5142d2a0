"""Fixtures of the trainer tests (builders live in train_helpers.py, shared with subprocess scripts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # 2 shared cores: intra-op threads fight other processes and make tiny matmuls 100x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
