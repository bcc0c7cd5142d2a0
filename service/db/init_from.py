"""Where a job's warm start (`draft.init_from`, `peagle.spec.init_from`) lives on this server, for its owner.

    found = init_source(session, owner_id, "job:job_01...@step_40", artifact_root=root)
    found.export_dir  # the export folder (config.json + model.safetensors), or None with found.problem

One lookup for the API (which checks the source against the spec before queueing) and the worker (which
hands the trainer the folder when an attempt starts). Owner-scoped like datasets: another owner's job or
upload reads "no job 'X'" / "no draft 'X'", exactly as a missing one does.

- `job:<id>`: the owner's SUCCEEDED job, its best checkpoint;
- `job:<id>@step_<N>`: the owner's job (any status), its complete checkpoint of step N still on disk;
- `draft:<id>`: the owner's uploaded draft (`POST /v1/drafts`) with status `ready`;
- a folder: never through the service (a problem marked `forbidden`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from peagle.spec.init_from import parse_init_from
from service.db import states
from service.db.models import Checkpoint, DraftUpload, Job

__all__ = ["COMPLETE_MARKER", "DRAFT_READY", "InitSource", "init_source"]

#: The marker the trainer writes last into a checkpoint folder (`peagle.train.checkpoint.COMPLETE`).
COMPLETE_MARKER = "COMPLETE"
#: Status of an uploaded draft that passed the export validator.
DRAFT_READY = "ready"


@dataclass(frozen=True)
class InitSource:
    """The export folder of a warm start's source, or why there is none (`forbidden`: not the owner's to
    name, or not something the service takes; a 422 even for a dry run)."""

    export_dir: Path | None
    problem: str | None = None
    forbidden: bool = False


def _job_dir(job: Job, artifact_root: Path | None) -> Path | None:
    """The job's run directory (`artifact_dir`, relative to the artifact root unless absolute); None when
    it is relative and no root is given."""
    p = Path(job.artifact_dir or job.id)
    if p.is_absolute():
        return p
    return artifact_root / p if artifact_root is not None else None


def init_source(session: Session, owner_id: int, value: str, *, artifact_root: Path | None) -> InitSource:
    """The export folder `value` names for `owner_id` (module docstring), or the problem; `artifact_root`
    (`Settings.resolved_artifact_root()`) places a job's relative `artifact_dir`."""
    try:
        ref = parse_init_from(value)
    except ValueError as exc:
        return InitSource(None, str(exc), forbidden=True)
    if ref.kind == "path":
        return InitSource(None, "a local folder is for `peagle train --init-from`; through the service name "
                          "job:<id>, job:<id>@step_<N> or draft:<upload id>", forbidden=True)
    if ref.kind == "draft":
        up = session.get(DraftUpload, ref.ref)
        if up is None or up.owner_id != owner_id:
            return InitSource(None, f"no draft {ref.ref!r}", forbidden=True)
        if up.status != DRAFT_READY:
            return InitSource(None, f"draft {up.id} is {up.status}: see GET /v1/drafts/{up.id}")
        return InitSource(Path(up.path))
    job = session.get(Job, ref.ref)
    if job is None or job.owner_id != owner_id:
        return InitSource(None, f"no job {ref.ref!r}", forbidden=True)
    step = ref.step
    if step is None:
        if job.status != states.SUCCEEDED or job.best_checkpoint_step is None:
            return InitSource(None, f"job {job.id} is {job.status}, not succeeded with a best checkpoint: wait for "
                              f"it, or name one of its checkpoints (job:{job.id}@step_<N>)")
        step = job.best_checkpoint_step
    ck = session.query(Checkpoint).filter_by(job_id=job.id, step=step, complete=True).one_or_none()
    run = _job_dir(job, artifact_root)
    root = run.resolve() if run is not None else None
    folder = (root / ck.dir).resolve() if ck is not None and root is not None else None
    if folder is None or root is None or not folder.is_relative_to(root) \
            or not (folder / COMPLETE_MARKER).is_file() or not (folder / "config.json").is_file():
        return InitSource(None, f"job {job.id} has no complete checkpoint at step {step} (retention keeps the "
                          "newest ones and the best)")
    return InitSource(folder)
