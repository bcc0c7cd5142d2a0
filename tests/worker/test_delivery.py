"""Celery delivery settings come from `service.queue` alone: producer, worker app, task and command line agree."""

from __future__ import annotations

from pathlib import Path

from service.queue import DELIVERY, WORKER_ONLY, Producer, task_options, worker_argv
from service.settings import get_settings
from worker.app import make_celery


def test_worker_producer_and_task_share_the_delivery_settings(tmp_path: Path) -> None:
    settings = get_settings(home=tmp_path / "home", embedded=True)
    app = make_celery(settings, queues=["gpu-a", "gpu-b"])
    for key, value in {**DELIVERY, **WORKER_ONLY}.items():
        assert app.conf[key] == value, key
    assert [q.name for q in app.conf.task_queues] == ["gpu-a", "gpu-b"] and app.conf.task_default_queue == "gpu-a"
    task = app.tasks["peagle.train"]
    assert (task.acks_late, task.reject_on_worker_lost, task.ignore_result) == tuple(task_options().values())
    assert task_options() == {"acks_late": True, "reject_on_worker_lost": False, "ignore_result": True}
    producer = Producer(settings)
    try:
        for key, value in DELIVERY.items():
            assert producer.app.conf[key] == value, key
    finally:
        producer.close()
    assert worker_argv() == ["--pool=prefork", "--concurrency=1", "--prefetch-multiplier=1", "--max-tasks-per-child=1"]
