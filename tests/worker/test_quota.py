"""Worker-side `max_concurrent_jobs`: a claim never starts a job past its owner's running limit.

Lease level on SQLite and PostgreSQL (including racing claims from threads), then real worker processes.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa

from peagle.spec import preset
from service.db import lease as L
from service.db import requeue as R
from service.db import states
from service.db.models import Job, JobEvent, Owner, utcnow
from service.db.session import make_engine, make_session_factory, session_scope


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.integration)])
def factory(request, tmp_path):
    from service.db import upgrade

    url = f"sqlite:///{tmp_path / 'db.sqlite'}" if request.param == "sqlite" else request.getfixturevalue(
        "postgres_url")
    upgrade(url)
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def new_job(factory, owner="t", status="queued"):
    with session_scope(factory) as s:
        o = s.scalar(sa.select(Owner).where(Owner.name == owner))
        if o is None:
            o = Owner(name=owner)
            s.add(o)
            s.flush()
        job = Job(owner_id=o.id, spec=preset("tiny").model_dump(mode="json"), status=status, progress={},
                  queue="cpu", queued_at=utcnow(), celery_task_id="task-1")
        s.add(job)
        s.flush()
        return job.id


def claim(factory, job_id, limit, owner="w"):
    with session_scope(factory) as s:
        return L.claim_job(s, job_id, owner=owner, lease_seconds=60, artifact_dir="/tmp/x", max_concurrent=limit)


def test_claim_respects_owner_limit_and_defers(factory):
    a1, a2, a3 = (new_job(factory) for _ in range(3))
    other = new_job(factory, owner="other")
    assert claim(factory, a1, 2) is not None and claim(factory, a2, 2) is not None
    with pytest.raises(L.ConcurrencyLimited) as err:
        claim(factory, a3, 2)
    assert (err.value.running, err.value.limit) == (2, 2)
    assert claim(factory, other, 2) is not None  # another owner is not limited
    for _ in range(2):  # deferring twice records one event
        with session_scope(factory) as s:
            assert L.defer_claim(s, a3, running=2, limit=2)
    with factory() as s:
        job = s.get(Job, a3)
        assert (job.status, job.phase, job.celery_task_id) == (states.QUEUED, L.QUOTA_WAIT, None)
        events = s.scalars(sa.select(JobEvent).where(JobEvent.job_id == a3)).all()
        assert [e.kind for e in events] == ["waiting"] and "max_concurrent_jobs=2" in events[0].message
        unsent = R.unsent_queued_jobs(s, older_than=0.0, now=utcnow() + timedelta(seconds=1))
    assert a3 in [j for j, _ in unsent]  # the reaper's sweep re-sends it later
    with session_scope(factory) as s:  # one of the owner's jobs ends: the waiting one may start
        s.execute(sa.update(Job).where(Job.id == a1).values(status=states.SUCCEEDED, lease_owner=None))
    lease = claim(factory, a3, 2)
    assert lease is not None
    with factory() as s:
        assert s.get(Job, a3).phase is None
    cancelled = new_job(factory, status="cancelled")
    assert claim(factory, cancelled, 2) is None  # not queued: None, not ConcurrencyLimited


def test_racing_claims_never_exceed_the_limit(factory):
    jobs = [new_job(factory) for _ in range(6)]
    results: list[object] = []
    barrier = threading.Barrier(len(jobs))

    def worker(job_id: str) -> None:
        barrier.wait()
        try:
            results.append(claim(factory, job_id, 2, owner=f"w-{job_id}"))
        except L.ConcurrencyLimited as exc:
            results.append(exc)

    threads = [threading.Thread(target=worker, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    leases = [r for r in results if isinstance(r, L.Lease)]
    assert len(results) == 6 and len(leases) == 2
    with factory() as s:
        running = s.scalar(sa.select(sa.func.count()).select_from(Job).where(Job.status == states.RUNNING))
    assert running == 2


@pytest.mark.integration
def test_real_workers_run_one_job_at_a_time_per_owner(make_stack, spec_for):
    """Two workers, one owner with max_concurrent_jobs=1: the jobs run one after the other, both finish."""
    stack = make_stack("embedded")
    env = {"PEAGLE_MAX_CONCURRENT_JOBS": "1", "FAKE_STEP_SECONDS": "0.15"}
    stack.start_worker(env=env)
    stack.start_worker(env=env)
    stack._spawn(["-m", "worker.reaper", "--interval", "0.5", "--no-webhooks"], "reaper", env)
    stack.wait_workers_ready(2)  # both consume before anything is sent: the idle one must take the second job
    a = stack.submit(spec_for(steps=24, every=8))
    stack.wait_status(a, "running")
    b = stack.submit(spec_for(steps=12, every=4))
    seen_both = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ja, jb = stack.job(a), stack.job(b)
        seen_both |= ja.status in L.LEASED and jb.status in L.LEASED
        if ja.status in states.TERMINAL and jb.status in states.TERMINAL:
            break
        time.sleep(0.05)
    assert (stack.job(a).status, stack.job(b).status) == ("succeeded", "succeeded"), stack.logs()
    assert not seen_both, "both jobs of one owner ran at once"
    waited = [e for j in (a, b) for e in stack.rows(JobEvent, j) if e.kind == "waiting"]
    assert waited, "the second job was never deferred\n" + stack.logs()


@pytest.mark.integration
def test_a_busy_worker_never_holds_a_second_job_while_another_is_idle(make_stack, spec_for):
    """Two workers, no limit: the second job starts on the idle worker while the first still trains
    (with early acks, the busy worker prefetched it and kept it until its own job ended)."""
    stack = make_stack("embedded")
    env = {"FAKE_STEP_SECONDS": "0.15"}
    stack.start_worker(env=env)
    stack.start_worker(env=env)
    stack.wait_workers_ready(2)
    a = stack.submit(spec_for(steps=40, every=20))
    stack.wait_status(a, "running")
    b = stack.submit(spec_for(steps=8, every=4))
    stack.wait_status(b, "succeeded", timeout=60)
    assert stack.job(a).status == "running", "the second job waited for the first one's worker"
    stack.wait_status(a, "succeeded", timeout=60)
