"""The suite's two lanes: `make test` (every test) and `make test-fast` (no real engine, worker stack or browser).

`tests/conftest.py` marks the heavy tests `heavy` at collection (`is_heavy`); the fast lane runs
`-m "not heavy"` with `PEAGLE_TEST_LANE=fast`, where vLLM's interpreter is `VLLM_TRIPWIRE` and a worker stack
refuses to start, so a heavy test that does not say so fails there instead of slowing the lane down.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["HEAVY_FIXTURES", "HEAVY_MARKERS", "VLLM_TRIPWIRE", "fast_lane", "is_heavy", "real_vllm_env",
           "vllm_python_to_read", "vllm_tripwire"]

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


#: What `PEAGLE_VLLM_PYTHON` was before `vllm_tripwire` replaced it (None: unset).
_before_tripwire: list[str | None] = [None]


@contextmanager
def vllm_tripwire() -> Iterator[None]:
    """`PEAGLE_VLLM_PYTHON` is `VLLM_TRIPWIRE` inside the block (the fast lane's session), as it was after."""
    from peagle.engine.locate import VLLM_PYTHON_ENV

    _before_tripwire[0] = os.environ.get(VLLM_PYTHON_ENV)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(VLLM_PYTHON_ENV, str(VLLM_TRIPWIRE))
        yield


def real_vllm_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with `PEAGLE_VLLM_PYTHON` as it was before the tripwire (for a child that must find vLLM)."""
    from peagle.engine.locate import VLLM_PYTHON_ENV

    if env.get(VLLM_PYTHON_ENV) != str(VLLM_TRIPWIRE):
        return env
    out = {k: v for k, v in env.items() if k != VLLM_PYTHON_ENV}
    if _before_tripwire[0] is not None:
        out[VLLM_PYTHON_ENV] = _before_tripwire[0]
    return out


def vllm_python_to_read() -> Path | None:
    """vLLM's interpreter for a test that only reads vLLM's installed files (never runs it): the real one in
    the fast lane too, where `peagle.engine.locate.vllm_python` answers the tripwire."""
    from peagle.engine.locate import VLLM_PYTHON_ENV, vllm_python

    real = real_vllm_env(dict(os.environ)).get(VLLM_PYTHON_ENV)
    with pytest.MonkeyPatch.context() as mp:
        if real is None:
            mp.delenv(VLLM_PYTHON_ENV, raising=False)
        else:
            mp.setenv(VLLM_PYTHON_ENV, real)
        return vllm_python()
