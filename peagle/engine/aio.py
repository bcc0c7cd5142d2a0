"""Running the engine clients' coroutines from synchronous code.

The capture and regeneration clients talk to the engine with asyncio (many requests in flight). Their
synchronous callers may themselves run inside an event loop that is already running in the same thread: a
notebook (Jupyter runs one), or Playwright's synchronous API, which keeps its loop marked as running between
calls. `asyncio.run` refuses there, so `run_sync` runs the coroutine on a fresh loop in a worker thread instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion and return its result, whether or not this thread has a running loop.

    Exceptions raised by the coroutine propagate unchanged.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="peagle-aio") as pool:
        return pool.submit(asyncio.run, coro).result()
