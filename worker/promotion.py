"""At a retrain child's end: measure it beside the current draft and decide its promotion (docs/retrain.md).

    after_success(settings, factory, job_id)     # worker.tasks.run_job, once the job has succeeded

Only a retrain child (`service.db.promotion.retrain_of`) is measured. It is compared with the owner's
current draft for its target, else with its parent, and the parent is measured too when it is not the
current draft: `peagle.eval.compare.compare_exports`, all on the child's prompt sets in one comparison.
`peagle.eval.promotion.decide` rules at the batch sizes the owner named; the decision and every draft's
numbers are stored (`service.db.promotion.record_decision`: a job event, sent as a webhook). Where the
drafts cannot be measured here (no vLLM, or a head size this machine's vLLM refuses), or the measurement
fails, the decision is `not_measured` with the reason, and the current draft stays.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from peagle.errors import PeagleError
from peagle.fileio import read_json
from peagle.spec import SpecInvalidError, parse_spec
from service.db import promotion
from service.db.models import Job, PromotionDecision
from service.db.session import session_scope
from service.settings import Settings

__all__ = ["after_success", "checkpoint_dir"]

log = logging.getLogger(__name__)


def checkpoint_dir(settings: Settings, job: Job, step: int | None) -> Path | None:
    """The folder of `job`'s checkpoint `step` (its best one when None); None when it has none."""
    step = step if step is not None else job.best_checkpoint_step
    if step is None:
        return None
    root = settings.resolved_artifact_root()
    run = Path(job.artifact_dir) if job.artifact_dir else root / job.id
    run = run if run.is_absolute() else root / run
    return run / "checkpoints" / f"step_{step:06d}"


def _parent_step(spec: dict[str, Any]) -> int | None:
    value = str((spec.get("draft") or {}).get("init_from") or "")
    tail = value.rpartition("@step_")[2] if "@step_" in value else ""
    return int(tail) if tail.isdigit() else None


def after_success(settings: Settings, factory: sessionmaker[Session], job_id: str,
                  *, measure: Any = None) -> PromotionDecision | None:
    """Compare and decide for the retrain child `job_id` (module docstring); None when it is not one.

    `measure`: `peagle.eval.serve_check.measure_vllm` (the default) or a stand-in with its signature.
    """
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
        drafts: dict[str, tuple[str, Path | None]] = {"child": (job_id, checkpoint_dir(settings, child, None))}
        if current is not None and current.job_id != job_id:
            cur_job = s.get(Job, current.job_id)
            drafts["current"] = (current.job_id, checkpoint_dir(settings, cur_job, current.checkpoint_step)
                                 if cur_job is not None else None)
        if parent is not None and (current is None or current.job_id != parent.id):
            drafts["parent"] = (parent.id, checkpoint_dir(settings, parent, _parent_step(child.spec)))
        baseline = "current" if "current" in drafts else "parent"
        child_step, child_spec = child.best_checkpoint_step, dict(child.spec)
        child_ckpt = drafts["child"][1]
    compared_with = drafts[baseline][0] if baseline in drafts else None
    exports = {name: d for name, (_, d) in drafts.items() if d is not None}
    numbers: dict[str, Any] = {"jobs": {name: jid for name, (jid, _) in drafts.items()}, "baseline": baseline}
    missing = [f"{name} ({jid}): no checkpoint" for name, (jid, d) in drafts.items() if d is None]
    problems = missing or comparison_problems(exports)
    if problems:
        verdict: dict[str, Any] = {"decision": "not_measured", "reason": "not measured: " + "; ".join(problems)}
    else:
        try:
            # the spec the trainer ran (uploaded prompt sets as local files), else the job's own
            spec = parse_spec(read_json(settings.resolved_artifact_root() / job_id / "job_spec.json") or child_spec)
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
        return promotion.record_decision(
            s, owner_id=owner_id, target=target, job_id=job_id, decision=verdict["decision"],
            decided_by="measurement", compared_with=compared_with, reason=verdict["reason"], batch_sizes=sizes,
            numbers=numbers, checkpoint_step=child_step)
