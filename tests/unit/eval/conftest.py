"""One torch thread for the decoder tests: many tiny ops per step, where OpenMP spin-waits on a shared
2-core machine cost 30x (measured 76 s vs 2.5 s for 40 tokens). Restored afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
