"""The Celery app of a training worker: `make_celery(settings)`, and `python -m worker` to run one.

Configured for multi-hour GPU work (Celery docs, "Optimizing" and "Tasks"):
- prefork pool, concurrency 1 (one worker process per GPU or GPU group), prefetch 1, one task per child
  (each job gets a fresh process: no state, CUDA context or leaked memory carried over);
- `task_acks_late=True` with prefetch 1: a worker that is training holds its one unacknowledged message,
  so it never reserves a second job while another worker sits idle (with early acks, a busy worker
  prefetches the next job and keeps it until its current one ends). A redelivered message is harmless:
  `claim_job` only takes a `queued` job. `task_reject_on_worker_lost=False` and a 7-day Redis
  `visibility_timeout` keep the broker from re-running work; crash recovery is the reaper's job, through
  the database lease;
- explicit queues per GPU kind (`settings.worker_queue`, comma-separated), `task_create_missing_queues=False`;
- the parent never touches CUDA: nothing here imports torch; the trainer is a child process.
The broker settings come from `service.queue.celery_config` so the API and the worker agree on them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys

from celery import Celery
from kombu.entity import Queue

from service.queue import celery_config
from service.settings import Settings, get_settings
from worker.tasks import register_tasks

__all__ = ["main", "make_celery", "queue_names", "start_reaper"]


def queue_names(settings: Settings, override: str | None = None) -> list[str]:
    """Queues this worker consumes: `override` or `settings.worker_queue` (comma-separated)."""
    names = [q.strip() for q in (override or settings.worker_queue).split(",") if q.strip()]
    if not names:
        raise ValueError("worker_queue: at least one queue name is required")
    return names


def make_celery(settings: Settings, *, queues: list[str] | None = None) -> Celery:
    """A Celery app consuming `queues` (default from settings) with the `peagle.train` task registered."""
    names = queues or queue_names(settings)
    app = Celery("peagle-worker", set_as_current=False)
    app.conf.update(celery_config(settings))
    app.conf.update(
        task_queues=[Queue(n, routing_key=n) for n in names],  # type: ignore[no-untyped-call]
        task_default_queue=names[0],
        task_create_missing_queues=False,
        worker_pool="prefork",
        worker_concurrency=1,
        worker_prefetch_multiplier=1,
        worker_max_tasks_per_child=1,
        task_acks_late=True,
        task_reject_on_worker_lost=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        worker_send_task_events=False,
        task_ignore_result=True,
    )
    register_tasks(app, settings)
    return app


def _die_with_parent() -> None:  # runs in the reaper child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_reaper(settings: Settings, queues: list[str]) -> subprocess.Popen[bytes]:
    """The reaper beside this worker (it stops when the worker process dies). On the embedded broker it
    first re-sends the queued jobs of `queues` (that broker loses messages a stopped worker had reserved)."""
    argv = [sys.executable, "-m", "worker.reaper"]
    if settings.resolved_broker_url().startswith("filesystem://"):
        argv += ["--resend-queued", ",".join(queues)]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)


def main(argv: list[str] | None = None) -> int:
    """`python -m worker [--queue Q] [--hostname H] [--ping]`: run one worker (or ping the workers)."""
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__.split("\n")[0])
    parser.add_argument("--queue", default=None, help="queues to consume (comma-separated; default settings)")
    parser.add_argument("--hostname", default=None, help="Celery node name (default peagle-<queue>@<host>-<pid>)")
    parser.add_argument("--ping", action="store_true", help="exit 0 if a worker answers a ping")
    parser.add_argument("--no-reaper", action="store_true",
                        help="do not start the reaper process beside the worker (run `python -m worker.reaper`)")
    args = parser.parse_args(argv)
    settings = get_settings()
    names = queue_names(settings, args.queue)
    app = make_celery(settings, queues=names)
    if args.ping:
        replies = app.control.ping(timeout=5.0)
        sys.stdout.write(f"{len(replies)} worker(s) answered\n")
        return 0 if replies else 1
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.no_reaper:
        start_reaper(settings, names)
    hostname = args.hostname or f"peagle-{names[0]}@{socket.gethostname()}-{os.getpid()}"
    app.worker_main(argv=[
        "worker", f"--loglevel={settings.log_level.upper()}", f"--queues={','.join(names)}",
        f"--hostname={hostname}", "--pool=prefork", "--concurrency=1", "--prefetch-multiplier=1",
        "--max-tasks-per-child=1", "--without-gossip", "--without-mingle", "--without-heartbeat",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
