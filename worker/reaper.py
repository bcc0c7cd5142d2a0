"""The reaper: requeue jobs whose worker died (lease lapsed), and (re)send jobs that have no message.

    python -m worker.reaper [--interval SECONDS] [--once]

Each pass, in the database (safe to run several reapers: every change is a conditional UPDATE):
- a `running` job whose `lease_expires_at` passed is requeued with `attempt + 1` and an event
  "resumed from checkpoint step N (attempt k)"; its next attempt resumes from the last complete
  checkpoint (`peagle train --resume auto`). After `max_restarts` requeues it fails (`worker_lost`).
  A lapsed `pausing` job becomes `paused`, a lapsed `cancelling` one `cancelled`;
- a `queued` job with no broker message recorded (`celery_task_id` null, e.g. the send failed, or its
  worker was stopping) is sent;
- a `queued` job whose message is recorded but no longer waiting in the broker (Redis lost its data, a
  worker took it and died before claiming) is sent again once it has been queued for
  `requeue_lost_after_seconds` (Redis and filesystem brokers, whose queues can be listed);
- a retrain child's promotion decision that a dead worker left undone (lease lapsed, or never begun) is
  measured again in a thread of this process and stored once (`worker.promotion.LapsedDecisions`).
With `--resend-queued Q1,Q2` it first sends a message for every queued job on those queues: the
`filesystem://` broker has no acknowledgements, so a message that a stopped worker had reserved is
gone. `python -m worker` does this on start in embedded mode. A duplicate message is harmless: a job is
claimed once (`service.db.lease.claim_job`), the other task returns at once.
The broker is never asked to redeliver anything.

The webhook dispatcher (`worker.webhooks`) runs as a thread of this process (`--no-webhooks` to leave it
out), so every deployment that runs a reaper also delivers webhooks.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from service.db import states
from service.db.requeue import (
    ReapAction,
    queued_jobs,
    reap_lapsed,
    record_task_id,
    sent_queued_jobs,
    unsent_queued_jobs,
)
from service.db.session import make_engine, make_session_factory, session_scope
from service.queue import make_producer
from service.settings import Settings, get_settings
from worker.live import Publisher
from worker.promotion import LapsedDecisions
from worker.webhooks import start_dispatcher

__all__ = ["main", "reap_once", "resend_lost", "run_reaper"]

log = logging.getLogger(__name__)


def _send(factory: sessionmaker[Session], producer: Any, job_id: str, queue: str) -> bool:
    try:
        task_id = producer.send_train(job_id, queue)
    except Exception as exc:  # noqa: BLE001 - broker down: try again next pass
        log.warning("reaper: cannot send job %s to %s (%s); will retry", job_id, queue, exc)
        return False
    with session_scope(factory) as s:
        record_task_id(s, job_id, task_id)
    return True


def resend_lost(factory: sessionmaker[Session], producer: Any, *, older_than: float) -> int:
    """Send again every queued job (queued for `older_than` s) whose recorded message is not waiting in
    the broker. A duplicate is harmless: `claim_job` takes a job once, the other task returns at once."""
    with session_scope(factory) as s:
        candidates = sent_queued_jobs(s, older_than=older_than)
    waiting: dict[str, set[str] | None] = {}
    sent = 0
    for job_id, queue, task_id in candidates:
        if queue not in waiting:
            try:
                waiting[queue] = producer.waiting_task_ids(queue)
            except Exception as exc:  # noqa: BLE001 - broker down: try again next pass
                log.warning("reaper: cannot list queue %s (%s); will retry", queue, exc)
                waiting[queue] = None
        present = waiting[queue]
        if present is None or task_id in present:
            continue
        log.warning("reaper: job %s has been queued for over %.0f s and its message %s is not in the broker; "
                    "sending it again", job_id, older_than, task_id)
        sent += _send(factory, producer, job_id, queue)
    return sent


def reap_once(factory: sessionmaker[Session], producer: Any, *, resend_after: float = 10.0,
              publisher: Publisher | None = None, lost_after: float | None = None,
              decisions: LapsedDecisions | None = None) -> list[ReapAction]:
    """One pass: requeue/fail lapsed jobs, send queued jobs that have no message (and, with `lost_after`,
    those whose message the broker lost); with `decisions`, re-run lapsed promotion decisions (in its
    thread). Returns the actions."""
    with session_scope(factory) as s:
        actions = reap_lapsed(s)
    for act in actions:
        log.warning("reaper: job %s -> %s: %s", act.job_id, act.status, act.message)
        if publisher is not None:
            publisher.publish_status(act.job_id, act.status)
        if act.status == states.QUEUED:
            _send(factory, producer, act.job_id, act.queue)
    with session_scope(factory) as s:
        unsent = unsent_queued_jobs(s, older_than=resend_after)
    for job_id, queue in unsent:
        log.info("reaper: sending queued job %s (no broker message recorded)", job_id)
        _send(factory, producer, job_id, queue)
    if lost_after is not None:
        resend_lost(factory, producer, older_than=lost_after)
    if decisions is not None:
        decisions.poll()
    return actions


def resend_queued(factory: sessionmaker[Session], producer: Any, queues: list[str]) -> int:
    """Send a message for every queued job on `queues` (after a restart of the embedded broker's worker)."""
    with session_scope(factory) as s:
        jobs = queued_jobs(s, queues)
    return sum(_send(factory, producer, job_id, queue) for job_id, queue in jobs)


def run_reaper(settings: Settings, *, interval: float, stop: threading.Event,
               resend_queues: list[str] | None = None, webhooks: bool = True) -> None:
    """Reap every `interval` seconds until `stop` is set (database errors are logged, not fatal).

    With `webhooks`, the webhook dispatcher runs beside it in a thread (its own pace and sessions).
    """
    engine = make_engine(settings.resolved_database_url())
    factory = make_session_factory(engine)
    producer = make_producer(settings)
    publisher = Publisher(settings.redis_url) if settings.redis_url else None
    dispatcher = start_dispatcher(settings, factory, stop) if webhooks else None
    decisions = LapsedDecisions(settings, factory)
    try:
        if resend_queues:
            n = resend_queued(factory, producer, resend_queues)
            log.info("reaper: re-sent %d queued job(s) on %s", n, ",".join(resend_queues))
        while not stop.is_set():
            try:
                reap_once(factory, producer, resend_after=max(5.0, 2 * interval), publisher=publisher,
                          lost_after=settings.requeue_lost_after_seconds, decisions=decisions)
            except sa.exc.SQLAlchemyError as exc:
                log.warning("reaper: database error (%s); retrying", exc)
            stop.wait(interval)
    finally:
        stop.set()
        if dispatcher is not None:
            dispatcher.join(timeout=settings.webhook_timeout_seconds + 5)
        if publisher is not None:
            publisher.close()
        producer.close()
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """`python -m worker.reaper`: the periodic reaper (stops cleanly on SIGTERM/SIGINT)."""
    parser = argparse.ArgumentParser(prog="python -m worker.reaper", description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between passes (default lease_seconds / 4, at least 1)")
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    parser.add_argument("--resend-queued", default=None, metavar="QUEUES",
                        help="first send a message for every queued job on these queues (comma-separated)")
    parser.add_argument("--no-webhooks", action="store_true", help="do not run the webhook dispatcher thread")
    args = parser.parse_args(argv)
    settings = get_settings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    interval = args.interval or max(1.0, settings.lease_seconds / 4)
    stop = threading.Event()
    if args.once:
        stop.set()
        engine = make_engine(settings.resolved_database_url())
        producer = make_producer(settings)
        factory = make_session_factory(engine)
        decisions = LapsedDecisions(settings, factory)
        try:
            reap_once(factory, producer, lost_after=settings.requeue_lost_after_seconds, decisions=decisions)
            decisions.join()
        finally:
            producer.close()
            engine.dispose()
        return 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    resend = [q for q in (args.resend_queued or "").split(",") if q]
    run_reaper(settings, interval=interval, stop=stop, resend_queues=resend, webhooks=not args.no_webhooks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
