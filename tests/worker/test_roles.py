"""Worker roles and the chunk-task records of a split job (issue 37), without an engine.

- `--role engine` registers only `peagle.engine_chunk` and consumes only engine queues (it never starts a
  trainer); `--role trainer` only `peagle.train` on the job queues (it never runs an engine chunk); `all`
  both. An engine worker runs its chunks in its main process (solo pool), so its engine stays warm.
- `service.db.engine_tasks` on a real (SQLite, migrated) database: at most `replicas` chunks in flight, a
  chunk whose engine worker lost its lease is sent again and taken by another worker, a chunk that failed
  too often is reported, the end of an attempt stops every chunk, pause/cancel reach the engine side.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from service.db import engine_tasks as et
from service.db.models import Job, utcnow
from service.db.session import session_scope
from service.queue import ENGINE_CHUNK_TASK, TRAIN_TASK, role_queues, worker_argv
from tests.worker.conftest import new_job


def test_roles_register_only_their_tasks_and_queues(tmp_path, monkeypatch):
    from service.settings import Settings
    from worker.app import make_celery, queue_names

    settings = Settings(home=tmp_path, worker_queue="gpu")
    assert queue_names(settings, role="all") == ["gpu", "engine-gpu"]
    assert queue_names(settings, role="trainer") == ["gpu"]
    assert queue_names(settings, "gpu,cpu", role="engine") == ["engine-gpu", "engine-cpu"]
    engine = make_celery(settings, role="engine")
    assert ENGINE_CHUNK_TASK in engine.tasks and TRAIN_TASK not in engine.tasks
    assert [q.name for q in engine.conf.task_queues] == ["engine-gpu"]
    assert engine.conf.worker_pool == "solo" and "--pool=solo" in worker_argv("engine")
    trainer = make_celery(settings, role="trainer")
    assert TRAIN_TASK in trainer.tasks and ENGINE_CHUNK_TASK not in trainer.tasks
    assert [q.name for q in trainer.conf.task_queues] == ["gpu"]
    assert trainer.conf.worker_max_tasks_per_child == 1
    both = make_celery(settings)
    assert TRAIN_TASK in both.tasks and ENGINE_CHUNK_TASK in both.tasks
    with pytest.raises(ValueError, match="role must be one of"):
        role_queues("gpu-only", ["gpu"])


def test_chunk_records_lease_resend_and_stop(factory):
    job_id = new_job(factory, status="running")
    with session_scope(factory) as s:
        send, failed = et.plan_sends(s, job_id, kind="capture", pending=[0, 1, 2], generation=1, replicas=2,
                                     lease_seconds=5, max_attempts=2)
    assert send == [0, 1] and failed == []
    with session_scope(factory) as s:  # nothing more while two are in flight
        assert et.plan_sends(s, job_id, kind="capture", pending=[0, 1, 2], generation=1, replicas=2,
                             lease_seconds=5, max_attempts=2) == ([], [])
        assert et.start_chunk(s, job_id, "capture", 0, worker="a", gpus=0, lease_seconds=5) == 1
        assert et.start_chunk(s, job_id, "capture", 0, worker="b", gpus=0, lease_seconds=5) is None  # a's
        assert et.job_control(s, job_id, "capture", 0, worker="a")
    later = utcnow() + timedelta(seconds=30)  # a stopped heartbeating (killed)
    with session_scope(factory) as s:
        send, _ = et.plan_sends(s, job_id, kind="capture", pending=[0, 1, 2], generation=1, replicas=2,
                                lease_seconds=5, max_attempts=2, now=later)
        assert send == [0]  # lost: sent again (1 still in flight)
        assert not et.beat_chunk(s, job_id, "capture", 0, worker="a", lease_seconds=5)
        assert et.start_chunk(s, job_id, "capture", 0, worker="b", gpus=0, lease_seconds=5, now=later) == 1
        et.end_chunk(s, job_id, "capture", 0, worker="a", state="done", tokens=99)  # a's late word: ignored
        et.end_chunk(s, job_id, "capture", 0, worker="b", state="failed", error="boom")
    with session_scope(factory) as s:
        rows = {r.index: r for r in et.task_rows(s, job_id)}
        assert rows[0].state == "failed" and rows[0].worker == "b" and rows[0].attempts == 2
        assert et.plan_sends(s, job_id, kind="capture", pending=[0], generation=1, replicas=4,
                             lease_seconds=5, max_attempts=2) == ([], [0])  # failed twice: reported
        assert et.start_chunk(s, job_id, "capture", 1, worker="a", gpus=0, lease_seconds=5) == 1
        s.get(Job, job_id).desired_state = "cancelled"
    with session_scope(factory) as s:
        assert not et.job_control(s, job_id, "capture", 1, worker="a")  # cancel reaches the chunk
        assert et.stop_chunks(s, job_id) == 1
        assert {r.index: r.state for r in et.task_rows(s, job_id)}[1] == "stopped"
    with session_scope(factory) as s:  # a new generation of the trainer's stream starts the count again
        send, failed = et.plan_sends(s, job_id, kind="capture", pending=[0, 2], generation=2, replicas=4,
                                     lease_seconds=5, max_attempts=2)
        assert send == [0, 2] and failed == []


def test_lost_chunk_message_is_sent_again_and_the_duplicate_is_harmless(factory):
    job_id = new_job(factory, status="running")
    args = dict(kind="capture", pending=[0, 1], generation=1, replicas=2, lease_seconds=5, max_attempts=2,
                sent_deadline=60)
    with session_scope(factory) as s:
        assert et.plan_sends(s, job_id, **args) == ([0, 1], [])
        assert et.start_chunk(s, job_id, "capture", 1, worker="a", gpus=0, lease_seconds=500) == 1
    soon = utcnow() + timedelta(seconds=30)
    with session_scope(factory) as s:  # within the deadline: nothing sent again
        assert et.plan_sends(s, job_id, **args, now=soon) == ([], [])
    later = utcnow() + timedelta(seconds=90)  # chunk 0's message never reached a worker
    with session_scope(factory) as s:
        assert et.plan_sends(s, job_id, **args, now=later) == ([0], [])
    with session_scope(factory) as s:  # not again until its new deadline
        assert et.plan_sends(s, job_id, **args, now=later + timedelta(seconds=30)) == ([], [])
        assert et.start_chunk(s, job_id, "capture", 0, worker="b", gpus=0, lease_seconds=5, now=later) == 1
        # the first message arrives late at another worker: b holds the chunk, c does not run it
        assert et.start_chunk(s, job_id, "capture", 0, worker="c", gpus=0, lease_seconds=5, now=later) is None
    with session_scope(factory) as s:
        rows = {r.index: r for r in et.task_rows(s, job_id)}
        assert rows[0].state == "running" and rows[0].worker == "b" and rows[0].attempts == 1


def test_a_chunk_without_its_plan_is_not_claimed(factory, tmp_path):
    # an engine worker that cannot see the job's plan (the shared volume not mounted there) leaves the chunk
    # `sent`: claiming it would hold it under a lease nobody renews until it lapses
    from service.settings import Settings
    from worker.engine_task import run_chunk

    job_id = new_job(factory, status="running")
    with session_scope(factory) as s:
        assert et.plan_sends(s, job_id, kind="capture", pending=[0], generation=1, replicas=1, lease_seconds=5,
                             max_attempts=2) == ([0], [])
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert run_chunk(settings, job_id, "capture", 0, worker="e@h:1") == "skipped"
    with session_scope(factory) as s:
        r = et.task_rows(s, job_id)[0]
        assert (r.state, r.worker, r.attempts) == ("sent", None, 0)
