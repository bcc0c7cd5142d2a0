"""The Celery task `peagle.train(job_id)`: claim the job, supervise its trainer, finish.

The task is thin and idempotent: it takes only the job id and re-reads the database. A job that is not
`queued` (cancelled or paused while queued, already claimed by another worker, terminal) is never
started: the task returns at once. Broad exception handling happens only here, at the task boundary.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

from peagle.run_folder import job_dir
from service.db import states
from service.db.lease import ConcurrencyLimited, claim_job, defer_claim, finish
from service.db.session import make_engine, make_session_factory, session_scope
from service.queue import ENGINE_CHUNK_TASK, TRAIN_TASK, make_producer, task_options
from service.settings import Settings
from worker.live import Publisher
from worker.supervisor import Supervisor

__all__ = ["DEFERRED", "NOT_CLAIMED", "register_tasks", "run_job"]

log = logging.getLogger(__name__)

NOT_CLAIMED = "not_claimed"
DEFERRED = "deferred"


def _sender(settings: Settings) -> Callable[[str, str], str]:
    def send(job_id: str, queue: str) -> str:
        producer = make_producer(settings)
        try:
            return producer.send_train(job_id, queue)
        finally:
            producer.close()

    return send


def run_job(settings: Settings, job_id: str, *, lease_owner: str | None = None) -> str:
    """Claim and supervise one job; returns its final status (or `NOT_CLAIMED`, or `DEFERRED` when its
    owner already runs `max_concurrent_jobs` jobs: it stays queued and the reaper re-sends it later)."""
    engine = make_engine(settings.resolved_database_url())
    factory = make_session_factory(engine)
    owner = lease_owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    publisher = Publisher(settings.redis_url) if settings.redis_url else None
    try:
        try:
            with session_scope(factory) as s:
                lease = claim_job(s, job_id, owner=owner, lease_seconds=settings.lease_seconds,
                                  artifact_dir=str(job_dir(settings.resolved_artifact_root(), job_id)),
                                  max_concurrent=settings.max_concurrent_jobs)
        except ConcurrencyLimited as exc:
            with session_scope(factory) as s:
                defer_claim(s, job_id, running=exc.running, limit=exc.limit)
            log.info("%s: left queued; the reaper re-sends it", exc)
            return DEFERRED
        if lease is None:
            log.info("job %s is not claimable (not queued, or claimed elsewhere): skipped", job_id)
            return NOT_CLAIMED
        if publisher is not None:
            publisher.publish_status(job_id, states.RUNNING)
        supervisor = Supervisor(settings, factory, lease, send_task=_sender(settings), publisher=publisher)
        try:
            status = supervisor.run()
        except Exception as exc:
            log.exception("job %s: supervisor failed", job_id)
            with session_scope(factory) as s:
                # the exception's text can name host paths or quote files: it stays in the worker log
                shown = f"worker error: {type(exc).__name__} (details in the worker log)"
                finish(s, lease, status=states.FAILED, error_code="worker_error", error_message=shown,
                       retryable=True, event=("error", shown))
            return states.FAILED
        if status == states.SUCCEEDED:
            _promotion(settings, factory, job_id)
        return status
    finally:
        if publisher is not None:
            publisher.close()
        engine.dispose()


def _promotion(settings: Settings, factory: Any, job_id: str) -> None:
    """A retrain child's promotion (`worker.promotion.after_success`); a failure there leaves the job as it is."""
    from worker.promotion import after_success

    try:
        after_success(settings, factory, job_id)
    except Exception:  # the job has succeeded: a failed promotion must not turn it into an error
        log.exception("job %s: promotion decision failed", job_id)


def register_tasks(app: Any, settings: Settings, *, role: str = "all") -> Any:
    """Register the tasks of `role` on `app` (settings are closed over): `peagle.train` (trainer, all) and
    `peagle.engine_chunk` (engine, all). A worker of role `engine` has no `peagle.train`: it never starts a
    trainer; one of role `trainer` has no `peagle.engine_chunk`: it never starts an engine for a chunk."""
    train = None
    if role in ("all", "trainer"):

        @app.task(name=TRAIN_TASK, shared=False, **task_options())
        def train(job_id: str) -> str:
            return run_job(settings, job_id)

    if role in ("all", "engine"):

        @app.task(name=ENGINE_CHUNK_TASK, shared=False, **task_options())
        def engine_chunk(job_id: str, kind: str, index: int) -> str:
            from worker.engine_task import run_chunk

            return run_chunk(settings, job_id, kind, int(index))

    return train
