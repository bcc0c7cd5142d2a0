"""Live tail of job events/metrics/logs for SSE streams, with bounded database cost.

One `Tail` per (job, kind) per process, shared by every stream of that job: it reads new rows once
(one cheap `SELECT status, *_seq FROM job` per wake-up, rows only when the sequence moved) into a bounded
in-memory buffer and wakes its subscribers. Wake-ups come from Redis pub/sub (`peagle:job:<id>`, one
`PSUBSCRIBE peagle:job:*` connection per process) when `settings.redis_url` is set, else from polling
every `poll_s` (0.5 s). A subscriber replays from the database after its `Last-Event-ID`, then follows
the buffer; it falls back to the database whenever it is behind the buffer. The database is the truth.

Waiting is lock-free: a tail wakes its subscribers by setting a one-shot `asyncio.Event` and replacing it
(`Tail.signal`). It used an `asyncio.Condition` waited on under `asyncio.wait_for`, whose inner task
re-took the condition's lock after a dropped subscriber had already left the `async with` (Python 3.11,
anyio cancelling twice): `RuntimeError: Lock is not acquired`, and the lock stayed held, so every stream
of the job went silent. A subscriber never waits longer than its keep-alive; a tail that failed, or did
not finish a read for `stale_s`, ends its streams with an `error` (clients reconnect with Last-Event-ID).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import sqlalchemy as sa
from anyio import to_thread

from service.channels import LIVE_PATTERN, job_of_channel, parse_wake
from service.db import repo, states
from service.db.models import Job

__all__ = ["LiveHub", "Tail"]

log = logging.getLogger("peagle.api.live")
BUFFER = 4096
PAGE = 500
GONE = "gone"


class Tail:
    """Shared follower of one (job, kind): `head` = last seq read, `rows` = recent rows (ascending)."""

    def __init__(self, hub: LiveHub, job_id: str, kind: str) -> None:
        self.hub, self.job_id, self.kind = hub, job_id, kind
        self.rows: list[tuple[int, str]] = []  # (seq, JSON text), serialized once for every subscriber
        self.head = -1  # unknown until the first read
        self.status: str | None = None
        self.failed = False  # the last run ended on an error (reported to its subscribers)
        self.beat = time.monotonic()  # when the last read cycle finished
        self.changed = asyncio.Event()  # one-shot: set and replaced by `signal`
        self.wake = asyncio.Event()
        self.users = 0
        self.task: asyncio.Task[None] | None = None

    def signal(self) -> None:
        """Wake every subscriber waiting on the current `changed` event (they take the new one next)."""
        done, self.changed = self.changed, asyncio.Event()
        done.set()

    def after(self, cursor: int) -> list[tuple[int, str]] | None:
        """Buffered rows with seq > cursor, or None if the buffer does not reach back to `cursor`."""
        if self.head < 0 or cursor > self.head:
            return None if self.head < 0 else []
        if not self.rows or self.rows[0][0] > cursor + 1:
            return None if cursor < self.head else []
        lo, hi = 0, len(self.rows)
        while lo < hi:  # first index with seq > cursor
            mid = (lo + hi) // 2
            if self.rows[mid][0] <= cursor:
                lo = mid + 1
            else:
                hi = mid
        return self.rows[lo:]

    async def run(self) -> None:
        col = getattr(Job, repo.SEQ_COLUMNS[self.kind])
        try:
            while self.users > 0:
                self.wake.clear()
                status, seq = await to_thread.run_sync(self._peek, col)
                if seq is None:  # the job row is gone: end every stream of it
                    self.status = GONE
                    return
                before = (self.head, self.status)
                if self.head < 0:
                    self.head = seq
                while seq > self.head:
                    new = await to_thread.run_sync(self._read, self.head)
                    if not new:
                        break
                    self.rows.extend(new)
                    self.head = new[-1][0]
                    if len(self.rows) > BUFFER:
                        del self.rows[: len(self.rows) - BUFFER]
                self.status = status
                self.beat = time.monotonic()
                if (self.head, self.status) != before:
                    self.signal()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.hub.poll_s)
        except Exception:
            self.failed = True
            log.exception("live tail %s/%s failed", self.job_id, self.kind)
        finally:
            self.hub.drop(self)
            self.signal()

    def _peek(self, col: Any) -> tuple[str | None, int | None]:
        with self.hub.sessions() as s:
            row = s.execute(sa.select(Job.status, col).where(Job.id == self.job_id)).first()
        return (None, None) if row is None else (row[0], int(row[1]))

    def _read(self, after: int) -> list[tuple[int, str]]:
        with self.hub.sessions() as s:
            return [self.hub.serialize(self.kind, r) for r in repo.read_rows(s, self.kind, self.job_id,
                                                                               after=after, limit=PAGE)]


class LiveHub:
    """Per-process registry of tails + the Redis wake-up listener."""

    def __init__(self, sessions: Any, serialize: Callable[[str, Any], tuple[int, str]], *,
                 redis: Any = None, poll_s: float = 0.5, stale_s: float = 60.0) -> None:
        self.sessions = sessions
        self.serialize = serialize
        self.redis = redis
        self.poll_s = poll_s if redis is None else max(poll_s, 2.0)
        self.stale_s = stale_s  # a tail whose read cycle is stuck this long ends its streams with an error
        self.tails: dict[tuple[str, str], Tail] = {}
        self._listener: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.redis is not None:
            self._listener = asyncio.create_task(self._listen())

    async def stop(self) -> None:
        tasks = [t.task for t in self.tails.values() if t.task] + ([self._listener] if self._listener else [])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.psubscribe(LIVE_PATTERN)
                async for msg in pubsub.listen():
                    if msg.get("type") != "pmessage":
                        continue
                    job_id = job_of_channel(msg["channel"])
                    if job_id is None:
                        continue
                    for kind in repo.ROW_MODELS:
                        tail = self.tails.get((job_id, kind))
                        if tail is not None:
                            tail.wake.set()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - reconnect; tails keep polling meanwhile
                log.warning("redis live channel lost; retrying in 1 s")
                await asyncio.sleep(1.0)

    def acquire(self, job_id: str, kind: str) -> Tail:
        tail = self.tails.get((job_id, kind))
        if tail is None:
            tail = self.tails[(job_id, kind)] = Tail(self, job_id, kind)
        tail.users += 1
        if tail.task is None or tail.task.done():
            tail.failed, tail.beat = False, time.monotonic()  # a fresh run (an earlier failure was reported)
            tail.task = asyncio.create_task(tail.run())
        return tail

    def release(self, tail: Tail) -> None:
        tail.users -= 1
        if tail.users <= 0:
            tail.wake.set()
            if tail.task is None or tail.task.done():  # its run ended (failed, job gone) before its last user left
                self.drop(tail)

    def drop(self, tail: Tail) -> None:
        if self.tails.get((tail.job_id, tail.kind)) is tail and tail.users <= 0:
            del self.tails[(tail.job_id, tail.kind)]

    async def follow(self, job_id: str, kind: str, cursor: int, *, keepalive_s: float = 10.0
                     ) -> AsyncIterator[tuple[str, Any]]:
        """Yield ("row", (seq, json)) for every row with seq > cursor in order, ("ping", None) after
        `keepalive_s` without output, then ("end", status) once the job is terminal and every row was sent,
        or ("error", message) if the live source failed (the caller ends the stream; the client resumes
        after its last id)."""
        tail = self.acquire(job_id, kind)
        try:
            quiet_since = time.monotonic()
            while True:
                changed = tail.changed  # taken before reading, so a signal in between is not lost
                rows = tail.after(cursor)
                if rows is None:  # behind the buffer (or not started): read the database
                    try:
                        rows = await to_thread.run_sync(self._read_db, job_id, kind, cursor)
                    except sa.exc.SQLAlchemyError as e:
                        log.warning("live stream %s/%s: database read failed: %s", job_id, kind, e)
                        yield "error", "the database read failed; reconnect to resume"
                        return
                if rows:
                    quiet_since = time.monotonic()
                    for r in rows:
                        yield "row", r
                    cursor = rows[-1][0]
                    continue
                if tail.status == GONE:
                    yield "end", GONE
                    return
                if tail.status in states.TERMINAL and tail.head >= 0 and cursor >= tail.head:
                    yield "end", tail.status
                    return
                if tail.failed or time.monotonic() - tail.beat > self.stale_s:
                    yield "error", "the live source failed; reconnect to resume"
                    return
                if tail.task is None or tail.task.done():
                    tail = self._reacquire(tail, job_id, kind)
                    continue
                left = keepalive_s - (time.monotonic() - quiet_since)
                if left <= 0:
                    quiet_since = time.monotonic()
                    yield "ping", None
                    continue
                await _wait(changed, min(left, 5.0))
        finally:
            self.release(tail)

    def _reacquire(self, tail: Tail, job_id: str, kind: str) -> Tail:
        self.release(tail)
        return self.acquire(job_id, kind)

    def _read_db(self, job_id: str, kind: str, cursor: int) -> list[tuple[int, str]]:
        with self.sessions() as s:
            return [self.serialize(kind, r) for r in repo.read_rows(s, kind, job_id, after=cursor, limit=PAGE)]


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Wait for `event` at most `timeout_s`, in this task (no inner task, no lock: safe to cancel)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


def wake_message(payload: bytes | str) -> dict[str, Any]:
    """Decode a live-channel message (`service.channels.wake_payload`)."""
    return parse_wake(payload)
