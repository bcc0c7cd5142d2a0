"""Chunks of a split job prefer an engine worker whose engine is warm for them (issue 37, Deliver 3).

- `warm_workers` (pure over `engine_task` rows): a worker qualifies when its latest chunk is this job's, on
  the same engine (capture and eval share one), ended `done` within the keep-warm time, and it is live and
  not busy; the one idle for the shortest time comes first.
- `ChunkDispatcher` on a real (SQLite, migrated) database with announced workers: the first chunk goes to
  the shared engine queue, the next one to the worker-direct queue of the worker that ran it; a chunk sent
  direct to a worker that stopped heartbeating, or that took other work, is sent again to the shared queue.
- The engine worker's Celery app consumes its worker-direct queue (a trainer's does not), and the producer
  puts a direct chunk on `<node>.dq2`.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from peagle.fileio import atomic_write_json
from service.db import engine_tasks as et
from service.db.models import utcnow
from service.db.session import session_scope
from service.db.workers import announce, retire
from tests.worker.conftest import new_job

NOW = datetime(2026, 1, 1, 12, 0, 0)


def row(worker: str | None, job: str = "J", kind: str = "capture", state: str = "done", started: float = -60,
        finished: float | None = -10) -> Any:
    """An `engine_task`-like row; times in seconds relative to NOW."""
    return SimpleNamespace(worker=worker, job_id=job, kind=kind, state=state,
                           started_at=NOW + timedelta(seconds=started),
                           finished_at=None if finished is None else NOW + timedelta(seconds=finished))


def warm(rows: list[Any], kind: str = "capture", **kw: Any) -> list[str]:
    return et.warm_workers(rows, job_id="J", kind=kind, now=NOW, keep_warm_s=60, **kw)


def test_warm_workers_rule():
    assert et.node_of("engine0-q1@host:1234") == "engine0-q1@host" and et.node_of("host") == "host"
    assert warm([row("a@h:1")]) == ["a@h"]
    # the one idle for the shortest time first; a worker's latest chunk decides (by start time)
    assert warm([row("a@h:1", finished=-30), row("b@h:2", finished=-5)]) == ["b@h", "a@h"]
    assert warm([row("a@h:1", started=-60), row("a@h:1", job="K", started=-20, finished=-15)]) == []
    assert warm([row("a@h:1", started=-60, finished=-50), row("a@h:1", started=-20, finished=-15)]) == ["a@h"]
    # eval ran on the capture engine (a worker that ran the same kind comes first); regeneration on another
    assert warm([row("a@h:1", kind="eval")]) == ["a@h"]
    assert warm([row("a@h:1", kind="eval", finished=-5), row("b@h:2", finished=-30)]) == ["b@h", "a@h"]
    assert warm([row("a@h:1", kind="eval", finished=-5), row("b@h:2", finished=-30)], kind="eval") == ["a@h", "b@h"]
    assert warm([row("a@h:1", kind="regenerate")]) == []
    assert warm([row("a@h:1", kind="capture")], kind="regenerate") == []
    assert warm([row("a@h:1", kind="regenerate")], kind="regenerate") == ["a@h"]
    # busy (running), stopped or failed (its engine was stopped), cold (idle past keep-warm), unknown start
    assert warm([row("a@h:1", state="running", finished=None)]) == []
    assert warm([row("a@h:1", state="stopped")]) == [] and warm([row("a@h:1", state="failed")]) == []
    assert warm([row("a@h:1", finished=-61)]) == []
    assert warm([SimpleNamespace(**{**vars(row("a@h:1")), "started_at": None})]) == []
    assert warm([row(None, state="sent", finished=None)]) == []
    # not live, or just sent a chunk
    assert warm([row("a@h:1"), row("b@h:2")], live={"b@h"}) == ["b@h"]
    assert warm([row("a@h:1"), row("b@h:2")], busy={"a@h"}) == ["b@h"]


def write_protocol(run: Path, chunks: int, released: int, generation: int = 1) -> Path:
    d = run / "data" / "features" / "remote"
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "plan.json", {"version": 1, "kind": "capture", "chunks": [[i, i + 1] for i in range(chunks)],
                                        "eval": False})
    atomic_write_json(d / "release.json", {"generation": generation, "start": 0, "consumed": -1, "released": released})
    return d


def done(d: Path, i: int, generation: int = 1) -> None:
    atomic_write_json(d / f"chunk_{i:06d}.done", {"generation": generation})


def dispatcher(factory: Any, tmp_path: Path, job_id: str, sent: list[tuple[str, int, str | None]]) -> Any:
    from service.settings import Settings
    from worker.dispatch import ChunkDispatcher

    settings = Settings(home=tmp_path / "home", lease_seconds=30, engine_keep_warm_seconds=600)
    spec = SimpleNamespace(resources=SimpleNamespace(engine=SimpleNamespace(queue=None, replicas=1)))
    def send(_job: str, kind: str, i: int, _queue: str, node: str | None) -> str:
        sent.append((kind, i, node))
        return "id"

    return ChunkDispatcher(settings, factory, job_id=job_id, queue="cpu", run_dir=tmp_path / "run", spec=spec,
                           send=send)


def run_chunk(factory: Any, job_id: str, i: int, worker: str, state: str = "done") -> None:
    with session_scope(factory) as s:
        assert et.start_chunk(s, job_id, "capture", i, worker=worker, gpus=0, lease_seconds=30) is not None
    with session_scope(factory) as s:
        et.end_chunk(s, job_id, "capture", i, worker=worker, state=state)


def test_dispatcher_sends_to_the_warm_worker_and_falls_back(factory, tmp_path):
    job_id = new_job(factory, status="running")
    with session_scope(factory) as s:
        for name in ("e1@h", "e2@h"):
            announce(s, name=name, queues=["engine-cpu"], gpus=0)
        announce(s, name="t@h", queues=["cpu"], gpus=0)  # a trainer worker has no direct queue
    sent: list[tuple[str, int, str | None]] = []
    disp = dispatcher(factory, tmp_path, job_id, sent)
    d = write_protocol(tmp_path / "run", chunks=6, released=6)  # by this attempt's trainer
    disp.tick()
    assert sent == [("capture", 0, None)]  # nothing warm yet: the shared queue
    run_chunk(factory, job_id, 0, "e1@h:11")
    done(d, 0)
    disp.tick()
    assert sent[-1] == ("capture", 1, "e1@h") and disp.direct == {("capture", 1): ("e1@h", 1)}
    disp.tick()
    assert len(sent) == 2  # in flight (replicas 1): nothing more
    run_chunk(factory, job_id, 1, "e1@h:11")  # e1 took it from its direct queue
    done(d, 1)
    disp.tick()
    assert sent[-1] == ("capture", 2, "e1@h") and disp.direct == {("capture", 2): ("e1@h", 1)}
    with session_scope(factory) as s:  # e1 died before taking chunk 2
        retire(s, name="e1@h")
    disp.tick()
    assert sent[-1] == ("capture", 2, None) and disp.direct == {}  # sent again, to the shared queue
    run_chunk(factory, job_id, 2, "e2@h:22")
    done(d, 2)
    disp.tick()
    assert sent[-1] == ("capture", 3, "e2@h")
    # e2 takes another job's chunk from the shared queue meanwhile: chunk 3 goes to the shared queue too
    other = new_job(factory, status="running")
    with session_scope(factory) as s:
        et.plan_sends(s, other, kind="capture", pending=[0], generation=1, replicas=1, lease_seconds=30, max_attempts=3)
        et.start_chunk(s, other, "capture", 0, worker="e2@h:22", gpus=0, lease_seconds=30)
    disp.tick()
    assert sent[-1] == ("capture", 3, None) and disp.direct == {}
    run_chunk(factory, job_id, 3, "e1@h:33")  # a worker restarted under the same node name took it
    done(d, 3)
    with session_scope(factory) as s:
        et.end_chunk(s, other, "capture", 0, worker="e2@h:22", state="done")
    disp.tick()  # e1 is not live (retired), e2's engine holds the other job's configuration
    assert sent[-1] == ("capture", 4, None)
    assert disp.sent_direct == 3


def test_direct_chunk_not_taken_is_resent_after_the_deadline(factory, tmp_path):
    job_id = new_job(factory, status="running")
    with session_scope(factory) as s:
        announce(s, name="e1@h", queues=["engine-cpu"], gpus=0)
    sent: list[tuple[str, int, str | None]] = []
    disp = dispatcher(factory, tmp_path, job_id, sent)
    d = write_protocol(tmp_path / "run", chunks=3, released=3)
    disp.settings = disp.settings.model_copy(update={"engine_chunk_resend_seconds": 0.0})
    disp.tick()
    run_chunk(factory, job_id, 0, "e1@h:11")
    done(d, 0)
    disp.tick()
    assert sent[-1] == ("capture", 1, "e1@h")
    with session_scope(factory) as s:  # the direct message was never taken (e1 hangs, still heartbeating)
        assert et.waiting(s, job_id, "capture", 1, generation=1)
        assert et.touch_sent(s, job_id, "capture", 1, generation=1, now=utcnow() - timedelta(seconds=5))
        announce(s, name="e1@h", queues=["engine-cpu"], gpus=0)
    disp.tick()
    assert sent[-1] == ("capture", 1, None)  # past the re-send deadline: the shared queue


def test_engine_workers_consume_their_direct_queue(tmp_path):
    from service.queue import direct_queue, make_producer, takes_direct
    from service.settings import Settings
    from worker.app import make_celery

    settings = Settings(home=tmp_path, worker_queue="cpu")
    assert make_celery(settings, role="engine").conf.worker_direct is True
    assert not make_celery(settings, role="trainer").conf.worker_direct
    assert not make_celery(settings).conf.worker_direct  # an all worker runs chunks in throwaway children
    assert takes_direct(["engine-cpu"]) and not takes_direct(["cpu", "engine-cpu"]) and not takes_direct([])
    assert direct_queue("e1@h").name == "e1@h.dq2"
    producer = make_producer(settings)  # the embedded broker: its queue files can be listed
    try:
        tid = producer.send_engine_chunk("J", "capture", 3, "engine-cpu", node="e1@h")
        assert producer.waiting_task_ids("e1@h.dq2") == {tid}
        assert producer.waiting_task_ids("engine-cpu") == set()
    finally:
        producer.close()


def test_a_chunk_sent_direct_reaches_that_engine_worker(make_stack):
    """A real engine worker (Celery, Redis) takes a chunk from its worker-direct queue (a chunk without a
    plan: it logs the skip and leaves the chunk unclaimed); the other engine worker, idle on the shared
    queue, never sees it."""

    from service.queue import engine_queue, make_producer

    stack = make_stack("services")
    job_id = new_job(stack.factory, status="running")
    with session_scope(stack.factory) as s:
        assert et.plan_sends(s, job_id, kind="capture", pending=[0], generation=1, replicas=1, lease_seconds=30,
                             max_attempts=3) == ([0], [])
    nodes = [f"e{n}-{stack.queue}@localhost" for n in range(2)]
    procs = [stack._spawn(["-m", "worker", "--role", "engine", "--queue", stack.queue, "--no-reaper", "--hostname", n],
                          "worker") for n in nodes]
    stack.wait_workers_ready(2)
    producer = make_producer(stack.settings)
    try:
        producer.send_engine_chunk(job_id, "capture", 0, engine_queue(stack.queue), node=nodes[1])
    finally:
        producer.close()
    # the chunk has no plan: the worker that receives it skips it without claiming it and says so in its log
    # (one log file per worker process: worker-<n>.log is nodes[n]'s)
    said = f"job {job_id} chunk capture/0: no plan"
    deadline = time.monotonic() + 60
    while said not in (stack.tmp / "worker-1.log").read_text(errors="replace"):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)
    assert job_id not in (stack.tmp / "worker-0.log").read_text(errors="replace")
    assert all(p.poll() is None for p in procs)
    with session_scope(stack.factory) as s:
        row = s.scalars(et.sa.select(et.EngineTask).where(et.EngineTask.job_id == job_id)).one()
        assert (row.state, row.worker) == ("sent", None)


def test_a_dead_attempts_release_sends_nothing(factory, tmp_path):
    """A resumed attempt's dispatcher ignores the release its killed predecessor left: its own trainer starts a
    new stream generation, so chunks of the old one would be captured for nothing."""
    import os

    job_id = new_job(factory, status="running")
    d = write_protocol(tmp_path / "run", chunks=3, released=3, generation=4)
    old = time.time() - 60
    os.utime(d / "release.json", (old, old))
    sent: list[tuple[str, int, str | None]] = []
    disp = dispatcher(factory, tmp_path, job_id, sent)
    disp.tick()
    assert sent == []
    write_protocol(tmp_path / "run", chunks=3, released=3, generation=5)  # this attempt's trainer
    disp.tick()
    assert sent == [("capture", 0, None)]
