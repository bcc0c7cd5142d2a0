"""Fixtures of the P-EAGLE core tests (COD, masks, segments, loss)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every test here runs with one torch thread (see `one_torch_thread` in tests/conftest.py)."""
