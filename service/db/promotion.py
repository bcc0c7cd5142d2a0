"""Promotion in the database: retrain children, the current draft per owner and target, the decisions log.

    add_retrain(s, child_job_id=..., parent_job_id=..., owner_id=..., target=..., batch_sizes=[1, 8])
    record_decision(s, owner_id=..., target=..., job_id=child, decision="promoted", numbers={...}, ...)
    undo(s, owner_id=..., target=..., decided_by="alice")
    claim_decision(s, child, owner="w1:123", lease_seconds=60)   # the measured decision's lease
    record_measured(s, owner_id=..., ..., job_id=child, ...)      # stored once, None when already decided
    lapsed_decisions(s, grace_seconds=60)                         # for the reaper to re-run

A retrain child's measured decision is durable: `retrain.decision_state` goes pending -> running (a lease
held by the worker, or the reaper, that measures) -> decided. A running one whose lease lapsed, and a
pending one whose child succeeded `grace_seconds` ago, are `lapsed_decisions`; `record_measured` stores the
decision only where it moves the row to `decided` in the same transaction, so it is stored once.

One current draft per (owner, target) (`current_draft`). Every decision is a `promotion_decision` row
with both sides' numbers and the current draft before and after it; `promoted` and `forced` make the
job current, `undone` puts back the current draft from before the decision that made the undone one
current. Each decision is also an event of kind `promotion` on the job it is about (the job page shows
it, and `service.db.webhooks` sends it as `draft.promoted` / `draft.promotion_declined` /
`draft.promotion_undone`). The owner's write lock (`service.db.jobs.lock_owner`) serialises decisions.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db import states
from service.db.events import add_event
from service.db.jobs import lock_owner
from service.db.models import CurrentDraft, Job, PromotionDecision, Retrain, new_id, utcnow

__all__ = [
    "MAKES_CURRENT",
    "add_retrain",
    "claim_decision",
    "current_drafts",
    "current_out",
    "decision_out",
    "decisions",
    "extend_decision_lease",
    "lapsed_decisions",
    "record_decision",
    "record_measured",
    "retrain_of",
    "undo",
]

#: Decisions that make their job the current draft.
MAKES_CURRENT = ("promoted", "forced")
#: Decisions `record_decision` stores (`undone` is `undo`'s).
_RECORDED = ("promoted", "declined", "not_measured", "forced")


def add_retrain(session: Session, *, child_job_id: str, parent_job_id: str, owner_id: int, target: str,
                batch_sizes: list[int]) -> Retrain:
    """Record that `child_job_id` retrains `parent_job_id` (flushed, not committed)."""
    row = Retrain(child_job_id=child_job_id, parent_job_id=parent_job_id, owner_id=owner_id, target=target,
                  batch_sizes=list(batch_sizes), created_at=utcnow())
    session.add(row)
    session.flush()
    return row


def retrain_of(session: Session, child_job_id: str) -> Retrain | None:
    """The retrain record of a job (None: not a retrain child)."""
    return session.get(Retrain, child_job_id)


def current_drafts(session: Session, owner_id: int, *, target: str | None = None) -> list[CurrentDraft]:
    """The owner's current drafts (one per target), by target."""
    q = sa.select(CurrentDraft).where(CurrentDraft.owner_id == owner_id)
    if target is not None:
        q = q.where(CurrentDraft.target == target)
    return list(session.scalars(q.order_by(CurrentDraft.target)))


def decisions(session: Session, owner_id: int, *, target: str | None = None, job_id: str | None = None,
              limit: int = 50) -> list[PromotionDecision]:
    """The owner's decisions, newest first (about `job_id`, or compared with it, when given)."""
    q = sa.select(PromotionDecision).where(PromotionDecision.owner_id == owner_id)
    if target is not None:
        q = q.where(PromotionDecision.target == target)
    if job_id is not None:
        q = q.where(sa.or_(PromotionDecision.job_id == job_id, PromotionDecision.compared_with == job_id))
    return list(session.scalars(q.order_by(PromotionDecision.id.desc()).limit(limit)))


def _event(session: Session, row: PromotionDecision) -> None:
    """The decision as an event of its job (kind `promotion`; a job that is gone gets none)."""
    attempt = session.scalar(sa.select(Job.attempt).where(Job.id == row.job_id))
    if attempt is None:
        return
    what = {"promoted": "promoted to the current draft", "forced": "made the current draft by its owner (forced)",
            "declined": "not promoted", "not_measured": "not promoted (not measured)",
            "undone": "promotion undone"}[row.decision]
    add_event(session, row.job_id, kind="promotion", attempt=int(attempt),
              message=f"{what} for {row.target}" + (f": {row.reason}" if row.reason else ""),
              data={"decision": row.decision, "decision_id": row.id, "target": row.target,
                    "compared_with": row.compared_with, "current_before": row.current_before,
                    "current_after": row.current_after, "forced": row.forced, "reason": row.reason,
                    "batch_sizes": list(row.batch_sizes or [])})


def record_decision(
    session: Session, *, owner_id: int, target: str, job_id: str, decision: str, decided_by: str,
    compared_with: str | None = None, reason: str = "", batch_sizes: list[int] | None = None,
    numbers: dict[str, Any] | None = None, checkpoint_step: int | None = None, now: datetime | None = None,
) -> PromotionDecision:
    """Store a decision about `job_id` (and, for `promoted` / `forced`, make it current); its job event too.

    Commits. `decision` is one of `peagle.eval.promotion.DECISIONS` except `undone` (see `undo`). A decision
    that makes a job current names a complete checkpoint on disk: the caller checks it with
    `service.db.init_from.init_source` (`job:<id>@step_<N>`), as the forced promotion route does.
    """
    if decision not in _RECORDED:
        raise ValueError(f"decision: {decision!r} is not a decision to record (undo() undoes)")
    now = now or utcnow()
    lock_owner(session, owner_id=owner_id)
    cur = session.get(CurrentDraft, (owner_id, target))
    before = cur.job_id if cur is not None else None
    row = PromotionDecision(
        id=new_id("prom"), owner_id=owner_id, target=target, job_id=job_id, compared_with=compared_with,
        current_before=before, current_after=job_id if decision in MAKES_CURRENT else before, decision=decision,
        forced=decision == "forced", decided_by=decided_by[:200], reason=reason, batch_sizes=list(batch_sizes or []),
        numbers={**(numbers or {}), "checkpoint_step": checkpoint_step}, created_at=now)
    session.add(row)
    if decision in MAKES_CURRENT:
        _set_current(session, cur, owner_id=owner_id, target=target, job_id=job_id, step=checkpoint_step,
                     decision_id=row.id, now=now)
    session.flush()
    _event(session, row)
    session.commit()
    return row


def claim_decision(session: Session, child_job_id: str, *, owner: str, lease_seconds: float,
                   now: datetime | None = None) -> bool:
    """Take the lease of `child_job_id`'s measured decision (pending, or running with a lapsed lease); commits.

    False: not a retrain child, already decided, or another holder's lease is still running.
    """
    now = now or utcnow()
    res = session.execute(
        sa.update(Retrain)
        .where(Retrain.child_job_id == child_job_id,
               sa.or_(Retrain.decision_state == "pending",
                      sa.and_(Retrain.decision_state == "running",
                              sa.or_(Retrain.decision_lease_expires_at.is_(None),
                                     Retrain.decision_lease_expires_at < now))))
        .values(decision_state="running", decision_owner=owner[:200],
                decision_lease_expires_at=now + timedelta(seconds=lease_seconds),
                decision_attempts=Retrain.decision_attempts + 1)
        .execution_options(synchronize_session=False))
    session.commit()
    return bool(getattr(res, "rowcount", 0) == 1)


def extend_decision_lease(session: Session, child_job_id: str, *, owner: str, lease_seconds: float) -> bool:
    """Extend the lease `owner` holds (False: lost it, or decided); commits."""
    res = session.execute(
        sa.update(Retrain)
        .where(Retrain.child_job_id == child_job_id, Retrain.decision_state == "running",
               Retrain.decision_owner == owner[:200])
        .values(decision_lease_expires_at=utcnow() + timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False))
    session.commit()
    return bool(getattr(res, "rowcount", 0) == 1)


def lapsed_decisions(session: Session, *, grace_seconds: float, now: datetime | None = None) -> list[str]:
    """Succeeded retrain children whose decision nobody will store unless re-run: running with a lapsed
    lease, or pending though the child succeeded over `grace_seconds` ago (its worker died before it began)."""
    now = now or utcnow()
    q = (sa.select(Retrain.child_job_id).join(Job, Job.id == Retrain.child_job_id)
         .where(Job.status == states.SUCCEEDED,
                sa.or_(sa.and_(Retrain.decision_state == "running",
                               sa.or_(Retrain.decision_lease_expires_at.is_(None),
                                      Retrain.decision_lease_expires_at < now)),
                       sa.and_(Retrain.decision_state == "pending",
                               sa.or_(Job.finished_at.is_(None),
                                      Job.finished_at < now - timedelta(seconds=grace_seconds)))))
         .order_by(Retrain.created_at))
    return list(session.scalars(q))


def record_measured(session: Session, *, job_id: str, **kw: Any) -> PromotionDecision | None:
    """`record_decision` for a retrain child's measured decision, stored once: only where this transaction
    moves its `retrain` row to `decided` (None: it was decided already, e.g. by a late first holder)."""
    lock_owner(session, owner_id=int(kw["owner_id"]))
    res = session.execute(
        sa.update(Retrain).where(Retrain.child_job_id == job_id, Retrain.decision_state != "decided")
        .values(decision_state="decided", decision_lease_expires_at=None)
        .execution_options(synchronize_session=False))
    if getattr(res, "rowcount", 0) != 1:
        session.rollback()
        return None
    return record_decision(session, job_id=job_id, **kw)


def _set_current(session: Session, cur: CurrentDraft | None, *, owner_id: int, target: str, job_id: str | None,
                 step: int | None, decision_id: str, now: datetime) -> None:
    if job_id is None:
        if cur is not None:
            session.delete(cur)
        return
    if cur is None:
        session.add(CurrentDraft(owner_id=owner_id, target=target, job_id=job_id, checkpoint_step=step,
                                 decision_id=decision_id, updated_at=now))
    else:
        cur.job_id, cur.checkpoint_step, cur.decision_id, cur.updated_at = job_id, step, decision_id, now


def undo(session: Session, *, owner_id: int, target: str, decided_by: str) -> PromotionDecision | None:
    """Put back the current draft from before the decision that made today's current one current (none:
    no current draft). Commits; returns the `undone` decision, or None when there is nothing to undo."""
    now = utcnow()
    lock_owner(session, owner_id=owner_id)
    cur = session.get(CurrentDraft, (owner_id, target))
    if cur is None:
        session.rollback()
        return None
    setter = session.get(PromotionDecision, cur.decision_id) if cur.decision_id else None
    back = setter.current_before if setter is not None else None
    step = None
    if back is not None:  # the step it was current at: from the decision that made it current
        made = session.scalar(sa.select(PromotionDecision).where(
            PromotionDecision.owner_id == owner_id, PromotionDecision.target == target,
            PromotionDecision.current_after == back, PromotionDecision.decision.in_(MAKES_CURRENT))
            .order_by(PromotionDecision.id.desc()).limit(1))
        step = (made.numbers or {}).get("checkpoint_step") if made is not None else None
    row = PromotionDecision(
        id=new_id("prom"), owner_id=owner_id, target=target, job_id=cur.job_id, compared_with=None,
        current_before=cur.job_id, current_after=back, decision="undone", forced=False, decided_by=decided_by[:200],
        reason=f"the current draft goes back to {back}" if back else "no current draft any more",
        batch_sizes=[], numbers={"checkpoint_step": step}, created_at=now)
    session.add(row)
    session.flush()
    # the undo's "previous" is the one before the decision it undid: a second undo walks further back
    prev_setter = None
    if back is not None:
        prev_setter = session.scalar(sa.select(PromotionDecision.id).where(
            PromotionDecision.owner_id == owner_id, PromotionDecision.target == target,
            PromotionDecision.current_after == back, PromotionDecision.decision.in_(MAKES_CURRENT),
            PromotionDecision.id < (setter.id if setter is not None else row.id))
            .order_by(PromotionDecision.id.desc()).limit(1))
    _set_current(session, cur, owner_id=owner_id, target=target, job_id=back, step=step,
                 decision_id=prev_setter or row.id, now=now)
    _event(session, row)
    session.commit()
    return row


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat().replace("+00:00", "Z")


def decision_out(d: PromotionDecision) -> dict[str, Any]:
    """Public form of a decision."""
    return {"id": d.id, "object": "promotion_decision", "target": d.target, "job_id": d.job_id,
            "compared_with": d.compared_with, "current_before": d.current_before, "current_after": d.current_after,
            "decision": d.decision, "forced": d.forced, "decided_by": d.decided_by, "reason": d.reason,
            "batch_sizes": list(d.batch_sizes or []), "numbers": d.numbers or {}, "created_at": _iso(d.created_at)}


def current_out(c: CurrentDraft) -> dict[str, Any]:
    """Public form of a current draft."""
    return {"object": "current_draft", "target": c.target, "job_id": c.job_id, "checkpoint_step": c.checkpoint_step,
            "decision_id": c.decision_id, "updated_at": _iso(c.updated_at)}
