"""run_sync: the engine clients' coroutines run from synchronous code, inside a running loop or not."""

from __future__ import annotations

import asyncio
import threading

import pytest

from peagle.engine.aio import run_sync


async def _where() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


async def _boom() -> None:
    raise ValueError("from the coroutine")


def test_without_a_loop_it_runs_here() -> None:
    assert run_sync(_where()) == threading.current_thread().name


def test_inside_a_running_loop_it_runs_in_a_thread_of_its_own() -> None:
    async def caller() -> str:
        return run_sync(_where())  # a synchronous call made while this loop runs

    assert asyncio.run(caller()).startswith("peagle-aio")


@pytest.mark.parametrize("in_loop", [False, True])
def test_the_coroutine_s_exception_propagates(in_loop: bool) -> None:
    async def caller() -> None:
        run_sync(_boom())

    with pytest.raises(ValueError, match="from the coroutine"):
        asyncio.run(caller()) if in_loop else run_sync(_boom())
