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
- the parent never touches CUDA: nothing here imports torch; the trainer is a child process;
- SIGTERM to the worker (`docker compose stop`) is a warm shutdown that does not wait for a multi-hour job:
  `stop_running_jobs` sends SIGTERM to each pool process running a task; its supervisor signals the
  trainer's process group, the trainer saves a checkpoint and exits 75, and the job is requeued
  (attempt + 1) within `shutdown_grace_seconds` (SIGKILL to the trainer after that; requeued all the same).
Every delivery setting comes from `service.queue` (`DELIVERY`, `WORKER_ONLY`, `worker_config`,
`worker_argv`), so the API, the worker app, the task and the command line agree on them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import warnings

from celery import Celery, signals

from peagle.engine.procs import spawn
from service.queue import ROLES, role_queues, worker_argv, worker_config
from service.settings import Settings, get_settings
from worker.announce import Announcer
from worker.tasks import register_tasks

__all__ = ["accept_root", "main", "main_parser", "make_celery", "queue_names", "start_reaper", "stop_running_jobs"]

log = logging.getLogger(__name__)


def queue_names(settings: Settings, override: str | None = None, role: str = "all") -> list[str]:
    """Queues this worker consumes: those of its `role` (`service.queue.role_queues`) for `override` or
    `settings.worker_queue` (comma-separated job queues of its GPU kind)."""
    names = [q.strip() for q in (override or settings.worker_queue).split(",") if q.strip()]
    if not names:
        raise ValueError("worker_queue: at least one queue name is required")
    return role_queues(role, names)


def make_celery(settings: Settings, *, queues: list[str] | None = None, role: str = "all") -> Celery:
    """A Celery app consuming `queues` (default from settings and `role`) with the tasks of `role` registered:
    `peagle.train` (trainer, all) and `peagle.engine_chunk` (engine, all)."""
    names = queues or queue_names(settings, role=role)
    app = Celery("peagle-worker", set_as_current=False)
    app.conf.update(worker_config(settings, names, role))
    register_tasks(app, settings, role=role)
    return app


def stop_running_jobs(sender: object = None, how: str = "Warm", **_: object) -> list[int]:
    """On a warm shutdown of this worker (Celery's `worker_shutting_down`, in the main process): SIGTERM each
    pool process that runs a task, so its supervisor checkpoints the trainer and requeues the job instead
    of Celery waiting for the job to end. Returns the pids signalled."""
    from celery.worker import state

    pids = sorted({int(r.worker_pid) for r in list(state.active_requests) if r.worker_pid})
    if how != "Warm":
        return []  # a cold shutdown terminates the pool itself
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    return pids


def start_reaper(settings: Settings, queues: list[str]) -> subprocess.Popen[bytes]:
    """The reaper beside this worker (it stops when the worker process dies). On the embedded broker it
    first re-sends the queued jobs of `queues` (that broker loses messages a stopped worker had reserved)."""
    argv = [sys.executable, "-m", "worker.reaper"]
    if settings.resolved_broker_url().startswith("filesystem://"):
        argv += ["--resend-queued", ",".join(queues)]
    # The worker's whole environment (the reaper talks to the database and broker); in the worker's own
    # process group (Ctrl-C reaches both), SIGTERM when the worker process dies.
    return spawn(argv, env=os.environ, die_with_parent=True, death_signal=signal.SIGTERM, new_session=False)


def main_parser() -> argparse.ArgumentParser:
    """The command line of `python -m worker`."""
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__.split("\n")[0])
    parser.add_argument("--queue", default=None, help="job queues of this worker's GPU kind (comma-separated; "
                        "default settings); an engine worker consumes their engine queues (engine-<queue>)")
    parser.add_argument("--role", default="all", choices=ROLES,
                        help="engine: only engine chunk tasks (keeps its vllm serve warm between chunks); trainer: "
                        "only jobs (their trainers); all (default): both")
    parser.add_argument("--hostname", default=None, help="Celery node name (default peagle-<queue>@<host>-<pid>)")
    parser.add_argument("--ping", action="store_true", help="exit 0 if a worker answers a ping")
    parser.add_argument("--no-reaper", action="store_true",
                        help="do not start the reaper process beside the worker (run `python -m worker.reaper`)")
    parser.add_argument("--accept-root", action="store_true",
                        help="`make run` on a single-user machine: a root worker is expected there, so Celery's "
                        "superuser SecurityWarning is replaced by one log line (the image runs as `peagle`)")
    return parser


#: The start of Celery's warning for a worker running as root (`celery.platforms.ROOT_DISCOURAGED`).
_ROOT_WARNING = "You're running the worker with superuser privileges"


def accept_root() -> None:
    """When running as root: hide exactly Celery's superuser SecurityWarning and say it once, in a log line.

    Only that warning (category and message): every other warning still shows. Celery's supported way out
    is `--uid` (drop privileges), which a `make run` checkout owned by root cannot use; the container image
    runs the worker as the unprivileged user `peagle` and never passes `--accept-root`.
    """
    if os.geteuid() != 0:
        return
    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", message=_ROOT_WARNING, category=SecurityWarning)
    log.info("running as root (make run on a single-user machine); the container image runs the worker as "
             "the unprivileged user peagle")


def main(argv: list[str] | None = None) -> int:
    """`python -m worker [--queue Q] [--hostname H] [--ping] [--accept-root]`: run one worker (or ping)."""
    args = main_parser().parse_args(argv)
    settings = get_settings()
    names = queue_names(settings, args.queue, args.role)
    app = make_celery(settings, queues=names, role=args.role)
    if args.ping:
        replies = app.control.ping(timeout=5.0)
        sys.stdout.write(f"{len(replies)} worker(s) answered\n")
        return 0 if replies else 1
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.accept_root:
        accept_root()
    if not args.no_reaper and args.role != "engine":
        start_reaper(settings, names)
    if args.role != "engine":  # an engine worker runs its chunk in its main process: nothing to signal
        signals.worker_shutting_down.connect(stop_running_jobs, weak=False)
    hostname = args.hostname or f"peagle-{names[0]}@{socket.gethostname()}-{os.getpid()}"
    if args.role == "engine":
        from worker.engine_task import stop_warm_engine

        signals.worker_shutdown.connect(stop_warm_engine, weak=False)
    announcer = Announcer(settings, name=hostname, queues=names)  # its row tells the API what it takes
    signals.worker_ready.connect(announcer.start, weak=False)
    signals.worker_shutdown.connect(announcer.stop, weak=False)
    app.worker_main(argv=[
        "worker", f"--loglevel={settings.log_level.upper()}", f"--queues={','.join(names)}",
        f"--hostname={hostname}", *worker_argv(args.role), "--without-gossip", "--without-mingle", "--without-heartbeat",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
