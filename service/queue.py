"""Queueing: the API hands a job to the worker by task name, never importing `worker`.

`celery_config(settings)` is the Celery configuration shared by the API (producer) and the worker
(`worker/app.py` imports it), so both agree on the broker and its transport options. Torch-free.

Embedded default: Celery's `filesystem://` transport. kombu's filesystem transport writes messages to
`data_folder_out` and reads from `data_folder_in`; the producer and consumer therefore use the SAME folder
for both (`<broker_folder>/queue`), so the configuration is identical on both sides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.settings import Settings

__all__ = ["TRAIN_TASK", "Producer", "celery_config", "make_producer"]

TRAIN_TASK = "peagle.train"


def broker_folders(settings: Settings) -> dict[str, Path]:
    """Folders of the embedded filesystem broker (created on demand by `celery_config`)."""
    root = settings.broker_folder()
    return {"queue": root / "queue", "processed": root / "processed", "control": root / "control"}


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for both sides (`app.conf.update(celery_config(settings))`)."""
    broker = settings.resolved_broker_url()
    conf: dict[str, Any] = {
        "broker_url": broker,
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,  # a busy worker holds its message: no second job reserved
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_prefetch_multiplier": 1,
        "worker_max_tasks_per_child": 1,
        "task_create_missing_queues": False,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }
    if broker.startswith("filesystem://"):
        folders = broker_folders(settings)
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        conf["broker_transport_options"] = {
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "store_processed": False,
        }
    elif broker.startswith(("redis://", "rediss://")):
        # Long GPU jobs: never redeliver (the reaper requeues via the database instead).
        conf["broker_transport_options"] = {"visibility_timeout": 7 * 24 * 3600}
    return conf


class Producer:
    """Sends `peagle.train` tasks; `ping()` checks the broker answers."""

    def __init__(self, settings: Settings) -> None:
        from celery import Celery

        self.settings = settings
        self.app = Celery("peagle-api", set_as_current=False)
        self.app.conf.update(celery_config(settings))
        self._queues: set[str] = set()

    def _declare(self, queue: str) -> None:
        if queue in self._queues:
            return
        from kombu import Queue

        queues = list(self.app.conf.task_queues or [])
        queues.append(Queue(queue, routing_key=queue))
        self.app.conf.task_queues = queues
        self._queues.add(queue)

    def send_train(self, job_id: str, queue: str, task_id: str | None = None) -> str:
        """Queue task `peagle.train(job_id)` on `queue` (optionally with a chosen task id); returns the id."""
        self._declare(queue)
        result = self.app.send_task(TRAIN_TASK, args=[job_id], queue=queue, routing_key=queue, task_id=task_id)
        return str(result.id)

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


def make_producer(settings: Settings) -> Producer:
    """The producer the API uses (built in the FastAPI lifespan)."""
    return Producer(settings)
