"""At a retrain child's end: measure it beside the current draft and decide its promotion (docs/retrain.md).

    after_success(settings, factory, job_id)     # worker.tasks.run_job, once the job has succeeded
    resume_lapsed(settings, factory)             # the reaper: decisions a dead worker left undone

Only a retrain child (`service.db.promotion.retrain_of`) is measured. It is compared with the owner's
current draft for its target, else with its parent, and the parent is measured too when it is not the
current draft: `peagle.eval.compare.compare_exports`, all on the child's prompt sets in one comparison.
`peagle.eval.promotion.decide` rules at the batch sizes the owner named; the decision and every draft's
numbers are stored (`service.db.promotion.record_decision`: a job event, sent as a webhook). Where the
drafts cannot be measured here (no vLLM, or a head size this machine's vLLM refuses), or the measurement
fails, the decision is `not_measured` with the reason, and the current draft stays.

Durable: the comparison runs under a lease on the child's `retrain` row (`service.db.promotion.claim_decision`,
extended by a thread while it runs). If the worker dies mid-comparison, the lease lapses and the reaper
(`LapsedDecisions`, one thread beside its passes) runs it again; the decision is stored once
(`service.db.promotion.record_measured`): a late first holder stores nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from peagle.errors import PeagleError
from peagle.fileio import read_json
from peagle.run_folder import job_dir, job_ref, parse_job_ref
from peagle.spec import SpecInvalidError, parse_spec
from service.db import promotion
from service.db.init_from import init_source
from service.db.models import Job, PromotionDecision
from service.db.session import session_scope
from service.settings import Settings

__all__ = ["LapsedDecisions", "after_success", "checkpoint_dir", "resume_lapsed"]

log = logging.getLogger(__name__)


def checkpoint_dir(session: Session, settings: Settings, job: Job, step: int | None) -> Path | None:
    """The folder of `job`'s complete checkpoint `step` (its best one when None) still on disk; None when
    there is none (no best checkpoint, a step that never existed, an interrupted save, one retention deleted)."""
    return _checkpoint(session, settings, job, step)[0]


def _checkpoint(session: Session, settings: Settings, job: Job, step: int | None) -> tuple[Path | None, str]:
    """(`checkpoint_dir`, why it is None): the lookup a warm start makes (`service.db.init_from`)."""
    step = step if step is not None else job.best_checkpoint_step
    if step is None:
        return None, f"job {job.id} has no best checkpoint"
    found = init_source(session, int(job.owner_id), job_ref(job.id, step),
                        artifact_root=settings.resolved_artifact_root())
    return found.export_dir, found.problem or ""


def _parent_step(spec: dict[str, Any]) -> int | None:
    """The step a child's `job:<id>@step_<N>` warm start names, None for its parent's best checkpoint."""
    parent = parse_job_ref(str((spec.get("draft") or {}).get("init_from") or ""))
    return parent[1] if parent is not None else None


def after_success(settings: Settings, factory: sessionmaker[Session], job_id: str,
                  *, measure: Any = None, holder: str | None = None) -> PromotionDecision | None:
    """Compare and decide for the retrain child `job_id` (module docstring); None when it is not one, or
    when its decision is decided or measured elsewhere (another holder's lease runs).

    `measure`: `peagle.eval.serve_check.measure_vllm` (the default) or a stand-in with its signature.
    `holder`: the lease holder's name (default host:pid:random).
    """
    holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    with session_scope(factory) as s:
        if not promotion.claim_decision(s, job_id, owner=holder, lease_seconds=settings.lease_seconds):
            return None
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(settings, factory, job_id, holder, stop),
                            name=f"promotion-lease-{job_id}", daemon=True)
    beat.start()
    try:
        return _compare_and_decide(settings, factory, job_id, measure=measure)
    finally:
        stop.set()
        beat.join(timeout=5)


def _heartbeat(settings: Settings, factory: sessionmaker[Session], job_id: str, holder: str,
               stop: threading.Event) -> None:
    while not stop.wait(max(0.5, settings.lease_seconds / 3)):
        try:
            with session_scope(factory) as s:
                if not promotion.extend_decision_lease(s, job_id, owner=holder, lease_seconds=settings.lease_seconds):
                    return
        except Exception as exc:  # noqa: BLE001 - database away: the next beat tries again
            log.warning("job %s: cannot extend the promotion lease (%s)", job_id, exc)


def resume_lapsed(settings: Settings, factory: sessionmaker[Session], *, measure: Any = None) -> list[str]:
    """Run again every decision a dead worker left (`service.db.promotion.lapsed_decisions`); the ids of
    the children whose decision this call stored."""
    with session_scope(factory) as s:
        lapsed = promotion.lapsed_decisions(s, grace_seconds=2 * settings.lease_seconds)
    done = []
    for job_id in lapsed:
        log.warning("job %s: its promotion decision was left undone (worker lost); measuring again", job_id)
        if after_success(settings, factory, job_id, measure=measure) is not None:
            done.append(job_id)
    return done


class LapsedDecisions:
    """The reaper's runner of `resume_lapsed`: `poll()` starts it in a thread unless one still runs (a
    comparison takes minutes; the reaper's passes go on meanwhile)."""

    def __init__(self, settings: Settings, factory: sessionmaker[Session], *, measure: Any = None) -> None:
        self._settings, self._factory, self._measure = settings, factory, measure
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """Start a run unless one is running; True when one started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(target=self._run, name="promotion-lapsed", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        try:
            resume_lapsed(self._settings, self._factory, measure=self._measure)
        except Exception:
            log.exception("reaper: re-running lapsed promotion decisions failed")

    def join(self, timeout: float | None = None) -> None:
        """Wait for the running one (if any)."""
        if self._thread is not None:
            self._thread.join(timeout)


def _compare_and_decide(settings: Settings, factory: sessionmaker[Session], job_id: str,
                        *, measure: Any) -> PromotionDecision | None:
    from peagle.eval.compare import compare_exports, comparison_problems
    from peagle.eval.promotion import decide

    with session_scope(factory) as s:
        link = promotion.retrain_of(s, job_id)
        child = s.get(Job, job_id)
        if link is None or child is None:
            return None
        owner_id, target, sizes = link.owner_id, link.target, [int(b) for b in link.batch_sizes or [1]]
        current = next(iter(promotion.current_drafts(s, owner_id, target=target)), None)
        parent = s.get(Job, link.parent_job_id)
        found = {"child": (job_id, *_checkpoint(s, settings, child, None))}
        if current is not None and current.job_id != job_id:
            cur_job = s.get(Job, current.job_id)
            found["current"] = ((current.job_id, *_checkpoint(s, settings, cur_job, current.checkpoint_step))
                                if cur_job is not None else (current.job_id, None, f"job {current.job_id} is gone"))
        if parent is not None and (current is None or current.job_id != parent.id):
            found["parent"] = (parent.id, *_checkpoint(s, settings, parent, _parent_step(child.spec)))
        drafts: dict[str, tuple[str, Path | None]] = {name: (jid, d) for name, (jid, d, _) in found.items()}
        baseline = "current" if "current" in drafts else "parent"
        child_step, child_spec = child.best_checkpoint_step, dict(child.spec)
        child_ckpt = drafts["child"][1]
    compared_with = drafts[baseline][0] if baseline in drafts else None
    exports = {name: d for name, (_, d) in drafts.items() if d is not None}
    numbers: dict[str, Any] = {"jobs": {name: jid for name, (jid, _) in drafts.items()}, "baseline": baseline}
    missing = [f"{name} ({jid}): no checkpoint ({why})" for name, (jid, d, why) in found.items() if d is None]
    problems = missing or comparison_problems(exports)
    if problems:
        verdict: dict[str, Any] = {"decision": "not_measured", "reason": "not measured: " + "; ".join(problems)}
    else:
        try:
            # the spec the trainer ran (uploaded prompt sets as local files), else the job's own
            spec = parse_spec(read_json(job_dir(settings.resolved_artifact_root(), job_id) / "job_spec.json") or child_spec)
            res = compare_exports(exports, spec, batch_sizes=sizes, heldout_from=child_ckpt, measure=measure,
                                  log=lambda m: log.info("job %s promotion: %s", job_id, m))
        except (PeagleError, SpecInvalidError, OSError, ValueError, RuntimeError) as exc:
            log.warning("job %s: the promotion comparison failed: %s", job_id, exc)
            verdict = {"decision": "not_measured", "reason": f"not measured: the comparison failed "
                                                             f"({type(exc).__name__}: {str(exc)[:300]})"}
        else:
            numbers.update({"method": res["method"], "rounds": res["rounds"], "order": res["order"],
                            **res["drafts"]})
            verdict = decide(res["drafts"].get("child"), res["drafts"].get(baseline), sizes).to_dict()
            numbers["rows"] = verdict.get("rows")
    with session_scope(factory) as s:
        return promotion.record_measured(
            s, owner_id=owner_id, target=target, job_id=job_id, decision=verdict["decision"],
            decided_by="measurement", compared_with=compared_with, reason=verdict["reason"], batch_sizes=sizes,
            numbers=numbers, checkpoint_step=child_step)
