"""The trainer worker's side of a split job (`resources.engine`, issue 37): send the released chunks.

    dispatcher = ChunkDispatcher(settings, factory, job_id=..., queue=..., run_dir=RUN, spec=spec)
    dispatcher.tick()     # every heartbeat of the supervisor, while the trainer runs
    dispatcher.stop()     # the attempt ended: chunks in flight are stopped (engine workers see it)

The trainer says which chunks it is ready for through the protocol's files (`peagle.split.protocol`:
``release.json`` keeps the bytes ahead of it within `resources.feature_disk_gb`); each tick the dispatcher
sends the regeneration's chunks and the released capture chunks that are not done as `peagle.engine_chunk`
tasks to the engine queue, at most `resources.engine.replicas` in flight, records them (`service.db.engine_tasks`), sends again a chunk
whose engine worker lost its lease, and writes ``failed.json`` (raised in the trainer) for a chunk that
failed `MAX_ATTEMPTS` times.

Where a chunk goes: to the worker-direct queue of an engine worker whose engine is warm for it (it ran this
job's latest chunk on the same engine, ended `done` within `engine_keep_warm_seconds`, has nothing in flight
and heartbeats: `service.db.engine_tasks.warm_workers`), else FIFO to the shared engine queue, which any
engine worker takes. A chunk sent direct that its worker has not taken while that worker stopped
heartbeating or started other work, or within `engine_chunk_resend_seconds`, is sent again to the shared
queue (a duplicate message is harmless: one worker claims the chunk).

Of peagle it imports only the torch-free `peagle.split.protocol`: a tick reads JSON files and loads no
torch into the supervisor that runs it (tests/worker/test_dispatch_torch_free.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from peagle.split.protocol import (
    RELEASE,
    eval_pending,
    pending_chunks,
    pending_regen_chunks,
    read_plan,
    read_release,
    regen_dir,
    remote_dir,
    write_failed,
)
from service.db.engine_tasks import (
    busy_nodes,
    plan_sends,
    recent_rows,
    stop_chunks,
    touch_sent,
    waiting,
    warm_workers,
)
from service.db.models import utcnow
from service.db.session import session_scope
from service.db.workers import live_workers
from service.queue import engine_queue, make_producer, takes_direct
from service.settings import Settings

__all__ = ["MAX_ATTEMPTS", "ChunkDispatcher"]

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


class ChunkDispatcher:
    """Sends a split job's chunks (module docstring)."""

    def __init__(self, settings: Settings, factory: sessionmaker[Session], *, job_id: str, queue: str, run_dir: Path,
                 spec: Any, send: Callable[[str, str, int, str, str | None], str] | None = None) -> None:
        engine = spec.resources.engine
        self.settings, self.factory, self.job_id = settings, factory, job_id
        self.queue = engine.queue or engine_queue(queue)
        self.replicas = int(engine.replicas)
        self.d = remote_dir(run_dir)
        self.regen = regen_dir(run_dir)  # the regeneration's chunks (`peagle.data.remote_regen`)
        self._send = send  # (job_id, kind, index, queue, node or None) -> task id; default: the broker
        #: when this attempt began: a ``release.json`` older than this is a dead attempt's (its trainer runs on
        #: this machine, so the file's mtime and this clock agree), whose chunks this attempt's trainer will
        #: not read (it starts a new stream generation): nothing is sent for it. A second of margin: file times
        #: come from a coarser clock, and a dead attempt's last write is a lease's length older at least.
        self.since = time.time() - 1.0
        self._producer: Any = None
        self.sent = 0
        self.sent_direct = 0
        #: chunks sent to a worker-direct queue and not taken yet: (kind, index) -> (node, generation)
        self.direct: dict[tuple[str, int], tuple[str, int]] = {}
        #: the stream generation each chunk was last sent for (a second send of the same one is a re-send)
        self.sent_for: dict[tuple[str, int], int] = {}

    def send(self, kind: str, index: int, node: str | None = None) -> str:
        """Send chunk `index` of `kind` to the engine queue, or with `node` to that engine worker's own queue."""
        if self._send is not None:
            return self._send(self.job_id, kind, index, self.queue, node)
        if self._producer is None:
            self._producer = make_producer(self.settings)
        return str(self._producer.send_engine_chunk(self.job_id, kind, index, self.queue, node=node))

    def tick(self) -> None:
        """Send what the trainer released and is neither done nor in flight."""
        todo: list[tuple[str, list[int], int]] = [("regenerate", pending_regen_chunks(self.regen), 0)]
        rel = None
        if read_plan(self.d) is not None:
            rel = read_release(self.d) if self._released_now() else None
            todo.append(("eval", [0] if eval_pending(self.d) else [], 0))
        if isinstance(rel, dict):
            todo.append(("capture", pending_chunks(self.d), int(rel["generation"])))
        self._recall_direct()
        for kind, pending, generation in todo:
            if not pending:
                continue
            with session_scope(self.factory) as s:
                send, failed = plan_sends(s, self.job_id, kind=kind, pending=pending, generation=generation,
                                          replicas=self.replicas, lease_seconds=self.settings.lease_seconds,
                                          max_attempts=MAX_ATTEMPTS, sent_deadline=self.settings.engine_chunk_resend_seconds)
                routes = self._routes(s, kind, generation, send)
            if failed:
                write_failed(self.d, f"engine chunk {kind} {failed[0]} failed {MAX_ATTEMPTS} times on engine workers")
            for i in send:
                node = routes.get(i)
                self.send(kind, i, node)
                self.sent += 1
                if self.sent_for.get((kind, i)) == generation:
                    log.warning("job %s: chunk %s %s (stream %s) sent again: it failed, its engine worker stopped "
                                "heartbeating, or no engine worker took it within %.0f s", self.job_id, kind, i,
                                generation, self.settings.engine_chunk_resend_seconds)
                self.sent_for[(kind, i)] = generation
                if node is not None:
                    self.direct[(kind, i)] = (node, generation)
                    self.sent_direct += 1
                log.info("job %s: chunk %s %s (stream %s) sent to %s", self.job_id, kind, i, generation,
                         f"{node}, whose engine is warm for it" if node else self.queue)

    def _released_now(self) -> bool:
        """Whether ``release.json`` was written by this attempt's trainer."""
        try:
            return (self.d / RELEASE).stat().st_mtime >= self.since
        except FileNotFoundError:
            return False

    def _live_direct(self, s: Session) -> set[str]:
        """Node names of live engine workers that consume this job's engine queue and their worker-direct queue."""
        return {w.name for w in live_workers(s, stale_after_s=self.settings.lease_seconds)
                if takes_direct(w.queues) and self.queue in w.queues}

    def _routes(self, s: Session, kind: str, generation: int, send: list[int]) -> dict[int, str]:
        """Chunk -> the engine worker to send it to directly (`warm_workers`), for the chunks of `send` that
        are sent for the first time; the others go to the shared engine queue."""
        if not send:
            return {}
        now = utcnow()
        keep = float(self.settings.engine_keep_warm_seconds)
        busy = {node for node, _ in self.direct.values()}
        warm = warm_workers(recent_rows(s, since=now - timedelta(seconds=keep)), job_id=self.job_id, kind=kind,
                            now=now, keep_warm_s=keep, live=self._live_direct(s), busy=busy)
        routes: dict[int, str] = {}
        for i in send:
            before = self.direct.pop((kind, i), None)
            if before is not None and before[1] == generation:
                continue  # sent direct before and not taken within the deadline: the shared queue now
            if warm:
                routes[i] = warm.pop(0)
        return routes

    def _recall_direct(self) -> None:
        """Chunks sent direct and not taken: forget the taken ones; send again to the shared queue those whose
        worker stopped heartbeating or took other work meanwhile (it would not take them soon)."""
        if not self.direct:
            return
        again: list[tuple[str, int]] = []
        with session_scope(self.factory) as s:
            live, busy = self._live_direct(s), busy_nodes(s)
            for (kind, i), (node, generation) in list(self.direct.items()):
                if not waiting(s, self.job_id, kind, i, generation=generation):
                    del self.direct[(kind, i)]  # taken (or reset for a new stream): nothing to watch
                elif node not in live or node in busy:
                    del self.direct[(kind, i)]
                    touch_sent(s, self.job_id, kind, i, generation=generation)
                    again.append((kind, i))
        for kind, i in again:
            log.info("job %s: chunk %s %s sent direct to a worker that died or took other work: sent to %s",
                     self.job_id, kind, i, self.queue)
            self.send(kind, i)
            self.sent += 1

    def stop(self) -> None:
        """The attempt is over: stop every chunk in flight."""
        try:
            with session_scope(self.factory) as s:
                stop_chunks(s, self.job_id)
        finally:
            if self._producer is not None:
                self._producer.close()
                self._producer = None
