"""run_sync: the engine clients' coroutines run from synchronous code, inside a running loop or not.

Each case runs in a thread of its own, where no loop runs unless the case starts one: the test session's
main thread may have one running already (Playwright's sync API keeps its loop marked as running), which is
the very situation `run_sync` exists for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from peagle.engine.aio import run_sync

T = TypeVar("T")


def _fresh_thread(fn: Callable[[], T]) -> T:
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="case") as pool:
        return pool.submit(fn).result()


async def _where() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


async def _boom() -> None:
    raise ValueError("from the coroutine")


def test_without_a_loop_it_runs_in_the_calling_thread() -> None:
    assert _fresh_thread(lambda: (run_sync(_where()), threading.current_thread().name)) == ("case_0", "case_0")


def test_inside_a_running_loop_it_runs_in_a_thread_of_its_own() -> None:
    async def caller() -> str:
        return run_sync(_where())  # a synchronous call made while this loop runs

    assert _fresh_thread(lambda: asyncio.run(caller())).startswith("peagle-aio")


def test_the_main_thread_of_this_session_works_either_way() -> None:
    assert run_sync(_where()) in (threading.current_thread().name, "peagle-aio_0")


@pytest.mark.parametrize("in_loop", [False, True])
def test_the_coroutine_s_exception_propagates(in_loop: bool) -> None:
    async def caller() -> None:
        run_sync(_boom())

    with pytest.raises(ValueError, match="from the coroutine"):
        _fresh_thread(lambda: asyncio.run(caller()) if in_loop else run_sync(_boom()))
