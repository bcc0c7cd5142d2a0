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

from peagle.run_folder import is_complete, job_dir, job_ref, resolve_inside
from peagle.spec.init_from import parse_init_from
from service.db import states
from service.db.models import Checkpoint, DraftUpload, Job

__all__ = ["DRAFT_READY", "InitSource", "init_source"]

#: Status of an uploaded draft that passed the export validator.
DRAFT_READY = "ready"


@dataclass(frozen=True)
class InitSource:
    """The export folder of a warm start's source, or why there is none (`forbidden`: not the owner's to
    name, or not something the service takes; a 422 even for a dry run)."""

    export_dir: Path | None
    problem: str | None = None
    forbidden: bool = False


def _run_folder(job: Job, artifact_root: Path | None) -> Path | None:
    """The job's run folder (`peagle.run_folder.job_dir`); None when it is relative and no root is given."""
    if artifact_root is None:  # only an absolute artifact_dir (the worker writes those) places it then
        return Path(job.artifact_dir) if job.artifact_dir and Path(job.artifact_dir).is_absolute() else None
    return job_dir(artifact_root, job.id, artifact_dir=job.artifact_dir)


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
                              f"it, or name one of its checkpoints ({job_ref(job.id)}@step_<N>)")
        step = job.best_checkpoint_step
    ck = session.query(Checkpoint).filter_by(job_id=job.id, step=step, complete=True).one_or_none()
    run = _run_folder(job, artifact_root)
    folder = resolve_inside(run, ck.dir) if ck is not None and run is not None else None
    if folder is None or not is_complete(folder) or not (folder / "config.json").is_file():
        return InitSource(None, f"job {job.id} has no complete checkpoint at step {step} (retention keeps the "
                          "newest ones and the best)")
    return InitSource(folder)
