"""Fixtures of the P-EAGLE core tests (COD, masks, segments, loss)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread avoids OpenMP spin overhead on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
