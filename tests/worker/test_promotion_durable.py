"""A retrain child's promotion decision survives its worker dying mid-comparison (issue 38): on a migrated
SQLite database, the worker's lease is taken and never finished; once it lapses, a reaper pass measures again
and stores the decision once, and the late first holder stores nothing. The children have no checkpoint, so
the comparison decides `not_measured` at once (no vLLM needed for the durability under test)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from service.db import promotion
from service.db.models import Job, Retrain, utcnow
from service.db.session import session_scope
from service.settings import Settings
from tests.worker.conftest import new_job
from worker.promotion import LapsedDecisions, after_success
from worker.reaper import reap_once


def _child(factory: Any, *, finished_ago: float) -> tuple[str, str, int]:
    parent, child = new_job(factory, status="succeeded"), new_job(factory, status="succeeded")
    with session_scope(factory) as s:
        s.execute(sa.update(Job).where(Job.id == child)
                  .values(finished_at=utcnow() - timedelta(seconds=finished_ago)))
        job = s.get(Job, child)
        assert job is not None
        owner_id = int(job.owner_id)
        promotion.add_retrain(s, child_job_id=child, parent_job_id=parent, owner_id=owner_id,
                              target="tiny", batch_sizes=[1])
    return parent, child, owner_id


def _reap(settings: Settings, factory: Any) -> None:
    decisions = LapsedDecisions(settings, factory)
    reap_once(factory, None, decisions=decisions)
    decisions.join(timeout=60)


def _decisions(factory: Any, owner_id: int, child: str) -> list[Any]:
    with session_scope(factory) as s:
        return [promotion.decision_out(d) for d in promotion.decisions(s, owner_id, job_id=child)]


def test_a_decision_a_dead_worker_left_is_stored_once_by_the_reaper(factory: Any, tmp_path: Path) -> None:
    settings = Settings(artifact_root=tmp_path / "art", lease_seconds=30)
    parent, child, owner_id = _child(factory, finished_ago=1)
    with session_scope(factory) as s:  # the worker took the comparison's lease, then died
        assert promotion.claim_decision(s, child, owner="dead-worker", lease_seconds=30)
    _reap(settings, factory)  # its lease runs: nothing to re-run
    assert _decisions(factory, owner_id, child) == []
    assert after_success(settings, factory, child) is None  # nor can another worker take it meanwhile
    with session_scope(factory) as s:
        s.execute(sa.update(Retrain).where(Retrain.child_job_id == child)
                  .values(decision_lease_expires_at=utcnow() - timedelta(seconds=1)))
    _reap(settings, factory)
    (d,) = _decisions(factory, owner_id, child)
    assert (d["decision"], d["decided_by"], d["compared_with"]) == ("not_measured", "measurement", parent)
    assert "no checkpoint" in d["reason"]
    _reap(settings, factory)  # decided: a second pass re-runs nothing
    with session_scope(factory) as s:  # the dead worker's late store is refused
        assert promotion.record_measured(s, owner_id=owner_id, target="tiny", job_id=child, decision="declined",
                                         decided_by="measurement") is None
        assert not promotion.extend_decision_lease(s, child, owner="dead-worker", lease_seconds=30)
        row = s.get(Retrain, child)
        assert row is not None
        assert (row.decision_state, row.decision_attempts) == ("decided", 2)
    assert len(_decisions(factory, owner_id, child)) == 1


def test_a_decision_never_begun_is_run_by_the_reaper_after_a_lease(factory: Any, tmp_path: Path) -> None:
    settings = Settings(artifact_root=tmp_path / "art", lease_seconds=30)
    _, fresh, owner_id = _child(factory, finished_ago=1)  # its worker is about to begin it
    _, lost, _ = _child(factory, finished_ago=120)  # its worker died between success and the comparison
    _reap(settings, factory)
    assert _decisions(factory, owner_id, fresh) == []
    assert [d["decision"] for d in _decisions(factory, owner_id, lost)] == ["not_measured"]
    assert after_success(settings, factory, fresh) is not None  # the worker's own path still decides
    assert after_success(settings, factory, fresh) is None  # once
    assert len(_decisions(factory, owner_id, fresh)) == 1
