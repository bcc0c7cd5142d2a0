"""The trainer worker's side of a split job (`resources.engine`, issue 37): send the released chunks.

    dispatcher = ChunkDispatcher(settings, factory, job_id=..., queue=..., run_dir=RUN, spec=spec)
    dispatcher.tick()     # every heartbeat of the supervisor, while the trainer runs
    dispatcher.stop()     # the attempt ended: chunks in flight are stopped (engine workers see it)

The trainer says which chunks it is ready for through the protocol's files (`peagle.target.remote`:
``release.json`` keeps the bytes ahead of it within `resources.feature_disk_gb`); each tick the dispatcher
sends the regeneration's chunks (`peagle.data.remote_regen`) and the released capture chunks that are not
done as `peagle.engine_chunk` tasks to the engine queue, at most
`resources.engine.replicas` in flight, records them (`service.db.engine_tasks`), sends again a chunk
whose engine worker lost its lease, and writes ``failed.json`` (raised in the trainer) for a chunk that
failed `MAX_ATTEMPTS` times. Chunks of a job go FIFO on the one engine queue: an engine worker keeps its
engine warm, so with one job at a time every chunk after the first finds a warm engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from peagle.fileio import atomic_write_json, read_json
from service.db.engine_tasks import plan_sends, stop_chunks
from service.db.session import session_scope
from service.queue import engine_queue, make_producer
from service.settings import Settings

__all__ = ["MAX_ATTEMPTS", "ChunkDispatcher"]

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


class ChunkDispatcher:
    """Sends a split job's chunks (module docstring)."""

    def __init__(self, settings: Settings, factory: sessionmaker[Session], *, job_id: str, queue: str, run_dir: Path,
                 spec: Any, send: Callable[[str, str, int, str], str] | None = None) -> None:
        from peagle.data.remote_regen import regen_dir, remote_dir

        engine = spec.resources.engine
        self.settings, self.factory, self.job_id = settings, factory, job_id
        self.queue = engine.queue or engine_queue(queue)
        self.replicas = int(engine.replicas)
        self.d = remote_dir(run_dir)
        self.regen = regen_dir(run_dir)  # the regeneration's chunks (`peagle.data.remote_regen`)
        self._send = send
        self._producer: Any = None
        self.sent = 0

    def send(self, kind: str, index: int) -> str:
        if self._send is not None:
            return self._send(self.job_id, kind, index, self.queue)
        if self._producer is None:
            self._producer = make_producer(self.settings)
        return str(self._producer.send_engine_chunk(self.job_id, kind, index, self.queue))

    def tick(self) -> None:
        """Send what the trainer released and is neither done nor in flight."""
        from peagle.data.remote_regen import pending_regen_chunks
        from peagle.target.remote import eval_pending, pending_chunks, read_plan

        todo: list[tuple[str, list[int], int]] = [("regenerate", pending_regen_chunks(self.regen), 0)]
        rel = None
        if read_plan(self.d) is not None:
            rel = read_json(self.d / "release.json") if (self.d / "release.json").exists() else None
            todo.append(("eval", [0] if eval_pending(self.d) else [], 0))
        if isinstance(rel, dict):
            todo.append(("capture", pending_chunks(self.d), int(rel["generation"])))
        for kind, pending, generation in todo:
            if not pending:
                continue
            with session_scope(self.factory) as s:
                send, failed = plan_sends(s, self.job_id, kind=kind, pending=pending, generation=generation,
                                          replicas=self.replicas, lease_seconds=self.settings.lease_seconds,
                                          max_attempts=MAX_ATTEMPTS, sent_deadline=self.settings.engine_chunk_resend_seconds)
            if failed:
                atomic_write_json(self.d / "failed.json", {"message": f"engine chunk {kind} {failed[0]} failed "
                                                                      f"{MAX_ATTEMPTS} times on engine workers"})
            for i in send:
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
