"""The suite's two lanes: `make test` (every test) and `make test-fast` (no real engine, worker stack or browser).

`tests/conftest.py` marks the heavy tests `heavy` at collection (`is_heavy`); the fast lane runs
`-m "not heavy"` with `PEAGLE_TEST_LANE=fast`, where vLLM's interpreter is `VLLM_TRIPWIRE` and a worker stack
refuses to start, so a heavy test that does not say so fails there instead of slowing the lane down.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["HEAVY_FIXTURES", "HEAVY_MARKERS", "VLLM_TRIPWIRE", "fast_lane", "is_heavy", "vllm_python_to_read"]

#: Fixtures that start real Celery worker processes (a worker stack): their tests are heavy.
HEAVY_FIXTURES = frozenset({"make_stack", "stack"})
#: Markers of heavy tests (pyproject's `markers` says what each means).
HEAVY_MARKERS = ("slow", "e2e")
#: The interpreter vLLM is started with in the fast lane: it fails, naming the lane.
VLLM_TRIPWIRE = Path(__file__).resolve().with_name("vllm_tripwire.sh")


def fast_lane() -> bool:
    """Whether this run is the fast lane (`make test-fast` sets `PEAGLE_TEST_LANE=fast`)."""
    return os.environ.get("PEAGLE_TEST_LANE", "") == "fast"


def is_heavy(item: pytest.Item) -> bool:
    """A test that starts a real engine, a worker stack or a browser (by its markers and fixtures)."""
    if any(item.get_closest_marker(name) for name in HEAVY_MARKERS):
        return True
    return bool(HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())))


def vllm_python_to_read() -> Path | None:
    """vLLM's interpreter for a test that only reads vLLM's installed files (never runs it): the real one in
    the fast lane too, where `peagle.engine.locate.vllm_python` answers the tripwire."""
    from peagle.engine.locate import vllm_python

    found = vllm_python()
    if found == VLLM_TRIPWIRE:
        real = Path(__file__).resolve().parents[2] / ".vllm-venv" / "bin" / "python"
        return real if real.is_file() else None
    return found
