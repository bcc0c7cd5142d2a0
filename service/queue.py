"""Queueing: the API hands a job to the worker by task name, never importing `worker`.

`celery_config(settings)` is the Celery configuration shared by the API (producer) and the worker
(`worker/app.py` imports it), so both agree on the broker and its transport options. Torch-free.

Embedded default: Celery's `filesystem://` broker, through `service.fsbroker.Transport` (kombu's transport
with messages that are never read half-written). kombu's filesystem transport writes messages to
`data_folder_out` and reads from `data_folder_in`; the producer and consumer therefore use the SAME folder
for both (`<broker_folder>/queue`), so the configuration is identical on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.settings import Settings

__all__ = ["DELIVERY", "ENGINE_CHUNK_TASK", "ENGINE_DELIVERY", "ENGINE_WORKER_ONLY", "FILESYSTEM_TRANSPORT", "ROLES", "TRAIN_TASK",
           "WORKER_ONLY", "Producer", "celery_config", "declared_queue", "direct_queue", "engine_queue", "make_producer",
           "role_queues", "takes_direct", "task_options", "train_queue", "worker_argv", "worker_config"]

TRAIN_TASK = "peagle.train"
#: One chunk of a split job's engine work (`resources.engine`): `peagle.engine_chunk(job_id, kind, index)`.
ENGINE_CHUNK_TASK = "peagle.engine_chunk"
#: What a worker runs: `engine` chunk tasks only, `trainer` jobs only, or both (`all`, the default).
ROLES = ("all", "engine", "trainer")
ENGINE_QUEUE_PREFIX = "engine-"
#: kombu's filesystem transport with atomic puts and gets (service/fsbroker.py): the embedded broker's.
FILESYSTEM_TRANSPORT = "service.fsbroker:Transport"


def broker_folders(settings: Settings) -> dict[str, Path]:
    """Folders of the embedded filesystem broker (created on demand by `celery_config`)."""
    root = settings.broker_folder()
    return {"queue": root / "queue", "processed": root / "processed", "control": root / "control"}


#: How messages are delivered, for multi-hour GPU jobs: the one definition, applied by `celery_config` to
#: both sides, by `task_options` to the `peagle.train` task and by `worker_argv` to the worker's command
#: line. Late acks with prefetch 1: a training worker holds its one unacknowledged message, so it never
#: reserves a second job while another worker sits idle. A lost worker's message is not re-run
#: (`task_reject_on_worker_lost=False`, a 7-day Redis visibility timeout): the reaper requeues through the
#: database lease, and a duplicate message is harmless (`claim_job` takes only a queued job).
DELIVERY: dict[str, Any] = {
    "task_acks_late": True,
    "task_reject_on_worker_lost": False,
    "task_ignore_result": True,
    "task_serializer": "json",
    "accept_content": ["json"],
    "task_create_missing_queues": False,
    "worker_prefetch_multiplier": 1,
    "worker_max_tasks_per_child": 1,  # each job gets a fresh process: no CUDA context or leaked memory carried over
}
#: What only a consuming worker sets: one prefork child per GPU (group), a broker that may come and go.
WORKER_ONLY: dict[str, Any] = {
    "worker_pool": "prefork",
    "worker_concurrency": 1,
    "worker_cancel_long_running_tasks_on_connection_loss": False,
    "broker_connection_retry": True,
    "broker_connection_max_retries": None,
    "worker_send_task_events": False,
}
#: An engine worker's delivery (role `engine`): the `solo` pool runs each chunk task in the worker's main
#: process, so the `vllm serve` it starts (`peagle.engine.procs.spawn`, dying with that process) stays warm
#: between chunks; a prefork child with `worker_max_tasks_per_child: 1` would take its engine with it after
#: every chunk. Late acks and prefetch 1 as for jobs: a busy engine worker never reserves a second chunk.
#: `worker_direct`: an engine worker also consumes its own queue `<node name>.dq2` (Celery's worker-direct
#: queue, `direct_queue`), where the dispatcher sends a job's next chunk when this worker's engine is warm for it.
ENGINE_DELIVERY: dict[str, Any] = {**DELIVERY, "worker_max_tasks_per_child": None}
ENGINE_WORKER_ONLY: dict[str, Any] = {**WORKER_ONLY, "worker_pool": "solo", "worker_direct": True}
REDIS_VISIBILITY_TIMEOUT_S = 7 * 24 * 3600
#: kombu's Redis transport keeps a queue's messages in one list per priority step (`queue`, `queue\x06\x163`, ...).
_REDIS_PRIORITY_SEP, _REDIS_PRIORITY_STEPS = "\x06\x16", (0, 3, 6, 9)


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for both sides (`app.conf.update(celery_config(settings))`)."""
    broker = settings.resolved_broker_url()
    conf: dict[str, Any] = {
        "broker_url": broker,
        "result_backend": None,
        **DELIVERY,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if broker.startswith("filesystem://"):
        folders = broker_folders(settings)
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        conf["broker_transport"] = FILESYSTEM_TRANSPORT
        conf["broker_transport_options"] = {
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "store_processed": False,
        }
    elif broker.startswith(("redis://", "rediss://")):
        # Long GPU jobs: never redeliver (the reaper requeues via the database instead).
        conf["broker_transport_options"] = {"visibility_timeout": REDIS_VISIBILITY_TIMEOUT_S}
    return conf


def worker_config(settings: Settings, queues: list[str], role: str = "all") -> dict[str, Any]:
    """The consuming worker's settings: `celery_config` plus `WORKER_ONLY` (an engine worker's: `ENGINE_DELIVERY`
    and `ENGINE_WORKER_ONLY`) and its explicit queues."""
    extra = {**ENGINE_DELIVERY, **ENGINE_WORKER_ONLY} if role == "engine" else WORKER_ONLY
    return {**celery_config(settings), **extra,
            "task_queues": [declared_queue(n) for n in queues], "task_default_queue": queues[0]}


def engine_queue(queue: str) -> str:
    """The engine queue beside the job queue `queue` (`engine-<queue>`): the one rule for its name."""
    return queue if queue.startswith(ENGINE_QUEUE_PREFIX) else f"{ENGINE_QUEUE_PREFIX}{queue}"


def direct_queue(node: str) -> Any:
    """The worker-direct queue of the Celery worker called `node` (`<node>.dq2`, Celery's `worker_direct`): only
    that worker consumes it, and only engine workers have one (`ENGINE_WORKER_ONLY`)."""
    from celery.utils.nodenames import worker_direct

    return worker_direct(node)


def takes_direct(queues: Any) -> bool:
    """Whether a worker announcing `queues` (`service.db.workers`) is an engine worker, hence consumes its
    worker-direct queue: its queues are all engine queues (`role_queues("engine", ...)`)."""
    names = list(queues)
    return bool(names) and all(str(q).startswith(ENGINE_QUEUE_PREFIX) for q in names)


def train_queue(queue: str, resources: Any) -> str:
    """The queue a job's `peagle.train` task goes to, the job's queue: `resources.trainer.queue` when set
    (a split job's trainer placed apart), else `queue`. `resources` is a spec's `ResourceSpec`."""
    trainer = getattr(resources, "trainer", None)
    return str(trainer.queue) if trainer is not None and trainer.queue else queue


def role_queues(role: str, queues: list[str]) -> list[str]:
    """The queues a worker of `role` consumes, given its GPU kind's job queues (`settings.worker_queue`).

    `trainer`: the job queues; `engine`: their engine queues; `all`: both (job queues first).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    jobs = [q for q in queues if not q.startswith(ENGINE_QUEUE_PREFIX)]
    engines = list(dict.fromkeys(engine_queue(q) for q in queues))
    if role == "trainer":
        return jobs
    if role == "engine":
        return engines
    return [*jobs, *[q for q in engines if q not in jobs]]


def task_options() -> dict[str, Any]:
    """Options of the `peagle.train` task decorator (the same delivery as `DELIVERY`)."""
    return {"acks_late": DELIVERY["task_acks_late"], "reject_on_worker_lost": DELIVERY["task_reject_on_worker_lost"],
            "ignore_result": DELIVERY["task_ignore_result"]}


def worker_argv(role: str = "all") -> list[str]:
    """The delivery options on `celery worker`'s command line (it overrides the app's configuration); an
    `engine` worker runs its tasks in its main process (`ENGINE_DELIVERY`)."""
    if role == "engine":
        return [f"--pool={ENGINE_WORKER_ONLY['worker_pool']}", "--concurrency=1",
                f"--prefetch-multiplier={ENGINE_DELIVERY['worker_prefetch_multiplier']}"]
    return [f"--pool={WORKER_ONLY['worker_pool']}", f"--concurrency={WORKER_ONLY['worker_concurrency']}",
            f"--prefetch-multiplier={DELIVERY['worker_prefetch_multiplier']}",
            f"--max-tasks-per-child={DELIVERY['worker_max_tasks_per_child']}"]


def declared_queue(name: str) -> Any:
    """The kombu `Queue` called `name`, bound to a direct exchange of the same name (routing key `name`).

    The producer and the worker (`worker_config`) declare every queue this one way, so both sides bind it
    identically whatever the order of a worker's queues.
    """
    from kombu import Exchange, Queue

    return Queue(name, Exchange(name, type="direct"), routing_key=name)


class Producer:
    """Sends `peagle.train` tasks to any queue, in any order; `ping()` checks the broker answers.

    Each send names its queue as a declared kombu `Queue` (not a name looked up in `task_queues`): Celery
    builds its router from `task_queues` once, so a queue added to the configuration later was never
    found (`Queue 'cpu' missing from task_queues` for every queue but the first one sent to).
    """

    def __init__(self, settings: Settings) -> None:
        from celery import Celery

        self.settings = settings
        self.app = Celery("peagle-api", set_as_current=False)
        self.app.conf.update(celery_config(settings))

    def send_train(self, job_id: str, queue: str, task_id: str | None = None) -> str:
        """Queue task `peagle.train(job_id)` on `queue` (optionally with a chosen task id); returns the id."""
        result = self.app.send_task(TRAIN_TASK, args=[job_id], queue=declared_queue(queue), task_id=task_id)
        return str(result.id)

    def send_engine_chunk(self, job_id: str, kind: str, index: int, queue: str, task_id: str | None = None, *,
                          node: str | None = None) -> str:
        """Queue task `peagle.engine_chunk(job_id, kind, index)` on the engine queue `queue`, or with `node` on
        that engine worker's own queue (`direct_queue`); returns the id."""
        target = direct_queue(node) if node else declared_queue(queue)
        result = self.app.send_task(ENGINE_CHUNK_TASK, args=[job_id, kind, int(index)], queue=target, task_id=task_id)
        return str(result.id)

    def waiting_task_ids(self, queue: str) -> set[str] | None:
        """Task ids of the messages waiting in the broker on `queue` (not yet taken by a worker); None when
        this broker cannot be listed. The reaper re-sends a queued job whose message is not there."""
        broker = self.settings.resolved_broker_url()
        if broker.startswith("filesystem://"):
            folder = broker_folders(self.settings)["queue"]
            bodies: list[bytes | str] = [p.read_bytes() for p in folder.glob(f"*.{queue}.msg")]
        elif broker.startswith(("redis://", "rediss://")):
            import redis

            client = redis.Redis.from_url(broker, socket_timeout=10, socket_connect_timeout=5)
            try:
                keys = [queue if p == 0 else f"{queue}{_REDIS_PRIORITY_SEP}{p}" for p in _REDIS_PRIORITY_STEPS]
                bodies = [b for key in keys for b in client.lrange(key, 0, -1)]
            finally:
                client.close()
        else:
            return None
        return {tid for body in bodies if (tid := _task_id(body)) is not None}

    def ping(self, timeout: float = 2.0) -> bool:
        """True if the broker is reachable (filesystem: folders writable; others: a connection)."""
        broker = self.settings.resolved_broker_url()
        if broker.startswith("filesystem://"):
            folder = broker_folders(self.settings)["queue"]
            try:
                probe = folder / ".ping"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError:
                return False
            return True
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1, timeout=timeout)
        except Exception:  # noqa: BLE001 - any broker failure means "not ready"
            return False
        return True

    def close(self) -> None:
        """Release broker connections."""
        self.app.close()


def _task_id(body: bytes | str) -> str | None:
    """The task id in the headers of one kombu message body (None for anything else)."""
    try:
        msg = json.loads(body)
    except ValueError:
        return None
    tid = (msg.get("headers") or {}).get("id") if isinstance(msg, dict) else None
    return str(tid) if tid else None


def make_producer(settings: Settings) -> Producer:
    """The producer the API uses (built in the FastAPI lifespan)."""
    return Producer(settings)
